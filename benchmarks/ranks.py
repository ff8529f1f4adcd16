"""Trainer step time at 1 and 2 ranks for each engine: torch (DDP), FSDP2, DeepSpeed ZeRO-1/2/3.

Each configuration runs ``scripts/train_ranks.py`` under ``torchrun`` (the ranks a pool of
``train.ranks`` trainer actors forms, without Ray): every rank builds the engine from the
same saved policy and steps on its token-balanced share of the same 128-sample batch (the
default config's: 16 prompts x 8 samples, responses of 8 to 32 tokens). Three layouts per
engine, on the 2-core machine:

- 1 rank, 1 thread: the baseline, one core idle;
- 2 ranks, 1 thread each: data parallel over both cores (gloo between the processes);
- 1 rank, 2 threads: the other way to use both cores, for comparison.

Launches go round-robin over the configurations, ``--rounds`` times, so a load change on
this shared machine hits every configuration of a round; within a launch the first
``--warmup`` steps are left out and the rest's median is the launch's step time. The table
gives the median over rounds with its range, and the speed-up of 2 ranks over 1 (paired by
round). ``--write`` puts it in BENCHMARKS.md (section "Training ranks").

    .venv/bin/python -m benchmarks.ranks --rounds 3 --write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

from benchmarks.engines import fixed_samples, train_section
from benchmarks.report import measured_commit, write_section
from benchmarks.tables import markdown_table
from sluice.config.tree import PolicyConfig
from sluice.policy.starting import build_model, build_tokenizer, save_policy

ROOT = Path(__file__).parents[1]
# (label, train.engine, train.zero_stage)
ENGINES = [
    ("torch (DDP)", "torch", 0),
    ("fsdp (FSDP2)", "fsdp", 0),
    ("deepspeed ZeRO-1", "deepspeed", 1),
    ("deepspeed ZeRO-2", "deepspeed", 2),
    ("deepspeed ZeRO-3", "deepspeed", 3),
]
# (label, ranks, threads per rank)
LAYOUTS = [("1 rank x 1 thread", 1, 1), ("2 ranks x 1 thread", 2, 1), ("1 rank x 2 threads", 1, 2)]
LAUNCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class Launch:
    engine: str
    stage: int
    ranks: int
    threads: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(launch: Launch, policy: Path, samples: Path, work: Path, steps: int) -> list[float]:
    """Seconds of each step of one torchrun launch."""
    train = work / f"train-{launch.engine}{launch.stage}-{launch.threads}.json"
    train.write_text(
        train_section(launch.threads, launch.engine, launch.stage or 2).model_dump_json()
    )
    out = Path(tempfile.mkdtemp(dir=work))
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(launch.ranks)),
        *("--master_addr", "127.0.0.1", "--master_port", str(_free_port())),
        str(ROOT / "scripts" / "train_ranks.py"),
        *("--policy", str(policy), "--samples", str(samples), "--train", str(train)),
        *("--out", str(out)),
        *("--steps", str(steps)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(launch.threads), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{launch} failed:\n{done.stderr[-3000:]}")
    return list(json.loads((out / "metrics.json").read_text())["step_s"])


def measure(rounds: int, steps: int, warmup: int) -> dict[Launch, list[float]]:
    """Per launch configuration: its step time (median after warm-up) in each round."""
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-ranks-"))
    tok = build_tokenizer()
    policy = work / "policy"
    save_policy(build_model(PolicyConfig(), len(tok), seed=0), tok, policy)
    samples = work / "samples.json"
    samples.write_text(json.dumps([asdict(s) for s in fixed_samples(len(tok))]))
    launches = [
        Launch(engine, stage, ranks, threads)
        for _, engine, stage in ENGINES
        for _, ranks, threads in LAYOUTS
    ]
    times: dict[Launch, list[float]] = {launch: [] for launch in launches}
    for r in range(rounds):
        for launch in launches:
            seconds = run(launch, policy, samples, work, steps)
            times[launch].append(statistics.median(seconds[warmup:]))
            print(f"round {r + 1}: {launch}: {times[launch][-1]:.3f} s/step", flush=True)
    return times


def table(times: dict[Launch, list[float]]) -> str:
    rows = []
    for label, engine, stage in ENGINES:
        by_layout = {name: times[Launch(engine, stage, n, t)] for name, n, t in LAYOUTS}
        base = by_layout[LAYOUTS[0][0]]
        for name, values in by_layout.items():
            speedup = statistics.median(b / v for b, v in zip(base, values, strict=True))
            rows.append(
                [
                    label,
                    name,
                    f"{statistics.median(values):.3f}",
                    f"{min(values):.3f}-{max(values):.3f}",
                    f"{speedup:.2f}x",
                ]
            )
    header = ["engine", "layout", "step s (median)", "range", "speed-up over 1 rank x 1 thread"]
    return "\n".join(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out per launch")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    times = measure(args.rounds, args.steps, args.warmup)
    section = (
        f"Measured {datetime.now(UTC):%Y-%m-%d} at commit {measured_commit()} on "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {version('torch')}, deepspeed {version('deepspeed')}; default policy "
        f"(1.08M parameters), float32, a 128-sample batch; {args.rounds} rounds of "
        f"launches, each the median of steps {args.warmup + 1}-{args.steps}; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.\n"
        f"Command: `make bench-ranks` (`.venv/bin/python -m benchmarks.ranks "
        f"--rounds {args.rounds} --write`).\n\n" + table(times)
    )
    print(section)
    if args.write:
        write_section("ranks", "Training ranks", section)


if __name__ == "__main__":
    main()
