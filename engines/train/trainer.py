"""The trainer: the policy it loads, the micro-batched policy-gradient step and its metrics,
and the policy's outward forms (published weights, checkpoints, the saved folder).

Held by a rank of the training pool (``engines/train/pool.py``) or run in-process in
tests, benchmarks and ``scripts/train_ranks.py``; ``build_engine`` makes one from the
``train`` section. ``PolicyTrainer`` is the same for every engine: what differs (torch/DDP,
FSDP2, DeepSpeed ZeRO) is its ``Parallelism`` strategy (``engines/train/parallel.py``), which
wraps the model, reduces and applies gradients, gathers the full weights and moves the
optimiser's state in and out. The loss is picked by name from ``rl.losses`` (``train.loss``
in the config), so no engine knows which algorithm it runs. With ``train.lora`` the model
carries peft adapters (``engines/train/lora.py``) and the policy's outward forms (``state``, the
checkpoint's weights, the saved folder) are the adapter's alone. ``train.critic`` adds a value
head (``engines/train/critic.py``) and ``train.kl_coef`` a reference policy
(``engines/train/reference.py``), both held here.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
import torch

from sluice.config.tree import TrainConfig
from sluice.engines.train.critic import ValueHead
from sluice.engines.train.heap import returned_heap
from sluice.engines.train.lora import (
    ADAPTER_FILE,
    adapter_state,
    attach,
    load_adapter_state,
    write_adapter,
)
from sluice.engines.train.output_head import OutputHead
from sluice.engines.train.parallel import (
    Optimisation,
    Parallelism,
    cpu_copies,
    load_policy,
    meta_layout,
)
from sluice.engines.train.ranks import all_max, all_sum, rank_and_world
from sluice.engines.train.reference import AdaptersOff, FrozenCopy, Reference
from sluice.rl.advantages import gae
from sluice.rl.batching import Sample, TrainBatch, collate, micro_batches, pack, sequence_ids
from sluice.rl.losses import (
    chunked_token_stats,
    kl_k3,
    kl_penalty,
    logprob_mismatch,
    loss_weights,
    masked_mean,
    policy_loss,
    value_loss,
)
from sluice.storage.checkpoints import tensors_of
from sluice.storage.fsio import write_chunks
from sluice.storage.safetensors_stream import Streamed, stream
from sluice.storage.torch_state import (
    restore_rng,
    rng_state_files,
)

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
NO_TOKEN_LIMIT = 1 << 40  # a train.micro_batch_tokens that never splits a batch by tokens
# train.dtype -> the autocast dtype of the forward passes (None: plain float32).
AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


def default_device() -> str:
    """The trainer's device: the GPU Ray gave this actor (it sets CUDA_VISIBLE_DEVICES, so
    it is ``cuda:0`` here), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class Passed(NamedTuple):
    """A forward pass's log-prob and entropy of each target, and the critic's value there
    (None without one), [B, T-1] each."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None


@dataclass(frozen=True)
class CriticTerms:
    """A part's GAE advantages and returns (no gradient), its weighted value loss, and
    that times ``train.critic.vf_coef`` (what the loss adds)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    value_loss: torch.Tensor
    loss: torch.Tensor


@dataclass(frozen=True)
class Totals:
    """A step's whole batch over every rank: its loss tokens and its sequences with any."""

    tokens: torch.Tensor
    sequences: torch.Tensor


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


