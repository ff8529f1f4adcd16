"""torch vs DeepSpeed (ZeRO-1, -2, -3) training engines: step time on the same batch.

In one process, for each policy size, every engine is built from the same saved policy and
steps on the same batch (the default config's: 16 prompts x 8 samples, responses of 8 to 32
tokens, micro-batches of at most ``train.micro_batch_tokens`` padded tokens). The engines
take turns step by step; "x torch" is the median over rounds of each engine's step time over
torch's in the same round, so a load change on this shared machine, which hits one round's
engines alike, cancels out. The first ``warmup`` rounds are left out. Also reports the
median step time, its interquartile range, and how long building each engine took; a
throwaway DeepSpeed engine is built first, so one-time costs (the process group, DeepSpeed's
first initialisation) are reported on their own. DeepSpeed runs as one rank (a world of one,
gloo), as it does in a Ray trainer actor. Prints the section; unless ``--no-write``, keeps the
record (``benchmarks/records.py``) and writes the section in BENCHMARKS.md.

    .venv/bin/python -m benchmarks.engines --repeats 15
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key
from sluice.config.tree import PolicyConfig, TrainConfig
from sluice.engines.train.trainer import PolicyTrainer, build_engine
from sluice.policy.starting import build_model, build_tokenizer, save_policy
from sluice.rl.batching import Sample, TrainBatch, collate

# (label, policy shape): the default config's policy, and one 6x larger, where the
# engines' fixed costs per step weigh less against the arithmetic.
SIZES: list[tuple[str, PolicyConfig]] = [
    ("default (4 x 128)", PolicyConfig()),
    ("larger (6 x 256)", PolicyConfig(layers=6, hidden=256, heads=4, intermediate=1024)),
]
ENGINES: list[tuple[str, int | None]] = [
    ("torch", None),
    ("deepspeed ZeRO-1", 1),
    ("deepspeed ZeRO-2", 2),
    ("deepspeed ZeRO-3", 3),
]
PROMPTS, SAMPLES_PER_PROMPT = 16, 8  # the default config's batch


def fixed_batch(
    vocab: int,
    pad_id: int,
    seed: int = 0,
    response_len: Callable[[random.Random], int] = lambda rng: rng.randint(8, 32),
) -> TrainBatch:
    """One batch of off-policy samples with prompt and response lengths like addition's
    (``response_len`` draws each response's length)."""
    return collate(fixed_samples(vocab, seed, response_len), pad_id)


def fixed_samples(
    vocab: int,
    seed: int = 0,
    response_len: Callable[[random.Random], int] = lambda rng: rng.randint(8, 32),
) -> list[Sample]:
    """``fixed_batch``'s samples."""
    rng = random.Random(seed)
    samples = []
    for _ in range(PROMPTS):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(6, 12))]
        for _ in range(SAMPLES_PER_PROMPT):
            response = [rng.randrange(4, vocab) for _ in range(response_len(rng))]
            behaviour = [-rng.uniform(0.5, 4.0) for _ in response]
            samples.append(Sample(prompt, response, behaviour, rng.gauss(0.0, 1.0)))
    return samples


def train_section(threads: int, engine: str = "torch", zero_stage: int = 2) -> TrainConfig:
    """The default ``train`` section on ``engine`` with ``threads`` torch threads."""
    return TrainConfig(engine=engine, zero_stage=zero_stage, threads=threads)


def _build(folder: Path, zero_stage: int | None, threads: int) -> tuple[PolicyTrainer, float]:
    start = time.perf_counter()
    if zero_stage is None:
        train = train_section(threads)
    else:
        train = train_section(threads, "deepspeed", zero_stage)
    trainer = build_engine(train, str(folder), seed=0)
    return trainer, time.perf_counter() - start


