"""The frozen reference policy a KL penalty holds the trained policy to (``train.kl_coef``).

Held by the trainer (``engines/train/trainer.py``), which asks it for the log-probs of the
sampled tokens of each micro-batch, without gradients. Under LoRA the reference is the
trainer's own model with its adapters switched off: the frozen base, with no second copy.
Otherwise it is a second, frozen copy of the starting policy's folder on the trainer's
device, in the dtype the forward passes run in (``train.dtype``): the parameter count
times 4 bytes in float32, 2 in bfloat16, on every training rank (it is never sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from sluice.engines.train.output_head import OutputHead
from sluice.engines.train.parallel import load_policy
from sluice.rl.batching import TrainBatch


class Passed(Protocol):
    """What a trainer's forward pass gives: the log-prob of each target, [B, T-1]."""

    @property
    def logprobs(self) -> torch.Tensor: ...


Forward = Callable[[TrainBatch], Passed]


class Reference(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference's log-prob of each target of ``batch``, [B, T-1], no gradient."""
        ...


class AdaptersOff:
    """Under LoRA: the trainer's forward with the adapters switched off (peft's
    ``disable_adapter``), which is the frozen base the adapters started from."""

    def __init__(self, forward: Forward, disabled: Callable[[], AbstractContextManager[Any]]):
        self._forward, self._disabled = forward, disabled

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with self._disabled():
            return self._forward(batch).logprobs


class FrozenCopy:
    """A second copy of the starting policy, read only. ``forward(model, head, batch)`` is
    the trainer's forward of another model (its chunked log-probs at the loss positions)."""

    def __init__(
        self,
        folder: Path,
        device: torch.device,
        dtype: torch.dtype,
        forward: Callable[[Any, OutputHead | None, TrainBatch], Passed],
    ) -> None:
        self.model = load_policy(folder, device, dtype).eval().requires_grad_(False)
        self._head = OutputHead.of(self.model, device)
        self._forward = forward

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._forward(self.model, self._head, batch).logprobs

    def bytes(self) -> int:
        """What its weights hold, for the start-up line."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