def check_packing(model: Any, device: torch.device) -> None:
    """Raise unless ``model`` keeps attention inside each packed sample: a sample packed
    after another must get the logits it gets alone (a model whose attention ignores
    restarting position ids would let it attend to the one before). Rounding is told
    from attending by how far the logits move when the sample does attend to the one before
    (its position ids running on), so the check holds in bfloat16 as in float32."""
    vocab = int(model.config.vocab_size)
    first, second = torch.arange(3, 9) % vocab, torch.arange(9, 13) % vocab

    def logits_of_second(position_ids: torch.Tensor) -> torch.Tensor:
        row = TrainBatch(
            input_ids=torch.cat([first, second])[None],
            attention_mask=torch.ones(1, 10, dtype=torch.long),
            targets=torch.zeros(1, 9, dtype=torch.long),
            mask=torch.zeros(1, 9),
            old_logprobs=torch.zeros(1, 9),
            advantages=torch.zeros(1, 9),
            position_ids=position_ids[None],
        ).to(device)
        return model(**model_inputs(row)).logits[0, 6:].float()

    with torch.no_grad():
        alone = model(input_ids=second[None].to(device), use_cache=False).logits[0].float()
        packed = logits_of_second(torch.cat([torch.arange(6), torch.arange(4)]))
        attending = logits_of_second(torch.arange(10))
    error, leak = (packed - alone).abs().max().item(), (attending - alone).abs().max().item()
    if error > 1e-3 and error > 0.05 * leak:
        raise ValueError(
            f"train.packing: {type(model).__name__} lets a packed sample attend to the one "
            "before it (its attention does not stop where position ids restart); set "
            "train.packing: false for this model"
        )


