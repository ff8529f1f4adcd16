"""What isolating reward code costs: the built-in verifier in-process against the same
verifier as a reward function in the isolated pool (``reward:
sluice.envs.verifiers:addition``), in one invocation.

- scoring: groups of 8 completions of the default workload's problems scored by each path
  (``VerifierScorer`` and ``PoolScorer`` with one process), microseconds per sample,
  interleaved over ``--repeats`` rounds;
- end to end: ``sluice run configs/default.yaml`` for ``--steps`` steps, once per path and
  repeat, alternating, and its trained samples/s (``summary.json``) and held-out accuracy.

Prints a markdown table and a JSON line; ``--write`` also puts the table in BENCHMARKS.md
(section "Isolated rewards").

    .venv/bin/python -m benchmarks.rewards --write
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.report import measured_commit, write_section
from benchmarks.tables import markdown_table
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


def run(label: str, steps: int, root: Path, repeat: int) -> dict[str, float]:
    name = f"bench-reward-{'isolated' if PATHS[label] else 'inprocess'}-{repeat}"
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in (*PATHS[label], f"train.steps={steps}", f"eval.every={steps}", f"name={name}",
                    f"root={root}"):  # fmt: skip
        cmd += ["--set", setting]
    print(f"running {label} ({repeat + 1}) for {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((root / name / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "end_accuracy": summary["end_accuracy"]}


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-" + (
        f"{format(max(values), fmt)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
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
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in PATHS}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-rewards-") as folder:
        for repeat in range(args.repeats):
            for label in PATHS:
                runs[label].append(run(label, args.steps, Path(folder), repeat))
    base = statistics.median(r["samples_per_s"] for r in runs["in-process verifier"])
    rows = []
    for label in PATHS:
        rate = [r["samples_per_s"] for r in runs[label]]
        rows.append(
            [
                label,
                _spread(micro[label], ".1f"),
                _spread(rate, ".1f"),
                f"{statistics.median(rate) / base:.3f}",
                _spread([100 * r["end_accuracy"] for r in runs[label]], ".1f"),
            ]
        )
    header = ["scoring", "µs per sample, median (min-max)", "trained samples/s",
              "ratio", "held-out % at the end"]  # fmt: skip
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = measured_commit()
    body = (
        f"Measured {when} at {commit} on {platform.node() or 'this machine'} "
        f"({platform.machine()}); `.venv/bin/python -m benchmarks.rewards --steps "
        f"{args.steps} --repeats {args.repeats} --write`. Scoring: 5 interleaved rounds of "
        f"groups of 8; end to end: `{CONFIG}` for {args.steps} async steps, {args.repeats} runs "
        "of each path, alternating.\n\n" + "\n".join(markdown_table(header, rows))
    )
    print(body)
    print(json.dumps({"micro_us": micro, "runs": runs}))
    if args.write:
        write_section("rewards", "Isolated rewards", body)


if __name__ == "__main__":
    main()
