"""The simulator's calibration check on this machine: each measured mode's ratio to sync
beside the simulator's prediction from the fitted profile (``sim/profiles/*.json``), printed,
and with ``--write`` put in BENCHMARKS.md. Run from a checkout (``make simulate``):

    .venv/bin/python -m benchmarks.sim_calibration --write
"""

from __future__ import annotations

import argparse
import os
import platform

from benchmarks.report import write_section
from sluice.sim.calibrate import calibration_table, load_profile


def main() -> None:
    """Print the calibration check of a profile; with --write, put it in BENCHMARKS.md."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--profile", default="cpu2core")
    parser.add_argument("--write", action="store_true", help="write the BENCHMARKS.md section")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    costs = profile.costs
    text = "\n".join(
        [
            f"Profile `sim/profiles/{profile.name}.json` ({profile.notes}); simulated on "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.",
            "Command: `make bench-modes` measures the modes and fits the profile to them "
            "(`make sim-profile` re-fits it to the last measurement); this table: "
            "`.venv/bin/python -m benchmarks.sim_calibration --write`.",
            "",
            calibration_table(profile),
            "",
            f"Costs: batch decode {1e3 * costs.decode_step_s:.2f} ms per step + "
            f"{1e3 * costs.decode_per_request_s:.3f} ms per running request, "
            f"{1e3 * costs.batch_overhead_s:.0f} ms per generate call; streaming decode "
            f"{1e3 * (costs.stream_decode_step_s or 0):.2f} + "
            f"{1e3 * (costs.stream_per_request_s or 0):.3f} ms (isolated engine x "
            f"{profile.calibration.get('stream_factor', 1.0):.2f}); training "
            f"{1e3 * costs.train_step_s:.0f} ms + {1e3 * costs.train_per_token_s:.3f} ms per "
            f"token, x {costs.train_overlap_factor:.2f} beside generation; weight load "
            f"{1e3 * costs.sync_latency_s:.0f} ms.",
        ]
    )
    print(text)
    if args.write:
        write_section("simulator-calibration", "Simulator: calibration on this machine", text)


if __name__ == "__main__":
    main()