class PolicyTrainer:
    """A :class:`engines.protocols.TrainEngine`: the policy, its loss, micro-batching,
    metrics and step, over the ``Parallelism`` strategy of its engine
    (``engines/train/parallel.py``), which wraps the model and applies, gathers and checkpoints what
    differs by engine."""

    def __init__(
        self,
        train: TrainConfig,
        model_dir: str,
        parallel: Parallelism,
        seed: int,
        before_update: Callable[[], object] | None = None,
        temperature: float = 1.0,
        device: str | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be above 0, got {temperature}")
        torch.set_num_threads(train.threads)
        torch.manual_seed(seed)
        self._model_dir = Path(model_dir)
        self.device = torch.device(device or default_device())
        if train.dtype == "auto":  # bf16 on a GPU, as engines.cluster.ray_cluster.pool_dtype has it
            auto = "bfloat16" if self.device.type == "cuda" else "float32"
            train = train.model_copy(update={"dtype": auto})
        self.train = train
        # Master weights stay float32; bfloat16 runs the forward passes in autocast (and
        # the strategy's own mixed precision, where it has one).
        self._autocast = AUTOCAST[train.dtype]
        self.parallel = parallel
        self.lora = train.lora
        # The policy is softmax(logits / temperature): the distribution rollouts sample from.
        self._temperature = temperature
        # Called right before the weights change in place: a weight publish may still be
        # copying them (storage.params: ParameterService.wait_snapshot).
        self.before_update = before_update
        self._version = 0
        # This rank's place in the training pool's group (0 of 1 outside one).
        self._rank, self._world = rank_and_world()
        with returned_heap():  # what loading and the checks free goes back (engines/train/heap.py)
            # A transformers causal LM, or peft's wrapper of one under LoRA; each rank holds
            # only what it will own (engines/train/parallel.py: Parallelism.load).
            self.model = parallel.load(self._model_dir, self.device, train)
            if train.activation_checkpointing:  # recomputed in the backward, layer by layer
                self.model.gradient_checkpointing_enable({"use_reentrant": False})
            if self.lora is not None:  # base weights frozen; only the adapters train
                self.model = attach(self.model, self.lora, str(self._model_dir))
            self.model.train()
            self._pad_id = int(self.model.config.pad_token_id or 0)
            # What the forward pass calls: the model, or the strategy's wrapper of it. From
            # here every rank holds its weights.
            self._network: Callable[..., Any] = parallel.attach(
                self.model, Optimisation.of(train), train
            )
            # The vocabulary projection, applied outside the model's forward to the trained
            # positions alone, a chunk at a time (None: the model's logits are used whole).
            self._head = OutputHead.of(self.model, self.device)
            # PPO's value head on the final hidden states (engines/train/critic.py).
            self._critic: ValueHead | None = None
            if train.critic is not None:
                if self._head is None:
                    raise ValueError(
                        f"train.critic reads the final hidden states, which "
                        f"{type(self.model).__name__} changes after its output head; "
                        "this model cannot carry a value head"
                    )
                hidden = int(self.model.config.hidden_size)
                self._critic = ValueHead(hidden, self.device, train.critic, train.lr, seed)
            if train.packing:
                check_packing(self.model, self.device)
            # The policy train.kl_coef holds this one to (engines/train/reference.py).
            self._reference: Reference | None = None
            if train.kl_coef and self.lora is not None:  # the frozen base itself
                self._reference = AdaptersOff(self._forward, self.model.disable_adapter)
            elif train.kl_coef:
                dtype = self._autocast or torch.float32
                self._reference = FrozenCopy(self._model_dir, self.device, dtype, self._forward_of)
            parallel.settle()

    def version(self) -> int:
        return self._version

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded across ranks (FSDP2, ZeRO-3): such an engine is
        published through ``layout`` and ``gathered``, one full tensor at a time, not
        through ``state``, which gathers the whole model at once."""
        return self.parallel.sharded

    def parts(self, batch: TrainBatch) -> list[TrainBatch]:
        """The forward/backward passes a step cuts ``batch`` into: packed rows with
        ``train.packing``, else length-sorted padded parts (``rl.batching``)."""
        cut = pack if self.train.packing else micro_batches
        return cut(batch, self.train.micro_batch, self.train.micro_batch_tokens)

    def _forward(self, batch: TrainBatch) -> Passed:
        """The policy's ``_forward_of``, with the critic's values when it has one: what the
        loss and the metrics read."""
        critic = None if self._critic is None else self._critic.values
        return self._forward_of(self._network, self._head, batch, critic)

    def _forward_of(
        self,
        network: Callable[..., Any],
        head_of: OutputHead | None,
        batch: TrainBatch,
        values_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Passed:
        """The log-prob of each target and the entropy of ``network``'s distribution where
        it was sampled, [B, T-1] float32 on the trainer's device, 0 where ``batch.mask`` is
        0; ``head_of``: its output head, applied here (None: its logits are used whole).
        ``values_of``: a value head, given the final hidden states at the same positions
        (it needs ``head_of``).

        Logits are computed at the masked (response) positions only, never the prompt's,
        and ``train.logits_chunk_tokens`` of them at a time (``rl.losses.chunked_token_stats``):
        a micro-batch of 8k tokens at a 150k vocabulary would otherwise hold several 5 GB
        tensors. The entropy carries gradients only under ``entropy_coef``."""
        with torch.autocast(
            self.device.type, dtype=self._autocast or torch.float32, enabled=bool(self._autocast)
        ):
            at = batch.mask.bool()
            if head_of is None:  # the model's own logits, whole
                out = network(**model_inputs(batch))
                head: Callable[[torch.Tensor], torch.Tensor] = torch.nn.Identity()
            else:
                with head_of.bypassed():
                    out = network(**model_inputs(batch))
                head = head_of.module
            hidden = out.logits[:, :-1][at]  # the final hidden states under head_of
            logprobs, entropy = chunked_token_stats(
                head,
                hidden,
                batch.targets[at],
                self.train.logits_chunk_tokens,
                entropy_grad=bool(self.train.entropy_coef),
                temperature=self._temperature,
            )
            values = None if values_of is None else values_of(hidden)
        blank = torch.zeros(at.shape, dtype=torch.float32, device=at.device)
        return Passed(
            blank.masked_scatter(at, logprobs),
            blank.masked_scatter(at, entropy),
            None if values is None else blank.masked_scatter(at, values),
        )

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on this rank's share of a batch (``rl.batching.TrainBatch``):
        the forward and backward passes, then the strategy's clip-and-apply; the version
        goes up by one. A non-finite gradient norm raises with the weights unchanged."""
        sums, total_tokens = self._passes(batch)
        grad_norm, lr = self.parallel.apply(self._before_update)
        if not math.isfinite(grad_norm):
            if self._critic is not None:
                self._critic.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm at version {self._version}; the step was skipped"
            )
        metrics = sums.metrics(grad_norm, lr, total_tokens)
        if self._critic is not None:  # the value head's own AdamW, after the policy's
            metrics["value_grad_norm"] = self._critic.step(self.train.grad_clip)
        self._version += 1
        return metrics

    def _critic_terms(
        self,
        part: TrainBatch,
        values: torch.Tensor,
        sequences: torch.Tensor,
        weights: torch.Tensor,
    ) -> CriticTerms:
        """GAE from each sample's reward (``part.advantages`` holds it under a critic:
        ``driver.batch.credit_of``) and the critic's values before the step (this very
        forward, detached: one optimiser step per batch), and the clipped value loss."""
        cfg = self.train.critic
        assert cfg is not None
        old = values.detach()
        advantages, returns = gae(part.advantages, old, part.mask, sequences, cfg.gamma, cfg.lam)
        loss = value_loss(values, old, returns, part.mask, cfg.value_clip, weights)
        return CriticTerms(advantages, returns, loss, cfg.vf_coef * loss)

    def _before_update(self) -> None:
        if self.before_update is not None:
            self.before_update()  # e.g. a weight publish still copying these tensors

    def _passes(self, batch: TrainBatch) -> tuple[StepSums, float]:
        """Forward and backward over this rank's share of a step's batch (all of it in a
        pool of one); returns the step's metrics and its loss tokens, over every rank.

        Each token's loss weighs by ``train.loss_agg`` over the whole batch (its share of
        the batch's tokens, or of its sequences), times the world size (the ranks'
        gradients are averaged), so the reduced gradient is the batch's aggregate whichever
        rank trained which row. Every rank runs as many backward passes (DDP, FSDP2 and
        ZeRO-2/3 reduce inside them: a collective), a rank short of parts running ones that
        add nothing.
        """
        parts = self.parts(batch)
        tokens = float(batch.mask.sum())
        sequences = float((batch.mask.sum(dim=1) > 0).sum())  # a padded row is one sample
        (tokens, sequences), (count,) = (
            all_sum([tokens, sequences], self.device),
            all_max([len(parts)], self.device),
        )
        total = Totals(torch.tensor(max(tokens, 1.0)), torch.tensor(max(sequences, 1.0)))
        step = StepSums()
        # Every rank sums the same metrics, in one order.
        if self._reference is not None:
            step.sums["kl_reference"] = 0.0
        if self._critic is not None:
            step.sums |= {"value_loss": 0.0, "value_mean": 0.0, "return_mean": 0.0}
        backward = self.parallel.backward
        for i in range(int(count)):
            with self.parallel.no_sync() if i < count - 1 else nullcontext():
                if i < len(parts):
                    self._pass(parts[i].to(self.device), total, step)
                else:
                    backward(self._forward(parts[-1].to(self.device))[0].sum() * 0.0)
        if self._world > 1:
            sums = all_sum(list(step.sums.values()), self.device)
            (top,) = all_max([step.weight_max], self.device)
            step = StepSums(dict(zip(step.sums, sums, strict=True)), top)
        return step, float(total.tokens)

    def _pass(self, part: TrainBatch, total: Totals, step: StepSums) -> None:
        """Forward and backward over one part, its tokens' losses weighted as
        ``train.loss_agg`` says over the ``total`` batch (times the world size); adds its
        metrics to ``step``, each a token mean weighted by the part's share of tokens."""
        train, sums = self.train, step.sums
        logprobs, entropies, values = self._forward(part)
        # The proximal policy is this trainer's before the update. One optimiser step per
        # batch means every micro-batch sees those weights, so it is this very forward pass,
        # detached: no extra forward. (Several steps per batch would need a no-grad pass
        # before the first.) Then r = 1 at the gradient and decoupled PPO's gradient is
        # tis's: min(pi/pi_behav, cap) * A * grad log pi.
        proximal = logprobs.detach()
        sequences = sequence_ids(part)
        device = part.mask.device
        weights = loss_weights(
            part.mask,
            sequences,
            train.loss_agg,
            total.tokens.to(device),
            total.sequences.to(device),
        )
        advantages = part.advantages
        if values is not None:  # the critic's GAE from each sample's reward (the rows')
            critic = self._critic_terms(part, values, sequences, weights)
            advantages = critic.advantages
        out = policy_loss(
            train.loss,
            logprobs,
            proximal,
            part.old_logprobs,
            advantages,
            part.mask,
            train.clip_eps,
            train.is_cap,
            train.clip_eps_high,
            weights,
            sequences,
        )
        entropy = masked_mean(entropies, part.mask)
        # The metrics (and the entropy bonus) weigh each micro-batch by its share of tokens:
        # their sum is the batch's token mean. The loss is weighted already.
        share = part.mask.sum() / total.tokens.to(device)
        loss = out.loss - train.entropy_coef * entropy * share
        if values is not None:
            loss = loss + critic.loss
            sums["value_loss"] += float(critic.value_loss.detach())
            sums["value_mean"] += float(masked_mean(values.detach(), part.mask) * share)
            sums["return_mean"] += float(masked_mean(critic.returns, part.mask) * share)
        if self._reference is not None:  # a KL penalty toward the frozen reference policy
            kl = kl_penalty(logprobs, self._reference.logprobs(part), train.kl_estimator)
            loss = loss + train.kl_coef * (kl * weights).sum()
            sums["kl_reference"] += float(masked_mean(kl.detach(), part.mask) * share)
        self.parallel.backward(loss * self._world)
        with torch.no_grad():
            sums["loss"] += float(out.loss)
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

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token (for checks and tests)."""
        batch = collate(samples, self._pad_id).to(self.device)
        logprobs = self._forward(batch).logprobs
        self.parallel.settle()
        return [logprobs[i][batch.mask[i].bool()].tolist() for i in range(len(batch))]

    def state(self) -> dict[str, torch.Tensor]:
        """The weights by name, on the trainer's device: the live tensors (publish or save
        before the next step), gathered copies for a sharded engine; under LoRA the
        adapter's alone. The parameter service copies them tensor by tensor into its CPU
        staging buffers, so publishing from a GPU makes no device-side copy."""
        return adapter_state(self.model) if self.lora else self.parallel.state()

    def layout(self) -> dict[str, torch.Tensor]:
        """What ``state`` holds, as meta tensors of its names, shapes and dtypes (nothing
        gathered)."""
        return meta_layout(self.state()) if self.lora else self.parallel.layout()

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s tensors one at a time; a sharded engine gathers each as it is asked
        for (collective: every rank reads the whole iterator). Copy each before the next."""
        yield from self.state().items() if self.lora else self.parallel.gathered()

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The weights as CPU tensors, copied one tensor at a time (never a whole-model
        clone on the device); on a CPU trainer, copies of the live tensors."""
        return cpu_copies(self.state()) if self.lora else self.parallel.cpu_state()

    def checkpoint_files(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """Weights (the adapter's under LoRA), AdamW state in the torch engine's layout and
        this rank's RNG as named files, plus the counters to restore. The weights and the
        AdamW tensors are streamed: each tensor is copied (gathered, when sharded) as it is
        written and let go before the next, so no rank holds a second copy of the model.
        Rank 0 writes the files; every other rank reads them through
        (``storage.safetensors_stream.drain``), its part in the gathers. A rank that holds
        what rank 0 holds (DDP's weights and AdamW state, ZeRO-1/2's weights) builds none."""
        optimizer, schedule = self.parallel.optimizer_state()  # collective if partitioned
        weights: dict[str, bytes | Streamed] = {}
        if self.sharded or self._rank == 0:  # gathered by all, or rank 0's own (it writes)
            name = ADAPTER_FILE if self.lora else MODEL_FILE
            weights[name] = Streamed(stream(self.layout(), self.gathered()))
        files = {**weights, **optimizer, **rng_state_files()}
        if self._critic is not None and self._rank == 0:  # every rank holds the same head
            files |= self._critic.files()
        return files, {"version": self._version, "scheduler": schedule}

    def load_checkpoint(self, files: Mapping[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` (of any engine, at any rank count) wrote;
        continues at the saved version. Collective for a sharded engine. The weights are
        read a tensor at a time (from storage, for a saved checkpoint's files), so a
        sharded engine's rank holds one full tensor beside its shards."""
        self._before_update()
        weights = self._checkpoint_weights(files)
        if self.lora is not None:
            load_adapter_state(self.model, dict(weights))
        else:
            self.parallel.load_weights(weights)
        self.parallel.load_optimizer_state(files, counters["scheduler"])
        if self._critic is not None:
            self._critic.load(files)
        restore_rng(files)
        self._version = int(counters["version"])

    def _checkpoint_weights(self, files: Mapping[str, bytes]) -> Mapping[str, torch.Tensor]:
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
        return tensors_of(files, ADAPTER_FILE if self.lora else MODEL_FILE)

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder (safetensors + tokenizer files); under
        LoRA an adapter folder naming its base (and, with ``merged_export``, the merged
        model in ``<folder>/merged``)."""
        out = Path(folder)
        if self.lora is not None:
            write_adapter(out, self.cpu_state(), self.lora, str(self._model_dir))
            if self.lora.merged_export:
                self.save_merged(out / "merged")
        else:
            self._write_model(out)
        self._copy_tokenizer(out)

    def _write_model(self, out: Path) -> None:
        """The model's config and its weights as ``model.safetensors``, streamed one tensor
        at a time (gathered, when sharded: collective) and, as ``save_pretrained`` leaves
        them, without the copies of tied weights (a tied output embedding)."""
        out.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(out)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out)
        kept = {n for n, _ in self.model.named_parameters()}  # one name per tied tensor
        tied = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} - kept
        layout = {n: t for n, t in self.layout().items() if n not in tied}
        tensors = ((n, t) for n, t in self.gathered() if n not in tied)
        chunks = stream(layout, tensors, metadata={"format": "pt"})
        write_chunks(fsspec.filesystem("file"), str(out / MODEL_FILE), chunks)

    def save_merged(self, folder: Path) -> None:
        """The base model with the current adapter merged into its weights, as a model
        folder; built on a fresh copy of the base, so the trainer's model stays as it is."""
        assert self.lora is not None
        base = load_policy(self._model_dir, torch.device("cpu"))
        with_adapter = attach(base, self.lora, str(self._model_dir))
        load_adapter_state(with_adapter, self.cpu_state())
        merged = with_adapter.merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
        self._copy_tokenizer(folder)

    def _copy_tokenizer(self, out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self._model_dir / name).is_file():
                shutil.copy2(self._model_dir / name, out / name)


def strategy_for(train: TrainConfig) -> Parallelism:
    """The strategy of ``train.engine``."""
    if train.engine == "deepspeed":
        from sluice.engines.train.zero import Zero  # only runs that use it import DeepSpeed

        return Zero(train.zero_stage)
    if train.engine == "fsdp":
        from sluice.engines.train.fsdp import FullyShard

        return FullyShard()
    from sluice.engines.train.ddp import DataParallel

    return DataParallel()


def build_engine(
    train: TrainConfig,
    model_dir: str,
    seed: int,
    before_update: Callable[[], object] | None = None,
    temperature: float = 1.0,
    device: str | None = None,
) -> PolicyTrainer:
    """The trainer of the ``train`` section on the strategy ``train.engine`` names, its
    policy the model's distribution at the rollouts' sampling ``temperature``."""
    return PolicyTrainer(
        train, model_dir, strategy_for(train), seed, before_update, temperature, device
    )
