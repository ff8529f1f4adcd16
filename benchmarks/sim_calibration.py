"""The simulator's calibration check on this machine: each measured mode's ratio to sync
beside the simulator's prediction from the fitted profile (``sim/profiles/*.json``),
printed; ``--write`` also keeps the record (``benchmarks/records.py``) and writes the
section of BENCHMARKS.md. Run from a checkout (``make simulate``):

    .venv/bin/python -m benchmarks.sim_calibration --write
"""

from __future__ import annotations

import argparse

from benchmarks.records import Record, publish
from benchmarks.tables import quote_key
from sluice.sim.calibrate import calibration_rows, calibration_table, load_profile


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each variant's error, simulated and
    measured trainer idle and mean staleness (``async-k-2.staleness``: "1.75 / 1.31"), and
    the ranges of the trainer idle over the ``async`` rows."""
    out, idle = {}, []
    for r in record.data["rows"]:
        key = quote_key(r["variant"])
        if r["error"] is not None:
            out[f"{key}.error"] = f"{100 * r['error']:+.0f}%"
        for name, pair in (("idle", r["trainer_idle"]), ("staleness", r["mean_staleness"])):
            if pair[0] is not None:
                out[f"{key}.{name}"] = f"{pair[0]:.2f} / {pair[1]:.2f}"
        if r["variant"].startswith("async") and r["trainer_idle"][0] is not None:
            idle.append(r["trainer_idle"])
    if idle:
        measured, simulated = zip(*idle, strict=True)
        out["async.idle-measured"] = f"{min(measured):.2f}-{max(measured):.2f}"
        out["async.idle-simulated"] = f"{min(simulated):.2f}-{max(simulated):.2f}"
    return out


def render(record: Record) -> str:
    """The section: the profile, the table of measured against simulated, the costs."""
    data = record.data
    costs, stream_factor = data["costs"], data["stream_factor"]
    return "\n".join(
        [
            f"{record.measured_on()}; profile `sim/profiles/{data['profile']}.json` "
            f"({data['notes']}).",
            "Command: `make sim-profile` fitted the profile to a `make bench-modes` measurement "
            "and it stays frozen (`make bench-modes` checks it against its fresh measurement, "
            f"`make bench-sim-holdout` out of sample); this table: `{record.command}`.",
            "",
            calibration_table(data["rows"]),
            "",
            f"Costs: batch decode {1e3 * costs['decode_step_s']:.2f} ms per step + "
            f"{1e3 * costs['decode_per_request_s']:.3f} ms per running request, "
            f"{1e3 * costs['batch_overhead_s']:.0f} ms per generate call; streaming decode "
            f"{1e3 * (costs['stream_decode_step_s'] or 0):.2f} + "
            f"{1e3 * (costs['stream_per_request_s'] or 0):.3f} ms (isolated engine x "
            f"{stream_factor:.2f}); training "
            f"{1e3 * costs['train_step_s']:.0f} ms + {1e3 * costs['train_per_token_s']:.3f} ms "
            f"per token, x {costs['train_overlap_factor']:.2f} beside generation; weight load "
            f"{1e3 * costs['sync_latency_s']:.0f} ms.",
        ]
    )


def main() -> None:
    """Print the calibration check of a profile; with --write, keep it and write it."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--profile", default="cpu2core")
    parser.add_argument("--write", action="store_true", help="keep the record, write the section")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    data = {
        "profile": profile.name,
        "notes": profile.notes,
        "rows": calibration_rows(profile),
        "costs": profile.costs.model_dump(),
        "stream_factor": profile.calibration.get("stream_factor", 1.0),
    }
    title = "Simulator: calibration on this machine"
    publish(Record.measured("simulator-calibration", title, render, data), args.write)


if __name__ == "__main__":
    main()
