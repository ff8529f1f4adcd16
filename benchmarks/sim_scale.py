"""Predictions at published scale: 64, 256 and 1024 H100s, 7B and 32B models, long tails.

For each model and cluster size it simulates Sluice's policies on one workload and seed
(the same responses for every policy) and reports throughput relative to the baseline
the papers compare against, synchronous training on colocated accelerators (verl's
default). Costs come from ``sim.hardware`` (public specifications plus stated efficiency
guesses), the workload from ``WORKLOADS``. Writes a section of BENCHMARKS.md:

    .venv/bin/python -m benchmarks.sim_scale            # or: make simulate
    .venv/bin/python -m benchmarks.sim_scale --quick    # fewer steps, no BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.records import Record, publish
from benchmarks.tables import quote_key, span
from sluice.sim.engine import simulate
from sluice.sim.hardware import (
    ASSUMPTIONS,
    H100,
    QWEN_7B,
    QWEN_32B,
    Model,
    costs_for,
    engine_concurrency,
    rollout_share,
    split,
)
from sluice.sim.lengths import draw_lengths
from sluice.sim.results import SimResult
from sluice.sim.scenario import SKEW_HANDLING_OFF, LengthSpec, Scenario, build_scenario

SIZES = (64, 256, 1024)
# One global batch at every size (strong scaling, as scaling experiments run a fixed
# recipe on more GPUs): 512 prompts x 16 samples, the DAPO / AReaL recipe.
GROUPS_PER_STEP = 512
GROUP = 16
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Workload:
    model: Model
    lengths: LengthSpec


# Long-tail reasoning responses: a log-normal body with prompt-level spread and a tail of
# responses that run to the length cap (DAPO- and Laminar-style math RL reports 5-15% of
# responses truncated at 16k-32k tokens). Guesses of that shape, not a measured trace.
WORKLOADS = {
    "7B": Workload(
        QWEN_7B,
        LengthSpec(
            kind="mixture",
            median=2500,
            sigma=0.6,
            group_sigma=0.6,
            tail_fraction=0.08,
            tail_median=12000,
            tail_sigma=0.5,
            max_tokens=16384,
        ),
    ),
    "32B": Workload(
        QWEN_32B,
        LengthSpec(
            kind="mixture",
            median=4000,
            sigma=0.6,
            group_sigma=0.6,
            tail_fraction=0.08,
            tail_median=24000,
            tail_sigma=0.5,
            max_tokens=32768,
        ),
    ),
}

# (label, policy fields), each over SKEW_HANDLING_OFF: a row names what it switches on.
# "sync (colocated)" is the papers' baseline and comes first.
DISPATCH = {"long_first": True, "balance": True}
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("sync (colocated)", {"mode": "sync"}),
    ("sync", {"mode": "sync"}),
    ("one_step", {"mode": "one_step"}),
    ("async k=1", {"mode": "async", "max_staleness": 1}),
    ("async k=2", {"mode": "async", "max_staleness": 2}),
    ("async k=4", {"mode": "async", "max_staleness": 4}),
    ("async k=2 +dispatch", {"mode": "async", "max_staleness": 2, **DISPATCH}),
    (
        "async k=2 +dispatch +repack",
        {"mode": "async", "max_staleness": 2, **DISPATCH, "repack": True},
    ),
    # The rule that dates a group by its first token (rl/staleness.py), for comparison.
    (
        "async k=2 +dispatch +first-token",
        {"mode": "async", "max_staleness": 2, **DISPATCH, "stale_by": "first_token"},
    ),
    (
        "async k=4 +dispatch +first-token",
        {"mode": "async", "max_staleness": 4, **DISPATCH, "stale_by": "first_token"},
    ),
    (
        "async k=16 +dispatch +first-token",
        {"mode": "async", "max_staleness": 16, **DISPATCH, "stale_by": "first_token"},
    ),
]

# What the papers report, for the table (their setups differ from ours; see the text).
PAPERS = [
    ("AsyncFlow (arXiv 2507.01663)", "1.59x average, 2.03x peak over verl, Ascend NPU clusters"),
    ("StreamRL (arXiv 2504.15930)", "up to 2.66x over verl (colocated)"),
    ("Laminar (arXiv 2510.12633)", "up to 5.48x over the best baseline at 1024 GPUs"),
]


def mean_response(lengths: LengthSpec, seed: int = 0) -> float:
    sample = draw_lengths(lengths, 4096, GROUP, np.random.default_rng(seed))
    return float(sample.mean())


def scenario(
    name: str,
    accelerators: int,
    label: str,
    policy: dict[str, Any],
    steps: int,
    seed: int = 0,
    groups: int = GROUPS_PER_STEP,
) -> Scenario:
    """One cell of the report: model ``name`` on ``accelerators`` H100s under ``policy``."""
    work = WORKLOADS[name]
    model = work.model
    mean = mean_response(work.lengths, seed)
    # A running request holds its prompt and, on average, half its response.
    context = PROMPT_TOKENS + mean / 2
    colocated = label.endswith("(colocated)")
    if colocated:
        rollout, train = accelerators, accelerators
    else:
        share = rollout_share(model, H100, PROMPT_TOKENS, mean, context)
        rollout, train = split(accelerators, share, model.tp)
    costs = costs_for(model, H100, context, train, colocated=colocated)
    tree = {
        "name": f"{name} x{accelerators}",
        "seed": seed,
        "workload": {
            "steps": steps,
            "groups_per_step": groups,
            "samples_per_group": GROUP,
            "prompt_tokens": PROMPT_TOKENS,
            "warmup_steps": 3,
            "lengths": work.lengths.model_dump(),
        },
        "cluster": {
            "placement": "colocated" if colocated else "disaggregated",
            "rollout_accelerators": rollout,
            "train_accelerators": train,
            "accelerators_per_instance": model.tp,
            "max_concurrency": engine_concurrency(model, H100, context),
        },
        "costs": costs.model_dump(),
        "policy": {
            **SKEW_HANDLING_OFF,
            "predictor_sigma": 0.5,
            "repack_max_stragglers": 8,
            **policy,
        },
    }
    return build_scenario(tree)


@dataclass(frozen=True)
class Cell:
    result: SimResult
    cluster: dict[str, int]  # rollout_accelerators, train_accelerators, max_concurrency
    seconds: float  # wall time of the simulation itself

    def kept(self) -> dict[str, Any]:
        """The cell as its record holds it."""
        return {"result": asdict(self.result), "cluster": self.cluster, "seconds": self.seconds}

    @classmethod
    def read(cls, kept: dict[str, Any]) -> Cell:
        result = kept["result"]
        counts = {k: {int(n): v for n, v in result[k].items()} for k in COUNTED}
        return cls(SimResult(**{**result, **counts}), kept["cluster"], kept["seconds"])


COUNTED = ("staleness", "first_token_lag")  # SimResult's dicts keyed by versions


def run_grid(
    steps: int, sizes: tuple[int, ...] = SIZES, groups: int = GROUPS_PER_STEP
) -> dict[str, dict[int, dict[str, Cell]]]:
    """Every model x size x policy; prints a line per simulation as it goes."""
    grid: dict[str, dict[int, dict[str, Cell]]] = {}
    for name in WORKLOADS:
        for size in sizes:
            for label, policy in POLICIES:
                sc = scenario(name, size, label, policy, steps, groups=groups)
                started = time.perf_counter()
                result = simulate(sc)
                took = time.perf_counter() - started
                cluster = {
                    "rollout_accelerators": sc.cluster.rollout_accelerators,
                    "train_accelerators": sc.cluster.train_accelerators,
                    "max_concurrency": sc.cluster.max_concurrency,
                }
                grid.setdefault(name, {}).setdefault(size, {})[label] = Cell(result, cluster, took)
                print(
                    f"{name} x{size:>4} {label:<28} {result.samples_per_s:9.1f} samples/s, "
                    f"step {result.steady_step_s:7.1f} s, dropped {result.dropped_samples:>6} "
                    f"({took:.1f} s)",
                    flush=True,
                )
    return grid


def _speedup(cells: dict[str, Cell], label: str) -> float:
    base = cells[POLICIES[0][0]].result
    return cells[label].result.samples_per_s / base.samples_per_s


Grid = dict[str, dict[int, dict[str, Cell]]]  # model -> accelerators -> policy -> cell


def render(record: Record) -> str:
    """The section: the grid's tables, then the timed full run when there was one."""
    data = record.data
    text = report(record, read_grid(data), data["steps"], data["elapsed_s"])
    timed = data.get("full_run")
    return text + "\n\n" + full_run_line(timed) if timed else text


