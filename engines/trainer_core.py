"""What every training engine shares: the policy it loads, the micro-batched policy-gradient
pass and its metrics, the learning-rate warm-up, and the policy's outward forms.

``PolicyTrainer`` is the base of ``engines.torch_trainer.TorchTrainer``,
``engines.fsdp_trainer.FSDPTrainer`` and ``engines.deepspeed_trainer.DeepSpeedTrainer``.
The engines differ only in how the optimiser is built, how gradients are reduced and
applied (``step_batch``), where the full weights live (``state``) and how optimiser state is
checkpointed. The loss is picked by name from ``rl.losses`` (``train.loss`` in the config),
so no engine knows which algorithm it runs. With ``train.lora`` the model carries peft
adapters (``engines/lora.py``) and the policy's outward forms (``state``, the checkpoint's
weights, the saved folder) are the adapter's alone.
"""

from __future__ import annotations

import math
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from sluice.engines.lora import (
    ADAPTER_FILE,
    adapter_state,
    attach,
    load_adapter_state,
    write_adapter,
)
from sluice.engines.output_head import OutputHead
from sluice.engines.ranks import all_max, all_sum, rank_and_world
from sluice.rl.batching import Sample, TrainBatch, collate, micro_batches, pack
from sluice.rl.config import LoraConfig
from sluice.rl.losses import (
    LOSS_NAMES,
    chunked_token_stats,
    kl_k3,
    logprob_mismatch,
    masked_mean,
    policy_loss,
)
from sluice.storage.torch_state import bytes_to_tensors, tensors_to_bytes

# Files that travel with the weights when the trained policy is saved as a model folder.
# transformers 5 keeps a chat template in its own file: without it a saved policy of a chat
# model would render prompts differently from the one it was trained from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MODEL_FILE = "model.safetensors"
# Token-weighted means over a batch, summed micro-batch by micro-batch.
SUM_METRICS = (
    "loss",
    "kl_behaviour",
    "entropy",
    "clip_fraction",
    "is_weight_mean",
    "is_truncated_fraction",
    "logprob_mismatch",
)
NO_TOKEN_LIMIT = 1 << 62  # micro_batch_tokens when the config sets no limit
LOGITS_CHUNK = 1024  # response tokens whose vocabulary logits a pass holds at once
# train.dtype -> the autocast dtype of the forward passes (None: plain float32).
AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


def default_device() -> str:
    """The trainer's device: the GPU Ray gave this actor (it sets CUDA_VISIBLE_DEVICES, so
    it is ``cuda:0`` here), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Optimisation:
    """AdamW and its schedule, the same for every engine (``train`` in the config)."""

    lr: float
    grad_clip: float
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8  # torch's AdamW default

    def warmup(self) -> Callable[[int], float]:
        """The LambdaLR factor: linear from 1/(warmup+1) of the rate to all of it."""
        steps = self.warmup_steps
        return lambda step: min(1.0, (step + 1) / (steps + 1))


@dataclass
class StepSums:
    """A step's metrics while its micro-batches run: token-weighted sums and the weight max."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUM_METRICS, 0.0))
    weight_max: float = 0.0

    def metrics(self, grad_norm: float, lr: float, tokens: float) -> dict[str, float]:
        return {
            **self.sums,
            "is_weight_max": self.weight_max,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
        }


def model_inputs(batch: TrainBatch) -> dict[str, torch.Tensor | bool]:
    """The forward pass's arguments. A packed batch passes its restarting ``position_ids``
    and no attention mask: transformers then builds a causal mask that stops at each
    sample's start (``masking_utils.find_packed_sequence_indices``), as it does for its own
    padding-free collator. No KV cache: it only costs memory in training, and a cache makes
    transformers skip the packed-sequence check."""
    if batch.position_ids is not None:
        where = {"position_ids": batch.position_ids}
    else:
        where = {"attention_mask": batch.attention_mask}
    return {"input_ids": batch.input_ids, **where, "use_cache": False}


