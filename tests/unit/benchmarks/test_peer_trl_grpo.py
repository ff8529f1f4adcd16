"""benchmarks/trl_grpo.py: TRL's GRPO on Sluice's workload, its pieces and a two-step run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from benchmarks.trl_grpo import (
    POLICY_FOLDER,
    SluiceReward,
    grpo_config,
    micro_batch_rows,
    prompt_dataset,
    prompt_tokens,
    read_result,
    sluice_optimizer,
    train_problems,
)
from sluice.config.tree import load_config
from sluice.driver.environment import make_environment
from sluice.envs.prompts import PromptStream
from sluice.envs.scoring import VerifierScorer
from sluice.policy.starting import check_policy_folder
from tests.support.cli import child_env

ROOT = Path(__file__).parents[3]
# TRL trains for real in a child process: out of the edit loop (make test-fast).
REAL_TRL = pytest.mark.integration


def test_the_reward_is_the_runs_scorer_and_counts_what_it_scored():
    cfg = load_config(ROOT / "configs/longtail.yaml")
    env, _ = make_environment(cfg.env)
    problems = env.problems("train", 2, 0)
    reward = SluiceReward(VerifierScorer(env), problems)
    scores = reward(
        prompts=[p.prompt for p in problems],
        completions=[problems[0].answer, "no|7"],
        completion_ids=[[5] * 20, [5] * 4],
        prompt_id=[p.prompt_id for p in problems],
        answer=[p.answer for p in problems],
        trainer_state=None,  # TRL passes more keyword arguments; they are ignored
    )
    assert scores == [1.0, 0.0]
    tally = reward.tally.take()
    assert (tally.completions, tally.tokens, tally.reward_sum, tally.correct) == (2, 24, 1.0, 1)
    assert reward.tally.completions == 0  # taken: the next step counts from zero


def test_prompts_are_the_ones_a_sluice_batch_run_trains_on_in_its_order():
    cfg = load_config(ROOT / "configs/longtail.yaml", ["rollout.prompts_per_step=4"])
    env, _ = make_environment(cfg.env)
    data = prompt_dataset(train_problems(cfg, env, steps=3))
    stream = PromptStream(env, cfg.env.train_prompts, cfg.seed)
    expected = stream.take(12)
    assert data["prompt"] == [p.prompt for p in expected]
    assert data["prompt_id"] == [p.prompt_id for p in expected]


def test_the_learning_rate_warms_up_as_sluices_trainer_does():
    cfg = load_config(ROOT / "configs/longtail.yaml", ["train.warmup_steps=3", "train.lr=1e-3"])
    model = torch.nn.Linear(2, 1)
    optimizer, schedule = sluice_optimizer(model, cfg)
    rates = []
    for _ in range(5):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # engines/train/parallel.py (Optimisation.warmup): lr x min(1, (step + 1) / (warmup + 1)).
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_grpo_settings_match_the_sluice_run(tmp_path):
    cfg = load_config(ROOT / "configs/longtail.yaml")
    args = grpo_config(cfg, 7, tmp_path)
    assert args.per_device_train_batch_size == 16 * 8  # one Sluice batch per optimiser step
    assert (args.num_generations, args.generation_batch_size, args.steps_per_generation) == (
        8,
        128,
        1,
    )
    assert (args.max_completion_length, args.temperature) == (96, 1.0)
    assert (args.learning_rate, args.max_grad_norm, args.epsilon) == (1e-4, 1.0, 0.2)
    assert (args.beta, args.loss_type, args.scale_rewards, args.num_iterations) == (
        0.0,
        "dapo",
        "group",
        1,
    )
    assert (args.max_steps, args.use_cpu, args.use_vllm) == (7, True, False)
    assert args.gradient_checkpointing is False
    assert args.shuffle_dataset is False


def test_micro_batches_are_the_rows_that_fit_the_token_budget_and_divide_the_batch(tmp_path):
    cfg = load_config(ROOT / "configs/longtail.yaml")  # 128 a batch, 96 new tokens
    budget = cfg.train.micro_batch_tokens
    assert budget == 1024
    # 1024 // (32 + 96) = 8 rows fit, and 8 divides 128.
    assert micro_batch_rows(cfg, 32) == 8
    # 1024 // (10 + 96) = 9 fit: 8 is the largest divisor of 128 below it.
    assert micro_batch_rows(cfg, 10) == 8
    assert micro_batch_rows(cfg, 2000) == 1  # not even one row fits: one at a time
    args = grpo_config(cfg, 7, tmp_path, rows=8)
    # Passes of 8 rows, accumulated into one optimiser step per generated batch of 128.
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 16)
    assert (args.generation_batch_size, args.steps_per_generation) == (128, 16)
    with pytest.raises(ValueError, match="must divide the batch"):
        grpo_config(cfg, 7, tmp_path, rows=48)


def test_a_prompts_tokens_are_counted_as_trl_encodes_it(bpe_policy):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bpe_policy)
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert want > 10  # the template's own tokens and the question's
    assert prompt_tokens(tokenizer, messages) == want
    assert prompt_tokens(tokenizer, "12+30=") == len(tokenizer("12+30=")["input_ids"])


def train(config: str, out: Path, *settings: str, flags: tuple[str, ...] = ()) -> None:
    """The real entry point on a tiny budget: two steps, an evaluation after each."""
    command = [sys.executable, "-m", "benchmarks.trl_grpo", config, *flags]
    command += ["--steps=2", "--eval-every=1", "--threads=1", f"--out={out}"]
    command += [arg for s in settings for arg in ("--set", s)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@REAL_TRL
def test_two_real_trl_steps_record_every_step_and_save_a_policy_sluice_loads(tmp_path, tiny_policy):
    """TRL's trainer, Sluice's policy and verifier."""
    out = tmp_path / "trl"
    train(
        "configs/default.yaml",
        out,
        f"policy.path={tiny_policy}",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "eval.prompts=8",
    )
    result = read_result(out)
    assert result.steps == 2 and len(result.step_s) == 2
    assert result.samples == [8, 8]  # 2 prompts x 4 completions per step
    assert all(0 < g < s for g, s in zip(result.generate_s, result.step_s, strict=True))
    assert all(0 < t <= 8 * 8 for t in result.tokens)  # at most 8 tokens per completion
    assert result.eval_steps == [0, 1, 2]
    assert all(0.0 <= a <= 1.0 for a in result.eval_accuracy)
    check_policy_folder(out / POLICY_FOLDER)
    tokenizer_config = json.loads((out / POLICY_FOLDER / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # what vLLM reads


@REAL_TRL
def test_two_real_trl_steps_play_the_agentic_workloads_episodes(tmp_path, tiny_policy):
    """TRL's trainer with the rollout function (benchmarks/trl_episodes.py), the tiny
    policy and the calculator."""
    out = tmp_path / "trl"
    train(
        "configs/agentic.yaml",
        out,
        f"policy.path={tiny_policy}",
        "env.args={digits: 2}",  # no tool latency
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=48",
        "env.max_turn_tokens=24",
        "eval.prompts=8",
    )
    result = read_result(out)
    assert result.samples == [8, 8]  # 2 prompts x 4 episodes per step
    assert all(0 < t <= 8 * 48 for t in result.tokens)  # sampled tokens within the budget
    assert result.eval_steps == [0, 1, 2]
    check_policy_folder(out / POLICY_FOLDER)


@REAL_TRL
def test_two_real_trl_steps_on_the_real_model_config_with_a_chat_folder(tmp_path, bpe_policy):
    """configs/smollm2.yaml's workload (chat messages rendered by the folder's template, the
    final_number reward in its pool) on a tiny ChatML folder: TRL's reward is the config's
    reward, and its held-out decode has the run's token budget. In micro-batches of the
    rows that fit 64 tokens (the prompts' template counted)."""
    out = tmp_path / "trl"
    train(
        "configs/smollm2.yaml",
        out,
        f"policy.path={bpe_policy}",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "eval.prompts=8",
        "train.micro_batch_tokens=64",
        flags=("--micro-batches",),
    )
    result = read_result(out)
    # One row a pass: the prompts (37 tokens, rendered with the template) + 16 new > 32.
    assert result.rows == 1
    assert result.samples == [8, 8]
    assert all(0 < t <= 8 * 16 for t in result.tokens)  # max_new_tokens 16
    assert result.eval_steps == [0, 1, 2]
    check_policy_folder(out / POLICY_FOLDER)


def test_a_missing_result_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="did the TRL run finish"):
        read_result(tmp_path)
