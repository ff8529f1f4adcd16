"""The seams between the actors and the compute engines they hold.

A rollout engine turns prompts into completions with per-token log-probs and accepts new
weights; a streaming one also runs one request per sample, stepped by its caller (the
rollout worker's ``stream``). A train engine takes a policy-gradient step, hands out its
weights and checkpoints. vLLM implements the first two (``engines/rollout/vllm_engine.py``); the
trainer (``engines/train/trainer.py``, on torch/DDP, FSDP2 or DeepSpeed ZeRO) the third. The
rollout worker and the trainer actor hold an engine through these Protocols, so other
generators and trainers plug in behind the same methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from sluice.rl.batching import Sample, TrainBatch
from sluice.storage.params import NamedTensors
from sluice.storage.safetensors_stream import Streamed


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
    """What a rank of the training pool (``engines/train/pool.py``) calls on its engine
    (``engines.train.trainer.PolicyTrainer``). Methods that gather sharded weights are
    collective: every rank of the pool calls them."""

    @property
    def pad_id(self) -> int:
        """The token id the batches are padded with."""
        ...

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded across ranks: publish them through ``layout``
        and ``gathered``, not ``state``."""
        ...

    def version(self) -> int:
        """Optimiser steps taken so far."""
        ...

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on this rank's share of a batch; returns loss and diagnostics
        over every rank."""
        ...

    def state(self) -> dict[str, torch.Tensor]:
        """The weights to publish by name (the adapter's under LoRA)."""
        ...

    def layout(self) -> dict[str, torch.Tensor]:
        """``state``'s names, shapes and dtypes as meta tensors (nothing gathered)."""
        ...

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s tensors one at a time, gathered as they are asked for."""
        ...

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The weights as CPU copies."""
        ...

    def checkpoint_files(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """Weights, optimiser and RNG state as named files, and the counters to restore;
        the tensors' files are streamed (read them through before the next step)."""
        ...

    def load_checkpoint(self, files: Mapping[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` (of any engine, at any rank count) wrote."""
        ...

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token of ``samples``."""
        ...

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder (safetensors + tokenizer)."""
        ...