def check_packing(model: torch.nn.Module, device: torch.device) -> None:
    """Raise unless ``model`` keeps attention inside each packed sample: a sample packed
    after another must get the logits it gets alone (a model whose attention ignores
    restarting position ids would let it attend to the one before)."""
    vocab = int(model.config.vocab_size)
    first, second = torch.arange(3, 9) % vocab, torch.arange(9, 13) % vocab
    row = TrainBatch(
        input_ids=torch.cat([first, second])[None],
        attention_mask=torch.ones(1, 10, dtype=torch.long),
        targets=torch.zeros(1, 9, dtype=torch.long),
        mask=torch.zeros(1, 9),
        old_logprobs=torch.zeros(1, 9),
        advantages=torch.zeros(1, 9),
        position_ids=torch.cat([torch.arange(6), torch.arange(4)])[None],
    ).to(device)
    with torch.no_grad():
        alone = model(input_ids=second[None].to(device), use_cache=False).logits[0]
        packed = model(**model_inputs(row)).logits[0, 6:]
    if not torch.allclose(packed.float(), alone.float(), atol=1e-3, rtol=1e-3):
        raise ValueError(
            f"train.packing: {type(model).__name__} lets a packed sample attend to the one "
            "before it (its attention does not stop where position ids restart); set "
            "train.packing: false for this model"
        )


