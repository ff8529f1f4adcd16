"""What a reward that misbehaves costs a run: ``configs/default.yaml`` in ``async`` with the
addition verifier as a user's reward function (``sluice.envs.verifiers:addition``, run in
the isolated pool), once as it is and once wrapped so that about one call in six
misbehaves (one in 30 each: hangs, exits its process, returns NaN, raises, returns text;
chosen by a stable hash of the prompt and the completion), the runs alternating.

Per run: the steps' wall-clock seconds (median, 90th percentile, the slowest), trained
samples/s and the failed samples the ledger recorded. Prints a markdown table and a JSON
line; ``--write`` also puts the table in BENCHMARKS.md (section "Misbehaving rewards").

    .venv/bin/python -m benchmarks.misbehaving_reward --steps 20 --write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.compute as pc

from benchmarks.report import measured_commit, write_section
from benchmarks.series import sluice_series
from benchmarks.tables import markdown_table
from sluice.storage.ledger import Ledger

ROOT = Path(__file__).parents[1]
CONFIG = "configs/default.yaml"
REWARDS = """
import os, signal, time, zlib
from sluice.envs.verifiers import addition

def clean(prompt, completion):
    return addition(prompt, completion)

def misbehaving(prompt, completion):
    kind = zlib.crc32((prompt + completion).encode()) % 30
    if kind == 0:
        time.sleep(3600)
    if kind == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == 2:
        return float("nan")
    if kind == 3:
        raise ValueError("misbehaving on purpose")
    if kind == 4:
        return "1.0"
    return addition(prompt, completion)
"""
LABELS = {"clean": "the verifier as a reward function", "misbehaving": "one call in six fails"}


def run(name: str, steps: int, root: Path, repeat: int) -> dict[str, float]:
    run_name = f"bench-misbehaving-{name}-{repeat}"
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in (f"reward=misbehaving_rewards:{name}", f"train.steps={steps}",
                    f"eval.every={steps}", f"name={run_name}", f"root={root}"):  # fmt: skip
        cmd += ["--set", setting]
    print(f"running {name} ({repeat + 1}) for {steps} steps ...", flush=True)
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    run_dir = root / run_name
    summary = json.loads((run_dir / "summary.json").read_text())
    step_s = sluice_series(name, run_dir, root).step_s
    table = Ledger(run_dir.as_uri()).read()
    reasons = table.column("reason")
    failed = int(pc.sum(pc.starts_with(pc.fill_null(reasons, ""), "reward ")).as_py() or 0)
    return {
        "median_step_s": statistics.median(step_s),
        "p90_step_s": statistics.quantiles(step_s, n=10)[-1],
        "max_step_s": max(step_s),
        "samples_per_s": summary["samples_per_s"],
        "failed_samples": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LABELS}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-misbehaving-") as folder:
        root = Path(folder)
        (root / "misbehaving_rewards.py").write_text(textwrap.dedent(REWARDS))
        for repeat in range(args.repeats):
            for name in LABELS:
                runs[name].append(run(name, args.steps, root, repeat))
    rows = []
    for name, label in LABELS.items():
        for r in runs[name]:
            rows.append(
                [
                    label,
                    f"{r['median_step_s']:.2f}",
                    f"{r['p90_step_s']:.2f}",
                    f"{r['max_step_s']:.2f}",
                    f"{r['samples_per_s']:.1f}",
                    f"{r['failed_samples']:.0f}",
                ]
            )
    header = ["reward", "step s, median", "90th percentile", "slowest", "trained samples/s",
              "samples whose reward failed"]  # fmt: skip
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"Measured {when} at {measured_commit()} on {platform.node() or 'this machine'} "
        f"({platform.machine()}); `.venv/bin/python -m benchmarks.misbehaving_reward --steps "
        f"{args.steps} --repeats {args.repeats} --write`: `{CONFIG}` for {args.steps} async "
        "steps a run, `reward.timeout_s` at its default (10 s), the runs alternating.\n\n"
        + "\n".join(markdown_table(header, rows))
    )
    print(body)
    print(json.dumps(runs))
    if args.write:
        write_section("misbehaving-rewards", "Misbehaving rewards", body)


if __name__ == "__main__":
    main()
