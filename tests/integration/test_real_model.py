"""SmolLM2-135M-Instruct end to end (``make test-real``, which runs ``make model`` first):
a few steps of ``configs/smollm2.yaml`` with full weights and with LoRA, the weight push of a
real model with tied embeddings, its ChatML template and a 49k vocabulary. The trainer's
log-probs of tokens vLLM has just sampled must be vLLM's own at the same version, in float32
and in bfloat16."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sluice.driver.session import MISMATCH_BF16
from tests.support.cli import ROOT, child_env, sluice

MODEL = ROOT / "models" / "smollm2-135m-instruct"
EXAMPLE = ROOT / "examples" / "my_project"
ENVIRONMENTS = ROOT / "examples" / "environments"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.real,
    pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is missing: `make model` writes it"),
]
# float32 engines agree to rounding; a tied embedding that the push left behind (the output
# head of vLLM still the old one) differs by far more.
MAX_MISMATCH = 1e-3
# float32 engines agreed to 6.5e-6 on average per token on this model (docs/real-model.md).
BF16_FLOOR = 1e-4
RUN = (
    "train.steps=2",
    "eval.every=2",
    "eval.prompts=16",
    "eval.mismatch_prompts=8",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=4",
    "rollout.kv_cache_gib=0.5",
)


def _run(
    root: Path,
    name: str,
    *settings: str,
    config: str = "configs/smollm2.yaml",
    code: Path = EXAMPLE,
) -> tuple[dict, list[float]]:
    """``config`` for two short steps as ``name`` under ``root``, the user's ``code`` on the
    path: the run's summary and its evaluations' log-prob mismatch."""
    args = ["run", config, "--set", f"root={root}", "--set", f"name={name}"]
    for setting in (*RUN, *settings):
        args += ["--set", setting]
    result = sluice(*args, env=child_env(PYTHONPATH=str(code)), timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((root / name / "summary.json").read_text())
    with sqlite3.connect(root / "mlflow.db") as db:
        mismatch = [
            value
            for (value,) in db.execute(
                "SELECT m.value FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid "
                "WHERE r.name = ? AND m.key = 'eval/logprob_mismatch' ORDER BY m.step",
                (name,),
            )
        ]
    return summary, mismatch


def test_full_weights_train_push_and_agree(tmp_path):
    summary, mismatch = _run(tmp_path, "full")
    assert summary["steps"] == 2
    # Above zero: the check compared two engines' numbers, not a list with itself.
    assert len(mismatch) == 2 and min(mismatch) > 0 and max(mismatch) < MAX_MISMATCH, mismatch
    policy = Path(summary["policy"])
    assert (policy / "model.safetensors").is_file()
    assert (policy / "chat_template.jinja").read_text() == (
        MODEL / "chat_template.jinja"
    ).read_text()


def test_lora_adapters_train_push_and_agree(tmp_path):
    summary, mismatch = _run(
        tmp_path, "lora", "train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-4"
    )
    # Above zero: the check compared two engines' numbers, not a list with itself.
    assert len(mismatch) == 2 and min(mismatch) > 0 and max(mismatch) < MAX_MISMATCH, mismatch
    assert (Path(summary["policy"]) / "adapter_model.safetensors").is_file()


@pytest.mark.xfail(
    strict=True,
    reason="measured 2026-11-29 on the AVX-512 Xeon: 0.038 per token at the folder's weights, "
    "0.174 after two steps, over the 0.05 bound. The push is exact (test_bf16_push.py); rounding "
    "the trained float32 weights to bf16 alone moves their log-probs by 0.109 (docs/real-model.md)",
)
def test_bf16_rollouts_agree_within_the_bf16_bound(tmp_path):
    """vLLM in bfloat16, the weights on the wire in bfloat16, the trainer in float32 (bf16
    autocast on a CPU without AVX-512 BF16 took minutes for one 8-sample step here): the
    log-probs still agree within the bound a bf16 run warns at; and they differ by more than
    float32 engines do (about 1e-5 here), so vLLM did run in bf16."""
    summary, mismatch = _run(tmp_path, "bf16", "rollout.dtype=bfloat16")
    assert summary["steps"] == 2
    assert len(mismatch) == 2 and max(mismatch) < MISMATCH_BF16, mismatch
    assert min(mismatch) > BF16_FLOOR, mismatch


def test_an_agent_plays_it_through_the_endpoint_and_its_chatml_template(tmp_path):
    """examples/my_project/smollm2_agent.yaml: the user's openai-client agent talks to the
    instruct model through the rollout worker's endpoint; every episode's tokens are what
    the template rendered and the model sampled, so the trainer's log-probs still agree."""
    summary, mismatch = _run(
        tmp_path, "agent", "rollout.max_new_tokens=64", config=str(EXAMPLE / "smollm2_agent.yaml")
    )
    assert summary["steps"] == 2
    # Above zero: the check compared two engines' numbers, not a list with itself.
    assert len(mismatch) == 2 and min(mismatch) > 0 and max(mismatch) < MAX_MISMATCH, mismatch
    rows = pq.read_table(tmp_path / "agent" / "trajectories", columns=["loss_mask", "reason"])
    assert rows.column("reason").null_count == rows.num_rows  # no agent failed
    masks = [m for m in rows.column("loss_mask").to_pylist() if m is not None]
    assert masks and all(m[0] == 1 for m in masks)  # each episode starts with the model's reply


@pytest.mark.parametrize("example", ["gym_sum", "textarena_guess", "verifiers_sum"])
def test_each_environment_example_trains_as_written(tmp_path, example):
    """examples/environments (their curves are in docs/results.md), two short steps each:
    a gymnasium-style game of the user's and a TextArena game played turn by turn, and a
    verifiers taskset played by verifiers against the endpoint; the log-probs still vLLM's."""
    config = str(ENVIRONMENTS / f"{example}.yaml")
    summary, mismatch = _run(tmp_path, example, config=config, code=ENVIRONMENTS)
    assert summary["steps"] == 2
    # Above zero: the check compared two engines' numbers, not a list with itself.
    assert len(mismatch) == 2 and min(mismatch) > 0 and max(mismatch) < MAX_MISMATCH, mismatch
