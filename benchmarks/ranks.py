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
round). Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and
writes the section in BENCHMARKS.md ("Training ranks").

    .venv/bin/python -m benchmarks.ranks --rounds 3 --write
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.engines import PROMPTS, SAMPLES_PER_PROMPT, fixed_samples, train_section
from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key
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


def measure(rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Per launch configuration (engine and layout, by label): the seconds of every step of
    its launch in each round."""
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-ranks-"))
    tok = build_tokenizer()
    policy = work / "policy"
    save_policy(build_model(PolicyConfig(), len(tok), seed=0), tok, policy)
    samples = work / "samples.json"
    samples.write_text(json.dumps([asdict(s) for s in fixed_samples(len(tok))]))
    launches = {
        (label, name): Launch(engine, stage, ranks, threads)
        for label, engine, stage in ENGINES
        for name, ranks, threads in LAYOUTS
    }
    times: dict[tuple[str, str], list[list[float]]] = {key: [] for key in launches}
    for r in range(rounds):
        for key, launch in launches.items():
            seconds = run(launch, policy, samples, work, steps)
            times[key].append(seconds)
            median = statistics.median(seconds[warmup:])
            print(f"round {r + 1}: {launch}: {median:.3f} s/step", flush=True)
    return [
        {"engine": label, "layout": name, "step_s": rounds_s}
        for (label, name), rounds_s in times.items()
    ]


@dataclass(frozen=True)
class Row:
    """One engine and layout over the rounds: each round's step seconds (the median of its
    steps after the warm-up) and the median speed-up over the engine's first layout,
    paired by round."""

    engine: str
    layout: str
    seconds: list[float]
    speedup: float


def rows(launches: list[dict[str, Any]], warmup: int) -> list[Row]:
    medians = {
        (launch["engine"], launch["layout"]): [
            statistics.median(seconds[warmup:]) for seconds in launch["step_s"]
        ]
        for launch in launches
    }
    base: dict[str, list[float]] = {}
    out = []
    for (engine, layout), values in medians.items():
        first = base.setdefault(engine, values)
        speedup = statistics.median(b / v for b, v in zip(first, values, strict=True))
        out.append(Row(engine, layout, values, speedup))
    return out


def table(launches: list[dict[str, Any]], warmup: int) -> list[str]:
    """Per engine and layout: the median over rounds of a launch's step time, its range,
    and its speed-up over the engine's first layout."""
    cells = [
        [
            r.engine,
            r.layout,
            f"{statistics.median(r.seconds):.3f}",
            f"{min(r.seconds):.3f}-{max(r.seconds):.3f}",
            f"{r.speedup:.2f}x",
        ]
        for r in rows(launches, warmup)
    ]
    header = ["engine", "layout", "step s (median)", "range", "speed-up over 1 rank x 1 thread"]
    return markdown_table(header, cells)


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each engine's and layout's speed-up
    and median step seconds (``torch-ddp.2-ranks-x-1-thread.speedup``), the range of the
    speed-ups of each layout over the engines (``2-ranks-x-1-thread.speedups``), the widest
    spread of one configuration's rounds."""
    found = rows(record.data["launches"], record.data["warmup"])
    out: dict[str, str] = {}
    for r in found:
        key = f"{quote_key(r.engine)}.{quote_key(r.layout)}"
        out[f"{key}.speedup"] = f"{r.speedup:.2f}x"
        out[f"{key}.step-s"] = f"{statistics.median(r.seconds):.3f}"
    for name, *_ in LAYOUTS[1:]:
        ups = [r.speedup for r in found if r.layout == name]
        out[f"{quote_key(name)}.speedups"] = f"{min(ups):.2f}-{max(ups):.2f}x"
    widest = max(max(r.seconds) / min(r.seconds) - 1 for r in found)
    out["widest-spread"] = f"{100 * widest:.0f}%"
    return out


def render(record: Record) -> str:
    """The section: the settings and load, then every engine's layouts."""
    data = record.data
    before, after = data["load_average"]
    header = (
        f"{record.measured_on()}; `{record.command}`. Default policy (1.08M parameters), "
        f"float32, a {data['batch_samples']}-sample batch; {data['rounds']} rounds of "
        f"launches, each the median of steps {data['warmup'] + 1}-{data['steps']}; load "
        f"average {before:.1f} before, {after:.1f} after."
    )
    return "\n".join([header, "", *table(data["launches"], data["warmup"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out per launch")
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    launches = measure(args.rounds, args.steps, args.warmup)
    data = {
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_samples": PROMPTS * SAMPLES_PER_PROMPT,
        "load_average": [load_before, os.getloadavg()[0]],
        "launches": launches,
    }
    packages = ["torch", "deepspeed"]
    publish(Record.measured("ranks", "Training ranks", render, data, packages), args.write)


if __name__ == "__main__":
    main()
