"""TRL's GRPO trainer on Sluice's workload: the peer run that ``benchmarks/peer_trl.py`` drives.

One process, one job: train the policy a Sluice run of a config starts from
(``tasks/job.py: prepare_policy_task``: the config's model folder or the cached tiny policy,
loaded with transformers from the folder, no hub) with ``trl.GRPOTrainer`` on the same
environment, prompts, group size, response length, learning rate and schedule as a Sluice
run of that config, and record what the comparison needs:

- per optimiser step: its seconds (everything TRL does between two steps, held-out
  evaluation excluded), the part of them spent generating and scoring the completions
  (timed around TRL's ``_generate_and_score_completions``), the completions and the tokens
  they generated, and the mean reward;
- held-out greedy accuracy every ``--eval-every`` steps (and at step 0), measured with
  ``policy.starting.greedy_accuracy`` on the held-out set a Sluice run measures; the clock
  stops while it runs, as Sluice's throughput excludes its evaluations;
- the trained policy, saved as a folder ``sluice eval --policy`` reads.

On a multi-turn environment (the agentic workload, ``configs/agentic.yaml``) TRL plays
the episodes through its ``rollout_func`` (``benchmarks/trl_episodes.py``): the reward is
the environment's at each episode's end, the environment's tokens are kept out of the loss
(``env_mask``), and held-out accuracy is the share of greedy episodes it calls correct.

Prompts: the first ``steps x prompts_per_step`` prompts of the same ``PromptStream`` a
Sluice batch run draws, in its order (TRL's shuffling off), so step i trains on the prompts
Sluice's ``sync`` step i trains on, chat messages rendered with the model folder's template.
Rewards: the run's scorer (``driver/environment.py: scorer_factory``). Optimiser:
AdamW with Sluice's linear warm-up (``engines.train.parallel.Optimisation``), handed to the
trainer. Each batch trains in one pass, or with ``--micro-batches`` in passes of about
``train.micro_batch_tokens`` tokens whose gradients TRL accumulates (``micro_batch_rows``),
as near to Sluice's micro-batches as TRL's equal parts come.

``--probe`` instead times one generation of the first step's batch (16 prompts x 8
samples, TRL's sampling settings) with ``--threads`` torch threads and prints the median of
``PROBE_REPEATS`` as JSON: the comparison picks TRL's thread count with it, because on a
busy machine two OpenMP threads can be many times slower than one (a thread that loses
its core stalls the other at every barrier), and on a quiet one faster.

    .venv/bin/python -m benchmarks.trl_grpo configs/longtail.yaml --steps 100 --out DIR
    .venv/bin/python -m benchmarks.trl_grpo configs/longtail.yaml --probe --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from benchmarks import trl_episodes
from sluice.config.tree import RunConfig, load_config
from sluice.driver.environment import (
    episode_limits,
    eval_tokens,
    make_environment,
    scorer_factory,
    step_spec,
)
from sluice.engines.rollout.episodes import EpisodeSteps
from sluice.engines.train.parallel import Optimisation
from sluice.envs import Environment, Problem
from sluice.envs.prompts import PromptStream
from sluice.envs.scoring import Scorer
from sluice.policy.starting import greedy_accuracy, save_policy
from sluice.tasks.job import prepare_policy_task

log = logging.getLogger("sluice.peer")

RESULT_FILE = "result.json"
POLICY_FOLDER = "policy"
# Generations timed by --probe; the median of three shrugs off one preempted call.
PROBE_REPEATS = 3
# TRL's ways to generate (``--generation``), as GRPOConfig settings: padded ``generate``,
# transformers' continuous batching, and vLLM in the training process. (Its vLLM server
# mode needs ``trl vllm-serve`` and a NCCL communicator for the weights: see BENCHMARKS.md.)
GENERATIONS: dict[str, dict[str, Any]] = {
    "generate": {},
    "continuous": {"use_transformers_continuous_batching": True},
    "vllm-colocate": {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": False,
        "vllm_max_model_length": 256,
    },
}


@dataclass
class Tally:
    """What the reward function saw since the last optimiser step."""

    completions: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    correct: int = 0

    def take(self) -> Tally:
        out = Tally(self.completions, self.tokens, self.reward_sum, self.correct)
        self.completions, self.tokens, self.reward_sum, self.correct = 0, 0, 0.0, 0
        return out


@dataclass
class TrlResult:
    """Everything one TRL run recorded; written as ``result.json``."""

    steps: int
    threads: int
    load_s: float
    rows: int = 0
    """Rows per forward/backward pass (0: the whole batch in one)."""
    started_at: float = 0.0
    """Epoch seconds after the step-0 evaluation, when the first step began."""
    ended_at: float = 0.0
    """Epoch seconds when the last step (and its evaluation) ended."""
    step_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    eval_s: list[float] = field(default_factory=list)


@dataclass
class GenerationClock:
    """Seconds TRL spent generating and scoring since the last optimiser step."""

    seconds: float = 0.0

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def _trl() -> Any:
    """The ``trl`` module, imported on first use (it pulls in accelerate and vLLM, ~10 s)."""
    # TRL warns at import that it was tested with vLLM <= 0.31; its vLLM paths are not used.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    import trl

    return trl


def timed_trainer(clock: GenerationClock) -> type:
    """``trl.GRPOTrainer`` with its generation-and-scoring phase timed into ``clock``."""

    class TimedGRPOTrainer(_trl().GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            started = time.monotonic()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                clock.seconds += time.monotonic() - started

    return TimedGRPOTrainer


class SluiceReward:
    """A TRL reward function that scores with the run's scorer: the environment's verifier,
    or the config's reward functions in their isolated pool, as a Sluice run scores.

    TRL passes the dataset's extra columns as lists beside the completions; ``prompt_id``
    finds the ``Problem`` (with its data fields) the scorer expects.
    """

    __name__ = "sluice_verifier"  # TRL names each reward function's metrics by this

    def __init__(self, scorer: Scorer, problems: list[Problem]) -> None:
        self.scorer = scorer
        self.problems = {p.prompt_id: p for p in problems}
        self.tally = Tally()

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        prompt_id: list[str],
        **_: Any,
    ) -> list[float]:
        verdicts = self.scorer.score(
            [self.problems[pid] for pid in prompt_id],
            [[text] for text in completions],
            [[len(ids)] for ids in completion_ids],
        )
        rewards = []
        for (verdict,), ids in zip(verdicts, completion_ids, strict=True):
            rewards.append(verdict.reward)
            self.tally.completions += 1
            self.tally.tokens += len(ids)
            self.tally.reward_sum += verdict.reward
            self.tally.correct += int(verdict.correct)
        return rewards


class EpisodeReward(SluiceReward):
    """A TRL reward function that returns each episode's reward, which the environment
    gave at its end (``trl_episodes.EpisodeRollout`` passes it as an extra field)."""

    __name__ = "sluice_episode"

    def __call__(  # type: ignore[override]
        self,
        episode_reward: list[float],
        episode_correct: list[bool],
        sampled_tokens: list[int],
        **_: Any,
    ) -> list[float]:
        self.tally.completions += len(episode_reward)
        self.tally.tokens += sum(sampled_tokens)
        self.tally.reward_sum += sum(episode_reward)
        self.tally.correct += sum(episode_correct)
        return list(episode_reward)


class Recorder(TrainerCallback):
    """Times every optimiser step and evaluates held-out accuracy with the clock stopped."""

    def __init__(
        self,
        result: TrlResult,
        reward: SluiceReward,
        clock: GenerationClock,
        tokenizer: PreTrainedTokenizerFast,
        scorer: Scorer,
        heldout: list[Problem],
        max_new: int,
        eval_every: int,
        episodes: trl_episodes.EpisodeRollout | None = None,
    ) -> None:
        self.result, self.reward, self.clock, self.tokenizer = result, reward, clock, tokenizer
        self.scorer, self.heldout, self.eval_every = scorer, heldout, eval_every
        self.max_new = max_new  # a Sluice run's (driver/environment.py: eval_tokens)
        self.episodes = episodes
        self.since = time.monotonic()

    def _accuracy(self, model: torch.nn.Module) -> float:
        if self.episodes is None:
            return greedy_accuracy(model, self.tokenizer, self.scorer, self.heldout, self.max_new)
        return self.episodes.accuracy(model, self.tokenizer, self.heldout)

    def _evaluate(self, model: torch.nn.Module, step: int) -> None:
        started = time.monotonic()
        accuracy = self._accuracy(model)
        self.result.eval_steps.append(step)
        self.result.eval_accuracy.append(accuracy)
        self.result.eval_s.append(time.monotonic() - started)
        log.info("step %4d | held-out %5.1f%%", step, 100 * accuracy)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._evaluate(kw["model"], 0)
        self.clock.take()
        self.result.started_at = time.time()
        self.since = time.monotonic()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        seconds = time.monotonic() - self.since
        tally = self.reward.tally.take()
        r = self.result
        r.step_s.append(seconds)
        r.generate_s.append(self.clock.take())
        r.samples.append(tally.completions)
        r.tokens.append(tally.tokens)
        r.reward.append(tally.reward_sum / max(tally.completions, 1))
        step = state.global_step
        log.info(
            "step %4d/%d | reward %.3f | %5.0f tok/s | %.2f s",
            step,
            r.steps,
            r.reward[-1],
            tally.tokens / seconds,
            seconds,
        )
        if step % self.eval_every == 0 or step == r.steps:
            self._evaluate(kw["model"], step)
        r.ended_at = time.time()
        self.since = time.monotonic()


def train_problems(cfg: RunConfig, env: Environment, steps: int) -> list[Problem]:
    """The problems a Sluice batch run trains on, in its order."""
    seed = cfg.seed if cfg.env.train_seed is None else cfg.env.train_seed
    stream = PromptStream(env, cfg.env.train_prompts, seed)
    return stream.take(steps * cfg.rollout.prompts_per_step)


def prompt_dataset(problems: list[Problem]) -> Dataset:
    """``problems`` as TRL's dataset."""
    return Dataset.from_dict(
        {
            "prompt": [p.prompt for p in problems],
            "prompt_id": [p.prompt_id for p in problems],
            "answer": [p.answer for p in problems],
        }
    )