def read_grid(data: dict[str, Any]) -> Grid:
    """The grid a record keeps, its sizes as numbers again."""
    return {
        name: {
            int(size): {label: Cell.read(c) for label, c in row.items()} for size, row in by.items()
        }
        for name, by in data["grid"].items()
    }


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``), per policy and cell
    (``async-k-2-dispatch.7b-x1024``): the speed-up over the baseline, the share of
    generated samples dropped as stale, the share of trained samples whose first token is
    more than k versions old and the oldest; per policy the speed-ups' range over the
    cells, and per policy and model (``.7b``) the ranges of the speed-ups and the drops;
    each cell's baseline samples/s; the range of what repack changes; per cell the range
    of the speed-ups of every async policy with k >= 2 (``7b-x64.k2-up``)."""
    grid, out = read_grid(record.data), {}
    policies = dict(POLICIES)
    for label, policy in POLICIES:
        key, ups = quote_key(label), []
        for model, by in grid.items():
            model_ups, drops = [], []
            for size, cells in by.items():
                cell, r = f"{quote_key(model)}-x{size}", cells[label].result
                up = _speedup(cells, label)
                model_ups.append(up)
                out[f"{key}.{cell}.speedup"] = f"{up:.2f}x"
                if policy["mode"] != "async":
                    continue
                drops.append(100 * r.dropped_samples / max(r.generated_samples, 1))
                lag, k = r.first_token_lag, policy["max_staleness"]
                over = sum(v for lagged, v in lag.items() if lagged > k) / max(sum(lag.values()), 1)
                out |= {
                    f"{key}.{cell}.dropped": f"{drops[-1]:.0f}%",
                    f"{key}.{cell}.lag-over": f"{100 * over:.0f}%",
                    f"{key}.{cell}.lag-max": str(max(lag, default=0)),
                }
            ups += model_ups
            out[f"{key}.{quote_key(model)}.speedups"] = span(model_ups, "x", 2)
            if drops:
                out[f"{key}.{quote_key(model)}.dropped"] = span(drops, "%", 0)
        out[f"{key}.speedups"] = span(ups, "x", 2)
    repack = []
    for model, by in grid.items():
        for size, cells in by.items():
            cell = f"{quote_key(model)}-x{size}"
            out[f"baseline.{cell}"] = f"{cells[POLICIES[0][0]].result.samples_per_s:,.1f}"
            with_it = cells["async k=2 +dispatch +repack"].result.samples_per_s
            repack.append(100 * (with_it / cells["async k=2 +dispatch"].result.samples_per_s - 1))
            k2_up = [
                _speedup(cells, label)
                for label, policy in policies.items()
                if policy["mode"] == "async" and policy["max_staleness"] >= 2
            ]
            out[f"{cell}.k2-up"] = span(k2_up, "x", 2)
    out["repack-effect"] = f"{min(repack):+.0f}% to {max(repack):+.0f}%"
    return out


def report(record: Record, grid: Grid, steps: int, elapsed: float) -> str:
    sizes = sorted(next(iter(grid.values())))
    cells = [(n, s) for n in grid for s in sizes]
    header = "| policy | " + " | ".join(f"{n} x{s}" for n, s in cells) + " |"
    rule = "|---|" + "---:|" * len(cells)
    lines = [
        f"{record.measured_on()} (simulated); {steps} steps per run, "
        f"{GROUPS_PER_STEP} prompts x {GROUP} samples per step at every size, seed 0; "
        f"{elapsed:.0f} s for the whole grid.",
        f"Command: `make simulate` (`{record.command}`).",
        "",
        "Trained samples/s relative to synchronous training on colocated accelerators (the "
        "papers' baseline), whole run:",
        "",
        header,
        rule,
    ]
    for label, _ in POLICIES:
        row = [f"{_speedup(grid[n][s], label):.2f}" for n, s in cells]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "Share of generated samples dropped as too stale:", "", header, rule]
    for label, policy in POLICIES:
        if policy["mode"] != "async":
            continue
        shares = []
        for n, s in cells:
            r = grid[n][s][label].result
            shares.append(f"{100 * r.dropped_samples / max(r.generated_samples, 1):.0f}%")
        lines.append(f"| {label} | " + " | ".join(shares) + " |")
    lines += [
        "",
        "What the last-token rule lets through (`rl/staleness.py`): trained samples whose first "
        "token is more than k versions old, and the oldest first token (versions):",
        "",
        header,
        rule,
    ]
    for label, policy in POLICIES:
        if policy["mode"] != "async":
            continue
        k = policy["max_staleness"]
        cells_text = []
        for n, s in cells:
            lag = grid[n][s][label].result.first_token_lag
            over = sum(v for lagged, v in lag.items() if lagged > k) / max(sum(lag.values()), 1)
            cells_text.append(f"{100 * over:.0f}%, {max(lag, default=0)}")
        lines.append(f"| {label} | " + " | ".join(cells_text) + " |")
    lines += [
        "",
        "| cell | baseline samples/s | baseline step s | disaggregated split (rollout + train) "
        "| requests per engine | mean response tokens | slowest simulation s |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for n, s in cells:
        group = grid[n][s]
        base = group[POLICIES[0][0]].result
        disagg = group["sync"].cluster
        mean = base.trained_tokens / base.trained_samples
        lines.append(
            f"| {n} x{s} | {base.samples_per_s:,.1f} | {base.steady_step_s:,.0f} "
            f"| {disagg['rollout_accelerators']} + {disagg['train_accelerators']} "
            f"| {disagg['max_concurrency']} | {mean:,.0f} "
            f"| {max(c.seconds for c in group.values()):.1f} |"
        )
    lines += ["", "Reported by the papers (their own baselines, models and clusters):", ""]
    lines += [f"- {paper}: {claim}" for paper, claim in PAPERS]
    lines += [
        "",
        "Assumptions (`sim/hardware.py`): "
        + "; ".join(f"{k} {v}" for k, v in ASSUMPTIONS.items())
        + ".",
    ]
    return "\n".join(lines)


def time_full_run(steps: int = 100) -> dict[str, Any]:
    """A 1024-accelerator 7B run of ``steps`` steps, timed, for two policies."""
    out = []
    chosen = dict(POLICIES)
    for label in ("sync (colocated)", "async k=2 +dispatch"):
        policy = chosen[label]
        sc = scenario("7B", 1024, label, policy, steps)
        wall, cpu = time.perf_counter(), time.process_time()
        result = simulate(sc)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out.append(
            {"label": label, "wall_s": wall, "cpu_s": cpu, "trained": result.trained_samples,
             "events": result.events}
        )  # fmt: skip
    return {"steps": steps, "runs": out}


def full_run_line(timed: dict[str, Any]) -> str:
    runs = "; ".join(
        f"{r['label']}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU for {r['trained']:,} "
        f"trained samples ({r['events']:,} events)"
        for r in timed["runs"]
    )
    return f"A full 7B run at 1024 accelerators ({timed['steps']} steps) simulated in: {runs}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--quick", action="store_true", help="10 steps, print only")
    parser.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md")
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    started = time.perf_counter()
    grid = run_grid(steps, tuple(args.sizes))
    data: dict[str, Any] = {
        "steps": steps,
        "elapsed_s": time.perf_counter() - started,
        "grid": {
            name: {
                str(size): {label: c.kept() for label, c in row.items()} for size, row in by.items()
            }
            for name, by in grid.items()
        },
    }
    if 1024 in args.sizes and not args.quick:
        data["full_run"] = time_full_run()
    title = "Simulator: predictions at cluster scale"
    record = Record.measured("simulator-scale", title, render, data, ["numpy"])
    publish(record, write=not (args.quick or args.no_write))


if __name__ == "__main__":
    main()
