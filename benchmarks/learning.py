"""Learning curves of the default run: held-out accuracy against RL steps, per mode and seed.

Runs ``sluice run configs/default.yaml`` once per variant and seed (``async`` with
``stale_by`` last_token and first_token, ``one_step``), each with the seed's own
warm-started policy, and keeps one record per run under ``benchmarks/results/learning/``
(the held-out curve, staleness counts, throughput, the commit, machine and command). A
run whose record already names the measured commit is not run again, so the grid (nine
runs of ~30 minutes here) can be measured in several sittings. ``--write`` puts
the table of medians and ranges over the seeds into docs/results.md between markers.

    .venv/bin/python -m sluice.benchmarks.learning --steps 1600 --seeds 0 1 2 --write
"""

from __future__ import annotations

import argparse
import json
import platform
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

import torch

from sluice.benchmarks.suite import uncommitted
from sluice.benchmarks.tables import markdown_table
from sluice.sim.report import measured_commit

ROOT = Path(__file__).parents[1]
CONFIG = "configs/default.yaml"
RECORDS = ROOT / "benchmarks" / "results" / "learning"
RESULTS_DOC = ROOT / "docs" / "results.md"
MARKER = "learning-curves"  # docs/results.md: one table per run length, learning-curves-<steps>
# (label, overrides): the default first.
VARIANTS: dict[str, list[str]] = {
    "async, stale_by last_token": ["mode=async", "stale_by=last_token"],
    "async, stale_by first_token": ["mode=async", "stale_by=first_token"],
    "one_step": ["mode=one_step"],
}


def slug(label: str, seed: int) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-") + f"-s{seed}"


def record_path(label: str, seed: int, steps: int) -> Path:
    """One record per variant, seed and length: a 400-step run does not replace a 1,600."""
    return RECORDS / f"{slug(label, seed)}-{steps}steps.json"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _series(db: sqlite3.Connection, run_id: str, key: str) -> dict[int, float]:
    rows = db.execute(
        "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step",
        (run_id, key),
    ).fetchall()
    return {int(step): float(value) for step, value in rows}


def run_one(label: str, seed: int, steps: int, root: Path, commit: str) -> dict:
    """Run one variant and seed at ``commit`` (the checkout's); its record."""
    name = slug(label, seed)
    settings = [*VARIANTS[label], f"seed={seed}", f"train.steps={steps}", f"name={name}"]
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in [*settings, f"root={root}"]:
        cmd += ["--set", setting]
    print(f"running {label}, seed {seed}, {steps} steps ...", flush=True)
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    run_dir = root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    with sqlite3.connect(root / "mlflow.db") as db:
        run_id = summary["mlflow_run_id"]
        curve = _series(db, run_id, "eval/accuracy")
        staleness = {
            key.rsplit("/", 1)[1]: sum(_series(db, run_id, key).values())
            for (key,) in db.execute(
                "SELECT DISTINCT key FROM metrics WHERE run_uuid = ? AND key LIKE "
                "'train/staleness_count/%'",
                (run_id,),
            )
        }
        entropy = _series(db, run_id, "train/entropy")
    return {
        "variant": label,
        "seed": seed,
        "steps": steps,
        "heldout": {str(k): v for k, v in sorted(curve.items())},
        "entropy_first_last": [entropy[min(entropy)], entropy[max(entropy)]],
        "staleness_counts": staleness,
        "samples_per_s": summary["samples_per_s"],
        "wall_s": round(wall, 1),
        "collapse": summary.get("collapse", []),
        "commit": commit,
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "machine": f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{platform.machine()}",
        "command": "sluice run " + CONFIG + "".join(f" --set {s}" for s in settings),
    }


def load_records() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))]


def table(records: list[dict], steps: int) -> str:
    """Median (min-max) held-out accuracy over the seeds at every 200 steps, per variant."""
    records = [r for r in records if r["steps"] == steps]
    marks = list(range(0, steps + 1, max(steps // 8, 1)))
    rows = []
    for label in VARIANTS:
        runs = [r for r in records if r["variant"] == label]
        if not runs:
            continue
        cells = [f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"]
        for mark in marks:
            values = [100 * r["heldout"][str(mark)] for r in runs if str(mark) in r["heldout"]]
            if not values:
                cells.append("-")
            elif len(values) == 1:
                cells.append(f"{values[0]:.1f}%")
            else:
                cells.append(f"{median(values):.1f}% ({min(values):.1f}-{max(values):.1f})")
        rows.append(cells)
    commits = sorted({r["commit"] for r in records})
    machines = sorted({r["machine"] for r in records})
    lines = [
        f"Records: `benchmarks/results/learning/` (commit {', '.join(commits)}; "
        f"{'; '.join(machines)}).",
        f"Command: `.venv/bin/python -m sluice.benchmarks.learning --steps {steps} --seeds 0 1 2`.",
        "",
        *markdown_table(["variant", *(str(m) for m in marks)], rows),
    ]
    return "\n".join(lines)


def write_doc(body: str, steps: int) -> None:
    begin, end = f"<!-- {MARKER}-{steps}:begin -->", f"<!-- {MARKER}-{steps}:end -->"
    text = RESULTS_DOC.read_text()
    if begin not in text:
        raise SystemExit(f"{RESULTS_DOC} has no {begin} marker")
    head, rest = text.split(begin, 1)
    RESULTS_DOC.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--write", action="store_true", help="write docs/results.md's table")
    parser.add_argument(
        "--table-only", action="store_true", help="run nothing: the table of the kept records"
    )
    args = parser.parse_args()
    changed = [] if args.table_only else uncommitted()
    if changed:  # a record names the commit it measured: that must be the code that ran
        raise SystemExit(f"commit these first, the records name a commit: {', '.join(changed)}")
    RECORDS.mkdir(parents=True, exist_ok=True)
    commit = measured_commit()
    for seed in [] if args.table_only else args.seeds:  # a seed's variants side by side
        for label in args.variants:
            path = record_path(label, seed, args.steps)
            if path.exists():
                old = json.loads(path.read_text())
                if old["commit"] == commit and old["steps"] == args.steps:
                    print(f"{label}, seed {seed}: already measured at {commit}")
                    continue
            record = run_one(label, seed, args.steps, args.root / commit, commit)
            path.write_text(json.dumps(record, indent=1) + "\n")
    body = table(load_records(), args.steps)
    print(body)
    if args.write:
        write_doc(body, args.steps)


if __name__ == "__main__":
    main()