def sluice_optimizer(
    model: torch.nn.Module, cfg: RunConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and the linear warm-up of the run's ``train`` section, as Sluice's trainer builds
    them (``engines.train.parallel.Optimisation``)."""
    opt = Optimisation.of(cfg.train)
    optimizer = opt.adamw(list(model.parameters()))
    return optimizer, opt.schedule(optimizer)


def micro_batch_rows(cfg: RunConfig, longest_prompt: int) -> int:
    """Rows per forward/backward pass for TRL that match Sluice's micro-batches as far as
    TRL can express them: the most rows of the longest prompt plus ``max_new_tokens`` that
    fit ``train.micro_batch_tokens`` padded tokens, cut down to a divisor of the batch (TRL
    accumulates equal parts). Sluice also sorts the batch by length first; TRL cannot."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    fit = max(1, cfg.train.micro_batch_tokens // (longest_prompt + cfg.rollout.max_new_tokens))
    return max(d for d in range(1, min(fit, batch) + 1) if batch % d == 0)


def grpo_config(
    cfg: RunConfig, steps: int, out: Path, generation: str = "generate", rows: int = 0
) -> Any:
    """GRPO settings matching the Sluice run: one generation batch of prompts_per_step x
    samples_per_prompt completions per optimiser step, one update per batch, generated the
    ``GENERATIONS[generation]`` way; trained in one pass, or (``rows``) in passes of that
    many rows whose gradients are accumulated."""
    r, t = cfg.rollout, cfg.train
    batch = r.prompts_per_step * r.samples_per_prompt
    rows = rows or batch
    if batch % rows:
        raise ValueError(f"rows per pass ({rows}) must divide the batch ({batch})")
    settings = {"use_vllm": False, **GENERATIONS[generation]}
    return _trl().GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        **settings,
        max_steps=steps,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=batch // rows,
        num_generations=r.samples_per_prompt,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        learning_rate=t.lr,
        max_grad_norm=t.grad_clip,
        epsilon=t.clip_eps,
        beta=0.0,  # Sluice has no KL penalty against a reference policy
        loss_type="dapo",  # token-level mean over the batch, as rl/losses.py
        scale_rewards="group" if t.scale_adv_by_std else "none",
        num_iterations=1,
        shuffle_dataset=False,
        gradient_checkpointing=False,  # GRPOConfig turns it on; Sluice's trainer does not
        seed=cfg.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def prompt_tokens(tokenizer: PreTrainedTokenizerFast, prompt: Any) -> int:
    """A prompt's tokens as TRL encodes it: text as it is, chat messages by the template."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(encoded["input_ids"])


def train(
    cfg: RunConfig,
    steps: int,
    out: Path,
    eval_every: int,
    threads: int,
    generation: str = "generate",
    micro_batches: bool = False,
) -> TrlResult:
    """Run TRL's GRPO on ``cfg``'s workload for ``steps`` steps; save the policy under ``out``.
    ``micro_batches``: train each batch in passes of ``micro_batch_rows`` rows."""
    torch.set_num_threads(threads)
    started = time.monotonic()
    env, _ = make_environment(cfg.env, cfg.policy)
    spec = step_spec(cfg)
    env_steps = EpisodeSteps(spec, cfg.env.step_timeout_s) if spec is not None else None
    scorer = scorer_factory(env, cfg.reward, cfg.env)()
    try:
        policy_dir = prepare_policy_task.fn(cfg)  # the policy a Sluice run of cfg starts from
        tokenizer = PreTrainedTokenizerFast.from_pretrained(policy_dir)
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        heldout = env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
        problems = train_problems(cfg, env, steps)
        clock = GenerationClock()
        result = TrlResult(steps=steps, threads=threads, load_s=0.0)
        rollout, reward = None, SluiceReward(scorer, problems)
        if env_steps is not None:  # a multi-turn environment: TRL plays its episodes
            rollout = trl_episodes.EpisodeRollout(
                env_steps,
                problems,
                episode_limits(cfg.env),
                cfg.rollout.max_new_tokens,  # an episode's budget, as a Sluice run's
                cfg.rollout.temperature,
            )
            reward = EpisodeReward(scorer, problems)
        if micro_batches:
            longest = max(prompt_tokens(tokenizer, p.prompt) for p in problems)
            result.rows = micro_batch_rows(cfg, longest)
        max_new = eval_tokens(cfg, heldout)
        recorder = Recorder(
            result, reward, clock, tokenizer, scorer, heldout, max_new, eval_every, rollout
        )
        trainer = timed_trainer(clock)(
            model=model,
            reward_funcs=reward,
            args=grpo_config(cfg, steps, out, generation, result.rows),
            train_dataset=prompt_dataset(problems),
            processing_class=tokenizer,
            optimizers=sluice_optimizer(model, cfg),
            callbacks=[recorder],
            rollout_func=rollout,
        )
        result.load_s = time.monotonic() - started
        trainer.train()
        save_policy(trainer.model, tokenizer, out / POLICY_FOLDER)
    finally:
        scorer.close()
        if env_steps is not None:
            env_steps.close()
    return result


def probe(cfg: RunConfig, threads: int) -> float:
    """Median seconds of one HF ``generate`` of the first step's batch with ``threads``."""
    torch.set_num_threads(threads)
    env, _ = make_environment(cfg.env, cfg.policy)
    policy_dir = prepare_policy_task.fn(cfg)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    prompts = [p.prompt for p in train_problems(cfg, env, 1)]
    batch = tokenizer(
        [p for p in prompts for _ in range(cfg.rollout.samples_per_prompt)],
        return_tensors="pt",
        padding=True,
    )
    seconds = []
    for _ in range(PROBE_REPEATS):
        started = time.monotonic()
        with torch.no_grad():
            model.generate(
                **batch,
                max_new_tokens=cfg.rollout.max_new_tokens,
                do_sample=True,
                temperature=cfg.rollout.temperature,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        seconds.append(time.monotonic() - started)
    return sorted(seconds)[len(seconds) // 2]


def read_result(out: Path) -> TrlResult:
    """The ``result.json`` a run wrote under ``out``."""
    path = out / RESULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no TRL result at {path}: did the TRL run finish?")
    return TrlResult(**json.loads(path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="The Sluice config whose workload to train.")
    parser.add_argument("--steps", type=int, default=0, help="Optimiser steps.")
    parser.add_argument("--out", type=Path, help="Folder for the result.")
    parser.add_argument("--probe", action="store_true", help="Time generation; print JSON.")
    parser.add_argument("--eval-every", type=int, default=0, help="0: the config's eval.every.")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (all cores)."
    )
    parser.add_argument("--set", action="append", default=[], help="Config override.")
    parser.add_argument(
        "--generation", choices=list(GENERATIONS), default="generate", help="How TRL generates."
    )
    parser.add_argument(
        "--micro-batches",
        action="store_true",
        help="Train each batch in passes of about train.micro_batch_tokens tokens, as Sluice "
        "does (default: the whole batch in one pass).",
    )
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    if args.probe:
        print(json.dumps({"threads": args.threads, "generate_s": probe(cfg, args.threads)}))
        return
    if args.steps < 1 or args.out is None:
        parser.error(f"training needs --steps >= 1 (got {args.steps}) and --out")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    every = args.eval_every or cfg.eval.every
    result = train(
        cfg, args.steps, args.out, every, args.threads, args.generation, args.micro_batches
    )
    (args.out / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
