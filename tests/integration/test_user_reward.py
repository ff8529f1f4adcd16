"""The tutorial's chat example (``examples/my_project/chat.yaml``) on a user's model folder
(subword tokenizer, chat template, end-of-turn EOS): chat-message prompts from the
example's JSONL rendered with the template, a column passed on to the example's reward;
vLLM generates, the trainer trains, the weights go back to vLLM. Beside the example's
reward runs a user's function that fails in every way a user's code can: on some calls it
hangs, kills its process, returns NaN or returns text. The data file is the first 200 rows
of the example's, and 100 prompts too long for the model's context (a third of the rows,
so that the first steps draw some).

The run finishes; every sample is accounted for; each failed sample is recorded in the
ledger with its reason and counted, the first reasons reach the console, each function's
own metrics reach MLflow, and the too-long prompts are passed over with their reason.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import textwrap
from pathlib import Path

import pyarrow.compute as pc
import pytest

from sluice.storage.ledger import Ledger, check_exactly_once
from tests.support.cli import ROOT, SMALL_RUN, sluice

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "my_project"

# One sample in ten of each kind fails, chosen by a stable hash of the prompt and the
# completion (a count of calls would restart with each replaced process). The others check
# that no special token of the chat template reached the reward.
REWARDS = """
import os, signal, time, zlib

def flaky(prompt, completion, answer):
    kind = zlib.crc32((prompt + completion).encode()) % 10
    if kind == 0:
        time.sleep(600)
    if kind == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == 2:
        return float("nan")
    if kind == 3:
        return "1.0"
    if "<|im_end|>" in completion or "<|im_start|>" in completion:
        raise ValueError("a special token reached the reward")
    return {"reward": float(answer in completion), "chars": len(completion)}
"""


def test_a_user_reward_that_fails_fails_its_samples_and_the_run_finishes(
    tmp_path: Path, shared_cache: Path, bpe_policy: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "broken_rewards.py").write_text(textwrap.dedent(REWARDS))
    data = project / "chat.jsonl"
    long = [
        {"messages": [{"role": "user", "content": f"{i} " + "plus one " * 300}], "answer": "0"}
        for i in range(100)
    ]
    rows = (EXAMPLE / "data" / "chat.jsonl").read_text().splitlines(keepends=True)[:200]
    data.write_text("".join(rows) + "".join(json.dumps({**r, "digits": 1}) + "\n" for r in long))
    args = ["run", str(EXAMPLE / "chat.yaml")]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={shared_cache}",
        f"policy.path={bpe_policy}",
        f"env.data.path={data}",
        "reward.functions=[my_rewards:sum_in_reply, broken_rewards:flaky]",
        "reward.timeout_s=1",
        *SMALL_RUN,
        # Held-out prompts are scored by the same reward (each hang costs its 1 s): a few
        # keep the evaluations in the run without making them most of its time.
        "eval.prompts=8",
    ):
        args += ["--set", setting]
    result = sluice(*args, env={**os.environ, "PYTHONPATH": f"{project}:{EXAMPLE}"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "a sample's reward failed (recorded in the ledger): reward broken_rewards:flaky" in out

    run_dir = tmp_path / "runs" / "my-chat"
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    reasons = [r for r in pc.unique(table.column("reason")).to_pylist() if r]
    for why in (
        "timed out after 1 s (reward.timeout_s)",
        "its process ended (killed by SIGKILL)",
        "returned nan, not a finite number",
        "returned a str, not a number or a mapping",
    ):
        assert any(why in r for r in reasons), (why, reasons)
    assert not [r for r in reasons if "special token" in r], reasons
    # the too-long prompts were passed over, each recorded with the reason
    assert any(
        re.search(r"the prompt is \d+ tokens: the model's context \(512\) less", r) for r in reasons
    ), reasons
    events = zip(table["prompt_id"].to_pylist(), table["event"].to_pylist(), strict=True)
    trained = {p for p, e in events if e == "trained"}
    assert trained and all(p.startswith("dataset/train/") for p in trained)

    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        errors = db.execute(
            "SELECT SUM(value) FROM metrics WHERE key='rollout/reward_errors'"
        ).fetchone()[0]
        chars = db.execute(
            "SELECT COUNT(*) FROM metrics WHERE key='rollout/reward/flaky/chars'"
        ).fetchone()[0]
        digits = db.execute(
            "SELECT MIN(value), MAX(value) FROM metrics WHERE key = ?",
            ("rollout/reward/sum_in_reply/digits",),
        ).fetchone()
    assert errors >= 4 and chars >= 1
    # the data file's `digits` column reached the example's reward (1 or 2 digits)
    assert digits[0] is not None and 1.0 <= digits[0] <= digits[1] <= 2.0
