"""What a reward that misbehaves costs a run: ``configs/default.yaml`` in ``async`` with the
addition verifier as a user's reward function (``sluice.envs.verifiers:addition``, run in
the isolated pool), once as it is and once wrapped so that about one call in six
misbehaves (one in 30 each: hangs, exits its process, returns NaN, raises, returns text;
chosen by a stable hash of the prompt and the completion), the runs alternating.

Per run: the steps' wall-clock seconds (median, 90th percentile, the slowest), trained
samples/s and the failed samples the ledger recorded. Prints the section; ``--write`` also
keeps the record (``benchmarks/records.py``) and puts the section in BENCHMARKS.md
("Misbehaving rewards").

    .venv/bin/python -m benchmarks.misbehaving_reward --steps 20 --write
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from benchmarks.records import Record, publish, run_record
from benchmarks.tables import markdown_table, span
from sluice.storage.ledger import Ledger

ROOT = Path(__file__).parents[1]
CONFIG = "configs/default.yaml"
REWARDS = """
import os, signal, time, zlib
from sluice.envs.verifiers import addition

def clean(prompt, completion):
    return addition(prompt, completion)

def misbehaving(prompt, completion):
    kind = zlib.crc32((prompt + completion).encode()) % 30
    if kind == 0:
        time.sleep(3600)
    if kind == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == 2:
        return float("nan")
    if kind == 3:
        raise ValueError("misbehaving on purpose")
    if kind == 4:
        return "1.0"
    return addition(prompt, completion)
"""
LABELS = {"clean": "the verifier as a reward function", "misbehaving": "one call in six fails"}


def run(name: str, steps: int, root: Path, repeat: int) -> dict[str, Any]:
    """One run with the reward ``name``: the samples whose reward failed (from its ledger)
    and the whole run (``run_record``: its steps' wall times, its samples/s)."""
    run_name = f"bench-misbehaving-{name}-{repeat}"
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in (f"reward=misbehaving_rewards:{name}", f"train.steps={steps}",
                    f"eval.every={steps}", f"name={run_name}", f"root={root}"):  # fmt: skip
        cmd += ["--set", setting]
    print(f"running {name} ({repeat + 1}) for {steps} steps ...", flush=True)
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    run_dir = root / run_name
    table = Ledger(run_dir.as_uri()).read()
    reasons = table.column("reason")
    failed = int(pc.sum(pc.starts_with(pc.fill_null(reasons, ""), "reward ")).as_py() or 0)
    return {"failed_samples": failed, "run": run_record(run_dir, root)}


def row(label: str, result: dict[str, Any]) -> list[str]:
    """A run's cells: its steps' wall seconds (median, 90th percentile, the slowest), its
    trained samples/s, its failed samples."""
    run = result["run"]
    step_s = [step["wall_s"] for step in run["steps"]]
    return [
        label,
        f"{statistics.median(step_s):.2f}",
        f"{statistics.quantiles(step_s, n=10)[-1]:.2f}",
        f"{max(step_s):.2f}",
        f"{run['samples_per_s']:.1f}",
        f"{result['failed_samples']:.0f}",
    ]


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): per reward (``clean``,
    ``misbehaving``) the lowest and highest of its runs' median step seconds, trained
    samples/s and failed samples (``misbehaving.samples-per-s``)."""

    out = {}
    for name, runs in record.data["runs"].items():
        steps = [statistics.median(s["wall_s"] for s in r["run"]["steps"]) for r in runs]
        out |= {
            f"{name}.step-s": span(steps),
            f"{name}.samples-per-s": span(
                [r["run"]["samples_per_s"] for r in runs], " samples/s", 1
            ),
            f"{name}.failed": span([r["failed_samples"] for r in runs], "", 0),
        }
    return out


def render(record: Record) -> str:
    """The section: the settings, then a row per run, the clean reward's runs first."""
    data = record.data
    rows = [row(label, r) for name, label in LABELS.items() for r in data["runs"][name]]
    header = ["reward", "step s, median", "90th percentile", "slowest", "trained samples/s",
              "samples whose reward failed"]  # fmt: skip
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`: `{CONFIG}` for {data['steps']} async "
            "steps a run, `reward.timeout_s` at its default (10 s), the runs alternating.",
            "",
            *markdown_table(header, rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LABELS}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-misbehaving-") as folder:
        root = Path(folder)
        (root / "misbehaving_rewards.py").write_text(textwrap.dedent(REWARDS))
        for repeat in range(args.repeats):
            for name in LABELS:
                runs[name].append(run(name, args.steps, root, repeat))
    data = {"steps": args.steps, "repeats": args.repeats, "runs": runs}
    record = Record.measured("misbehaving-rewards", "Misbehaving rewards", render, data)
    publish(record, args.write)


if __name__ == "__main__":
    main()