class PolicyTrainer(ABC):
    """The engine-independent half of a :class:`engines.protocols.TrainEngine`.

    A subclass builds its optimiser in ``_attach_optimizer`` (called once the model is
    loaded) and implements ``step_batch``, ``checkpoint_files`` and ``load_checkpoint``.
    """

    def __init__(
        self,
        model_dir: str,
        lr: float,
        clip_eps: float,
        grad_clip: float,
        micro_batch: int,
        threads: int,
        seed: int,
        micro_batch_tokens: int = NO_TOKEN_LIMIT,
        warmup_steps: int = 0,
        entropy_coef: float = 0.0,
        loss: str = "ppo",
        is_cap: float = 2.0,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        before_update: Callable[[], object] | None = None,
        dtype: str = "float32",
        device: str | None = None,
        packing: bool = False,
        lora: LoraConfig | None = None,
        logits_chunk: int = LOGITS_CHUNK,
        temperature: float = 1.0,
    ) -> None:
        if loss not in LOSS_NAMES:
            raise ValueError(f"unknown loss {loss!r}; allowed: {', '.join(LOSS_NAMES)}")
        if dtype not in AUTOCAST:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(AUTOCAST)}")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self._model_dir = Path(model_dir)
        self.device = torch.device(device or default_device())
        # Master weights stay float32; bfloat16 runs the forward passes in autocast.
        self._autocast = AUTOCAST[dtype]
        # safetensors only: a pytorch_model.bin would be unpickled
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, use_safetensors=True
        )
        self.model.to(self.device)
        self.lora = lora
        if lora is not None:  # base weights frozen; only the adapters train
            self.model = attach(self.model, lora, str(self._model_dir))
        self.model.train()
        self._pad_id = int(self.model.config.pad_token_id or 0)
        self.optimisation = Optimisation(
            lr, grad_clip, warmup_steps, (betas[0], betas[1]), weight_decay
        )
        self._loss = loss
        self._clip_eps = clip_eps
        self._is_cap = is_cap
        self._entropy_coef = entropy_coef
        self._micro_batch = micro_batch
        self._micro_tokens = micro_batch_tokens
        self._packing = packing
        self._logits_chunk = logits_chunk
        if temperature <= 0:
            raise ValueError(f"temperature must be above 0, got {temperature}")
        # The policy is softmax(logits / temperature): the distribution rollouts sample from.
        self._temperature = temperature
        # The vocabulary projection, applied outside the model's forward to the trained
        # positions alone, a chunk at a time (None: the model's logits are used whole).
        self._head = OutputHead.of(self.model, self.device)
        # What the forward pass calls: the model, or an engine that wraps it.
        self._network: Callable[..., Any] = self.model
        # Called right before the weights change in place: a weight publish may still be
        # copying them (storage.params: ParameterService.wait_snapshot).
        self.before_update = before_update
        self._version = 0
        # This rank's place in the training pool's group (0 of 1 outside one).
        self._rank, self._world = rank_and_world()
        if packing:
            check_packing(self.model, self.device)
        self._attach_optimizer()

    @abstractmethod
    def _attach_optimizer(self) -> None:
        """Build the optimiser and learning-rate schedule over ``self.model``."""

    @abstractmethod
    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on padded tensors (``rl.batching.TrainBatch``)."""

    @abstractmethod
    def checkpoint_files(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Model, optimiser and RNG state as named files, plus the counters to restore."""

    @abstractmethod
    def load_checkpoint(self, files: dict[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` wrote; continues at the saved version."""

    def version(self) -> int:
        return self._version

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the optimiser steps: all of them, or the adapters' under LoRA."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def weight_files(self) -> dict[str, bytes]:
        """A checkpoint's weights: the adapter under LoRA (``ADAPTER_FILE``), else the full
        weights (``MODEL_FILE``)."""
        return {ADAPTER_FILE if self.lora else MODEL_FILE: tensors_to_bytes(self.cpu_state())}

    def checkpoint_weights(self, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds, once they are known to be of this run's kind (an
        adapter for a LoRA run, full weights otherwise)."""
        if self.lora is None and ADAPTER_FILE in files:
            raise ValueError(
                "the checkpoint holds a LoRA adapter, not full weights: resume it with "
                "train.lora set as the run that wrote it had it"
            )
        if self.lora is not None and MODEL_FILE in files:
            raise ValueError(
                "the checkpoint holds full weights (a run without train.lora): resume it "
                "without train.lora, or start a LoRA run afresh"
            )
        return bytes_to_tensors(files[ADAPTER_FILE if self.lora else MODEL_FILE])

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def parts(self, batch: TrainBatch) -> list[TrainBatch]:
        """The forward/backward passes a step cuts ``batch`` into: packed rows with
        ``train.packing``, else length-sorted padded parts (``rl.batching``)."""
        cut = pack if self._packing else micro_batches
        return cut(batch, self._micro_batch, self._micro_tokens)

    def _forward(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-prob of each target and the entropy of the policy where it was sampled,
        [B, T-1] float32 on the trainer's device, 0 where ``batch.mask`` is 0.

        Logits are computed at the masked (response) positions only, never the prompt's,
        and ``train.logits_chunk_tokens`` of them at a time (``rl.losses.chunked_token_stats``):
        a micro-batch of 8k tokens at a 150k vocabulary would otherwise hold several 5 GB
        tensors. The entropy carries gradients only under ``entropy_coef``."""
        with torch.autocast(
            self.device.type, dtype=self._autocast or torch.float32, enabled=bool(self._autocast)
        ):
            at = batch.mask.bool()
            if self._head is None:  # the model's own logits, whole
                out = self._network(**model_inputs(batch))
                head: Callable[[torch.Tensor], torch.Tensor] = torch.nn.Identity()
            else:
                with self._head.bypassed():
                    out = self._network(**model_inputs(batch))
                head = self._head.module
            logprobs, entropy = chunked_token_stats(
                head,
                out.logits[:, :-1][at],
                batch.targets[at],
                self._logits_chunk,
                entropy_grad=bool(self._entropy_coef),
                temperature=self._temperature,
            )
        blank = torch.zeros(at.shape, dtype=torch.float32, device=at.device)
        return blank.masked_scatter(at, logprobs), blank.masked_scatter(at, entropy)

    def step(self, samples: list[Sample]) -> dict[str, float]:
        return self.step_batch(collate(samples, self._pad_id))

    def _no_sync(self) -> AbstractContextManager[object]:
        """A context in which a backward pass keeps its gradients on this rank: every pass of
        a step but the last (DDP reduces on the last). Engines that reduce at their
        optimiser step (DeepSpeed) need none."""
        return nullcontext()

    def _passes(
        self, batch: TrainBatch, backward: Callable[[torch.Tensor], object]
    ) -> tuple[StepSums, float]:
        """Forward and backward over this rank's share of a step's batch (all of it in a
        pool of one); returns the step's metrics and its loss tokens, over every rank.

        Each part's loss weighs by its share of the whole batch's tokens, times the world
        size (the ranks' gradients are averaged), so the reduced gradient is the batch's
        token mean whichever rank trained which row. Every rank runs as many backward
        passes (ZeRO-2/3 and DDP reduce inside them: a collective), a rank short of parts
        running ones that add nothing.
        """
        parts = self.parts(batch)
        tokens = float(batch.mask.sum())
        (tokens,), (count,) = all_sum([tokens], self.device), all_max([len(parts)], self.device)
        total = torch.tensor(max(tokens, 1.0))
        step = StepSums()
        for i in range(int(count)):
            with self._no_sync() if i < count - 1 else nullcontext():
                if i < len(parts):
                    self._pass(parts[i].to(self.device), total, backward, step)
                else:
                    backward(self._forward(parts[-1].to(self.device))[0].sum() * 0.0)
        if self._world > 1:
            sums = all_sum(list(step.sums.values()), self.device)
            (top,) = all_max([step.weight_max], self.device)
            step = StepSums(dict(zip(step.sums, sums, strict=True)), top)
        return step, float(total)

    def _pass(
        self,
        part: TrainBatch,
        total_tokens: torch.Tensor,
        backward: Callable[[torch.Tensor], object],
        step: StepSums,
    ) -> None:
        """Forward and backward over one part, its loss weighted by its share of the
        batch's ``total_tokens`` (times the world size); adds its metrics to ``step``."""
        sums = step.sums
        logprobs, entropies = self._forward(part)
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
        entropy = masked_mean(entropies, part.mask)
        # Each micro-batch weighs by its share of tokens: the sum is the batch token mean.
        share = part.mask.sum() / total_tokens.to(part.mask.device)
        backward((out.loss - self._entropy_coef * entropy) * share * self._world)
        with torch.no_grad():
            sums["loss"] += float(out.loss * share)
            # KL(behaviour || trainer), estimated on the behaviour policy's own samples.
            kl = kl_k3(part.old_logprobs, proximal, part.mask)
            sums["kl_behaviour"] += float(kl * share)
            sums["entropy"] += float(entropy * share)
            sums["clip_fraction"] += float(out.clip_fraction * share)
            sums["is_weight_mean"] += float(out.weight_mean * share)
            sums["is_truncated_fraction"] += float(out.truncated_fraction * share)
            sums["logprob_mismatch"] += float(
                logprob_mismatch(proximal, part.old_logprobs, part.mask) * share
            )
            step.weight_max = max(step.weight_max, float(out.weight_max))

    def _check_grad_norm(self, grad_norm: float) -> None:
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite gradient norm at version {self._version}; the step was skipped"
            )

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token (for checks and tests)."""
        batch = collate(samples, self._pad_id).to(self.device)
        logprobs, _ = self._forward(batch)
        return [logprobs[i][batch.mask[i].bool()].tolist() for i in range(len(batch))]

    def state(self) -> dict[str, torch.Tensor]:
        """The live weights by name, on the trainer's device (not copies: publish or save
        before the next step); under LoRA the adapter's alone. The parameter service copies
        them tensor by tensor into its CPU staging buffers, so publishing from a GPU makes
        no device-side copy."""
        if self.lora is not None:
            return adapter_state(self.model)
        return {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded across ranks (FSDP2, ZeRO-3): such an engine is
        published through ``layout`` and ``gathered``, one full tensor at a time, not
        through ``state``, which gathers the whole model at once."""
        return False

    def layout(self) -> dict[str, torch.Tensor]:
        """What ``state`` holds, as meta tensors of its names, shapes and dtypes (nothing
        gathered)."""
        return {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.state().items()
        }

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s tensors one at a time; a sharded engine gathers each as it is asked
        for (collective: every rank reads the whole iterator). Copy each before the next."""
        yield from self.state().items()

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The weights as CPU tensors, copied one tensor at a time (never a whole-model
        clone on the device); on a CPU trainer, copies of the live tensors."""
        return {k: v.to("cpu", copy=True) for k, v in self.state().items()}

    def weights(self) -> bytes:
        return tensors_to_bytes(self.cpu_state())

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder (safetensors + tokenizer files); under
        LoRA an adapter folder naming its base (and, with ``merged_export``, the merged
        model in ``<folder>/merged``)."""
        out = Path(folder)
        # Copies: an engine may hold its weights as views of one flat buffer, which
        # save_pretrained would take for tied tensors.
        weights = self.cpu_state()
        if self.lora is not None:
            write_adapter(out, weights, self.lora, str(self._model_dir))
            if self.lora.merged_export:
                self.save_merged(out / "merged")
        else:
            self.model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        self._copy_tokenizer(out)

    def save_merged(self, folder: Path) -> None:
        """The base model with the current adapter merged into its weights, as a model
        folder; built on a fresh copy of the base, so the trainer's model stays as it is."""
        assert self.lora is not None
        base = AutoModelForCausalLM.from_pretrained(
            self._model_dir, dtype=torch.float32, use_safetensors=True
        )
        with_adapter = attach(base, self.lora, str(self._model_dir))
        load_adapter_state(with_adapter, self.cpu_state())
        merged = with_adapter.merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
        self._copy_tokenizer(folder)

    def _copy_tokenizer(self, out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self._model_dir / name).is_file():
                shutil.copy2(self._model_dir / name, out / name)
