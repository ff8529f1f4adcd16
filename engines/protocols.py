"""The seams between the actors and the compute engines they hold.

A rollout engine turns prompts into completions with per-token log-probs and accepts new
weights; a streaming one also runs one request per sample, stepped by its caller (the
rollout worker's ``stream``). A train engine takes a policy-gradient step and hands out its
weights. vLLM implements the first two (``engines/vllm_rollout.py``); torch and DeepSpeed
(ZeRO) the third. The rollout worker and the trainer actor hold an engine through these
Protocols, so other generators and trainers plug in behind the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sluice.rl.batching import Sample
from sluice.storage.params import NamedTensors


@dataclass(frozen=True)
class Completion:
    """One sampled response: its tokens, their log-probs under the generating policy, its text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # False when it hit max_new_tokens before EOS


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[str], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt; temperature 0 means greedy."""
        ...

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        """The token ids the engine feeds the model for each prompt (BOS included)."""
        ...

    def load_weights(self, weights: NamedTensors | list[bytes], version: int) -> None:
        """Replace the live model's weights with ``weights``: ``(name, tensor)`` pairs (a
        pulled ``storage.params.Weights`` reads them lazily, bucket by bucket), or
        safetensors files in memory; later generations use them."""
        ...

    def version(self) -> int:
        """The policy version of the weights now loaded (0 = the starting policy)."""
        ...


@dataclass(frozen=True)
class Delta:
    """What one engine step added to one streaming request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None


@runtime_checkable
class StreamingRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine whose caller runs one request per sample and steps the engine."""

    def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> None:
        """Queue one sample of a tokenized prompt; the next ``step`` takes it in."""
        ...

    def step(self) -> list[Delta]:
        """One engine step: the tokens running samples gained, and which finished."""
        ...

    def generated(self, request_id: str) -> int | None:
        """Tokens generated so far for a running request (None: not running here)."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Drop running requests."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """The text of a completion's tokens, special tokens left out."""
        ...

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` appended mid-sequence (an environment's turn): no
        special tokens added."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimiser step on ``samples``; returns loss and diagnostics."""
        ...

    def weights(self) -> bytes:
        """The current weights as a safetensors blob (names as in the model folder)."""
        ...

    def version(self) -> int:
        """Optimiser steps taken so far."""
        ...

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder (safetensors + tokenizer)."""
        ...