def step_times(
    trainers: dict[str, PolicyTrainer], batch: TrainBatch, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per ``step_batch`` of each trainer, the trainers taking turns step by step
    (a load change then hits every trainer of a round alike); ``warmup`` rounds left out."""
    times: dict[str, list[float]] = {label: [] for label in trainers}
    for repeat in range(warmup + repeats):
        for label, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step_batch(batch)
            if repeat >= warmup:
                times[label].append(time.perf_counter() - start)
    return times


def measure(cfg: PolicyConfig, repeats: int, warmup: int, threads: int) -> dict[str, Any]:
    """On one policy size: its parameters, and per engine its build seconds and the seconds
    of each timed step (``step_times``)."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-engines-") as tmp:
        tok = build_tokenizer()
        model = build_model(cfg, len(tok), seed=0)
        params = sum(p.numel() for p in model.parameters())
        save_policy(model, tok, Path(tmp))
        built = {label: _build(Path(tmp), stage, threads) for label, stage in ENGINES}
        batch = fixed_batch(len(tok), next(iter(built.values()))[0].pad_id)
        times = step_times({label: t for label, (t, _) in built.items()}, batch, repeats, warmup)
    return {
        "params": params,
        "build_s": {label: seconds for label, (_, seconds) in built.items()},
        "step_s": times,
    }


def table(sizes: dict[str, dict[str, Any]]) -> list[str]:
    """Per policy size and engine: the median over rounds of its step over torch's, its
    median step and quartiles, its build time."""
    torch_label = ENGINES[0][0]
    rows = []
    for size, measured in sizes.items():
        base = measured["step_s"][torch_label]
        for label, samples in measured["step_s"].items():
            q1, _, q3 = statistics.quantiles(samples, n=4)
            ratio = statistics.median(t / b for t, b in zip(samples, base, strict=True))
            rows.append(
                [
                    size,
                    f"{measured['params'] / 1e6:.2f}M",
                    label,
                    f"{ratio:.2f}",
                    f"{statistics.median(samples):.3f}",
                    f"{q1:.3f}-{q3:.3f}",
                    f"{measured['build_s'][label]:.2f}",
                ]
            )
    header = [
        "policy",
        "params",
        "engine",
        "x torch (paired median)",
        "step s (median)",
        "IQR s",
        "build s",
    ]
    return markdown_table(header, rows)


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each size's and engine's step over
    torch's as a cost in percent (``larger.deepspeed-zero-3.over-torch``: "+11%")."""
    out: dict[str, str] = {}
    for size, measured in record.data["sizes"].items():
        base = measured["step_s"][ENGINES[0][0]]
        for label, samples in measured["step_s"].items():
            ratio = statistics.median(t / b for t, b in zip(samples, base, strict=True))
            key = f"{quote_key(size.split(' (')[0])}.{quote_key(label)}.over-torch"
            out[key] = f"{100 * (ratio - 1):+.0f}%"
    return out


def render(record: Record) -> str:
    """The section: the settings and one-time costs, then every size's engines."""
    data = record.data
    load_start, load_end = data["load_average"]
    header = (
        f"{record.measured_on()} (cores shared); `{record.command}`. Float32, "
        f"{data['threads']} torch thread(s), one process (DeepSpeed: a world of one, gloo); "
        f"batch of {data['batch_samples']} samples; median of {data['repeats']} steps per "
        f"engine after {data['warmup']} warm-up steps, engines interleaved step by step. "
        f"One-time DeepSpeed costs (process group, first engine): {data['one_time_s']:.1f} s, "
        f"not in build s. 1-minute load average {load_start:.1f} at the start, "
        f"{load_end:.1f} at the end."
    )
    return "\n".join([header, "", *table(data["sizes"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (train.threads)")
    parser.add_argument("--no-write", action="store_true", help="print the section, keep no record")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (quartiles need two steps)")
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-engines-") as tmp:
        tok = build_tokenizer()
        save_policy(build_model(SIZES[0][1], len(tok), seed=0), tok, Path(tmp))
        _build(Path(tmp), zero_stage=2, threads=args.threads)
    one_time_s = time.perf_counter() - start
    sizes = {}
    for size, cfg in SIZES:
        print(f"timing {size} ...", flush=True)
        sizes[size] = measure(cfg, args.repeats, args.warmup, args.threads)
    data = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "batch_samples": PROMPTS * SAMPLES_PER_PROMPT,
        "one_time_s": one_time_s,
        "load_average": [load_start, os.getloadavg()[0]],
        "sizes": sizes,
    }
    packages = ["torch", "deepspeed", "transformers"]
    record = Record.measured(
        "engines", "Training engines: torch vs DeepSpeed", render, data, packages
    )
    publish(record, write=not args.no_write)


if __name__ == "__main__":
    main()
