"""torch training engine: one policy-gradient step per batch of scored samples.

Runs in a Ray actor (``engines.pools``) or in-process in tests. Holds the policy, the
optimiser and the version counter; hands out its weights as one safetensors blob. The
policy loss is picked by name from ``rl.losses`` (``train.loss`` in the config).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from rl.batching import Sample, TrainBatch, collate, micro_batches
from rl.losses import (
    LOSS_NAMES,
    entropy_from_logits,
    kl_k3,
    logprob_mismatch,
    policy_loss,
    token_logprobs,
)
from storage.torch_state import (
    bytes_to_tensors,
    load_optimizer,
    optimizer_to_files,
    restore_rng,
    rng_state_files,
    tensors_to_bytes,
)

# Files that travel with the weights when the trained policy is saved as a model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MODEL_FILE = "model.safetensors"


class TorchTrainer:
    """A :class:`engines.protocols.TrainEngine` on one process with plain torch."""

    def __init__(
        self,
        model_dir: str,
        lr: float,
        clip_eps: float,
        grad_clip: float,
        micro_batch: int,
        threads: int,
        seed: int,
        micro_batch_tokens: int = 1 << 62,  # no token limit unless the config sets one
        warmup_steps: int = 0,
        entropy_coef: float = 0.0,
        loss: str = "ppo",
        is_cap: float = 2.0,
    ) -> None:
        if loss not in LOSS_NAMES:
            raise ValueError(f"unknown loss {loss!r}; allowed: {', '.join(LOSS_NAMES)}")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self._model_dir = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self._pad_id = int(self.model.config.pad_token_id or 0)
        self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self._schedule = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1))
        )
        self._loss = loss
        self._clip_eps = clip_eps
        self._is_cap = is_cap
        self._entropy_coef = entropy_coef
        self._grad_clip = grad_clip
        self._micro_batch = micro_batch
        self._micro_tokens = micro_batch_tokens
        # Called right before the weights change in place (see storage.params.publish).
        self.before_update: Callable[[], object] | None = None
        self._version = 0

    def version(self) -> int:
        return self._version

    def _forward(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1]
        return token_logprobs(logits, batch.targets), logits

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def step(self, samples: list[Sample]) -> dict[str, float]:
        return self.step_batch(collate(samples, self._pad_id))

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on padded tensors (``rl.batching.TrainBatch``)."""
        total_tokens = batch.mask.sum().clamp(min=1.0)
        self._optimizer.zero_grad(set_to_none=True)
        # Token means over the batch, summed micro-batch by micro-batch (weighted by share).
        sums = dict.fromkeys(
            (
                "loss",
                "kl_behaviour",
                "entropy",
                "clip_fraction",
                "is_weight_mean",
                "is_truncated_fraction",
                "logprob_mismatch",
            ),
            0.0,
        )
        weight_max = 0.0
        for part in micro_batches(batch, self._micro_batch, self._micro_tokens):
            logprobs, logits = self._forward(part)
            # The proximal policy is this trainer's before the update. One optimiser step per
            # batch means every micro-batch sees those weights, so it is this very forward pass,
            # detached: no extra forward. (Several steps per batch would need a no-grad pass
            # before the first.) Then r = 1 at the gradient and decoupled PPO's gradient is
            # tis's: min(pi/pi_behav, cap) * A * grad log pi.
            proximal = logprobs.detach()
            out = policy_loss(
                self._loss,
                logprobs,
                proximal,
                part.old_logprobs,
                part.advantages,
                part.mask,
                self._clip_eps,
                self._is_cap,
            )
            entropy = entropy_from_logits(logits, part.mask)
            # Each micro-batch weighs by its share of tokens: the sum is the batch token mean.
            share = part.mask.sum() / total_tokens
            ((out.loss - self._entropy_coef * entropy) * share).backward()
            with torch.no_grad():
                sums["loss"] += float(out.loss * share)
                sums["kl_behaviour"] += float(kl_k3(proximal, part.old_logprobs, part.mask) * share)
                sums["entropy"] += float(entropy * share)
                sums["clip_fraction"] += float(out.clip_fraction * share)
                sums["is_weight_mean"] += float(out.weight_mean * share)
                sums["is_truncated_fraction"] += float(out.truncated_fraction * share)
                sums["logprob_mismatch"] += float(
                    logprob_mismatch(proximal, part.old_logprobs, part.mask) * share
                )
                weight_max = max(weight_max, float(out.weight_max))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._grad_clip)
        if not torch.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm at version {self._version}; the step was skipped"
            )
        if self.before_update is not None:
            self.before_update()  # e.g. a weight publish still copying these tensors
        self._optimizer.step()
        lr = float(self._schedule.get_last_lr()[0])
        self._schedule.step()
        self._version += 1
        return {
            **sums,
            "is_weight_max": weight_max,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": float(total_tokens),
        }

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token (for checks and tests)."""
        batch = collate(samples, self._pad_id)
        logprobs, _ = self._forward(batch)
        return [logprobs[i][batch.mask[i].bool()].tolist() for i in range(len(batch))]

    def state(self) -> dict[str, torch.Tensor]:
        """The live weights by name (not copies: publish or save before the next step)."""
        return {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}

    def weights(self) -> bytes:
        return save_safetensors(self.state())

    def checkpoint_files(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Model, optimiser and RNG state as named files, plus the counters to restore."""
        files = {
            MODEL_FILE: tensors_to_bytes(self.state()),
            **optimizer_to_files(self._optimizer),
            **rng_state_files(),
        }
        return files, {"version": self._version, "scheduler": self._schedule.state_dict()}

    def load_checkpoint(self, files: dict[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` wrote; continues at the saved version."""
        if self.before_update is not None:
            self.before_update()
        self.model.load_state_dict(bytes_to_tensors(files[MODEL_FILE]), strict=True)
        load_optimizer(self._optimizer, files)
        self._schedule.load_state_dict(counters["scheduler"])
        restore_rng(files)
        self._version = int(counters["version"])

    def save(self, folder: str) -> None:
        out = Path(folder)
        self.model.save_pretrained(out, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (self._model_dir / name).is_file():
                shutil.copy2(self._model_dir / name, out / name)
