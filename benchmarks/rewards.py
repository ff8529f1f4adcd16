"""What isolating reward code costs: the built-in verifier in-process against the same
verifier as a reward function in the isolated pool (``reward:
sluice.envs.verifiers:addition``), in one invocation.

- scoring: groups of 8 completions of the default workload's problems scored by each path
  (``VerifierScorer`` and ``PoolScorer`` with one process), microseconds per sample,
  interleaved over ``--repeats`` rounds;
- end to end: ``sluice run configs/default.yaml`` for ``--steps`` steps, once per path and
  repeat, alternating, and its trained samples/s (``summary.json``) and held-out accuracy.

Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and puts
the section in BENCHMARKS.md ("Isolated rewards").

    .venv/bin/python -m benchmarks.rewards --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.records import Record, publish, run_record
from benchmarks.tables import markdown_table, quote_key, spread
from sluice.envs import make_env
from sluice.envs.rewards import RewardFunction
from sluice.envs.scoring import Scorer, VerifierScorer, make_scorer

ROOT = Path(__file__).parents[1]
CONFIG = "configs/default.yaml"
ISOLATED = "sluice.envs.verifiers:addition"
PATHS = {"in-process verifier": [], "isolated reward function": [f"reward={ISOLATED}"]}


def scoring_us(scorer: Scorer, rounds: int = 40) -> float:
    """Microseconds per sample to score groups of 8 of the default workload."""
    env = make_env("addition", digits=2, scratch=True)
    problems = env.problems("train", 64, 0)
    groups = [[p.answer, p.answer[:-1], "x", p.answer] * 2 for p in problems]
    lengths = [[len(c) for c in g] for g in groups]
    scorer.score(problems[:1], groups[:1], lengths[:1])  # start the pool's process
    start = time.perf_counter()
    for _ in range(rounds):
        for g in range(len(problems)):
            scorer.score(problems[g : g + 1], groups[g : g + 1], lengths[g : g + 1])
    return 1e6 * (time.perf_counter() - start) / (rounds * 8 * len(problems))


def run(label: str, steps: int, root: Path, repeat: int) -> dict[str, Any]:
    """One end-to-end run of the path ``label``: its held-out accuracy at the end
    (``summary.json``) and the whole run (``run_record``, its samples/s among it)."""
    name = f"bench-reward-{'isolated' if PATHS[label] else 'inprocess'}-{repeat}"
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in (*PATHS[label], f"train.steps={steps}", f"eval.every={steps}", f"name={name}",
                    f"root={root}"):  # fmt: skip
        cmd += ["--set", setting]
    print(f"running {label} ({repeat + 1}) for {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((root / name / "summary.json").read_text())
    return {"end_accuracy": summary["end_accuracy"], "run": run_record(root / name, root)}


# The isolated path's trained samples/s within this share of the in-process path's.
TARGET = 0.05


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): per path (``isolated-reward-function``)
    its scoring µs a sample and trained samples/s as median (min-max); the ratio of the
    isolated path's median samples/s to the in-process one's and whether it is within
    ``TARGET``; the µs the subprocess adds a sample and their share of a trained sample's
    end-to-end time."""
    micro, runs = record.data["micro_us"], record.data["runs"]
    inner, isolated = PATHS
    rate = {label: [r["run"]["samples_per_s"] for r in runs[label]] for label in PATHS}
    ratio = statistics.median(rate[isolated]) / statistics.median(rate[inner])
    added = statistics.median(micro[isolated]) - statistics.median(micro[inner])
    out: dict[str, str] = {}
    for label in PATHS:
        out[f"{quote_key(label)}.us"] = spread(micro[label], "", 1)
        out[f"{quote_key(label)}.samples-per-s"] = spread(rate[label], "", 1)
    return out | {
        "ratio": f"{ratio:.3f}",
        "target": "within the target" if ratio >= 1 - TARGET else "short of the target",
        "added-us": f"{added:.1f}",
        "added-share": f"{100 * added * 1e-6 * statistics.median(rate[isolated]):.2f}%",
    }


def render(record: Record) -> str:
    """The section: how the paths were measured, then per path its scoring cost, trained
    samples/s (with the ratio of the medians to the in-process verifier's) and held-out
    accuracy, each as median (min-max) over the rounds or runs."""
    data = record.data
    micro, runs = data["micro_us"], data["runs"]
    base = statistics.median(r["run"]["samples_per_s"] for r in runs["in-process verifier"])
    rows = []
    for label in PATHS:
        rate = [r["run"]["samples_per_s"] for r in runs[label]]
        rows.append(
            [
                label,
                spread(micro[label], ""),
                spread(rate, ""),
                f"{statistics.median(rate) / base:.3f}",
                spread([100 * r["end_accuracy"] for r in runs[label]], ""),
            ]
        )
    header = ["scoring", "µs per sample, median (min-max)", "trained samples/s",
              "ratio", "held-out % at the end"]  # fmt: skip
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`. Scoring: "
            f"{len(micro['in-process verifier'])} interleaved rounds of groups of 8; end to "
            f"end: `{CONFIG}` for {data['steps']} async steps, {data['repeats']} runs of each "
            "path, alternating.",
            "",
            *markdown_table(header, rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    env = make_env("addition", digits=2, scratch=True)
    pool = make_scorer(env, [RewardFunction(ISOLATED)])
    micro: dict[str, list[float]] = {label: [] for label in PATHS}
    try:
        for _ in range(5):
            micro["in-process verifier"].append(scoring_us(VerifierScorer(env)))
            micro["isolated reward function"].append(scoring_us(pool))
    finally:
        pool.close()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in PATHS}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-rewards-") as folder:
        for repeat in range(args.repeats):
            for label in PATHS:
                runs[label].append(run(label, args.steps, Path(folder), repeat))
    data = {"steps": args.steps, "repeats": args.repeats, "micro_us": micro, "runs": runs}
    publish(Record.measured("rewards", "Isolated rewards", render, data), args.write)


if __name__ == "__main__":
    main()
