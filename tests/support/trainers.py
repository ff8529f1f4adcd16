"""Trainers built in-process for tests, and the calls only tests make on them.

``make_trainer`` builds ``engines.train.trainer.build_engine`` from keyword settings (``train``
fields, plus the seed, device and sampling temperature), with no token limit on a
micro-batch unless one is given, so a test's rows split by ``micro_batch`` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.config.tree import TrainConfig
from sluice.engines.train.trainer import NO_TOKEN_LIMIT, PolicyTrainer, build_engine
from sluice.rl.batching import Sample, collate
from sluice.storage.safetensors_stream import materialised
from sluice.storage.torch_state import tensors_to_bytes

__all__ = ["NO_TOKEN_LIMIT", "checkpoint", "make_trainer", "step", "weights"]


def make_trainer(
    folder: str | Path,
    *,
    seed: int = 0,
    device: str | None = None,
    temperature: float = 1.0,
    **train: Any,
) -> PolicyTrainer:
    train.setdefault("micro_batch_tokens", NO_TOKEN_LIMIT)
    return build_engine(
        TrainConfig(**train), str(folder), seed, temperature=temperature, device=device
    )


def step(engine: PolicyTrainer, samples: list[Sample]) -> dict[str, float]:
    """One optimiser step on ``samples``, all of them on this rank."""
    return engine.step_batch(collate(samples, engine.pad_id))


def weights(engine: PolicyTrainer) -> bytes:
    """The weights as one safetensors blob."""
    return tensors_to_bytes(engine.cpu_state())


def checkpoint(engine: PolicyTrainer) -> tuple[dict[str, bytes], dict[str, Any]]:
    """``engine``'s checkpoint files, the streamed ones read now (before the next step
    changes what they stream), and its counters."""
    files, counters = engine.checkpoint_files()
    return materialised(files), counters
