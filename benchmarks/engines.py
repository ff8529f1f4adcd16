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
gloo), as it does in a Ray trainer actor. Writes the table into BENCHMARKS.md between
markers.

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

from benchmarks.report import write_section
from benchmarks.tables import markdown_table, measured_on
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


def measure(cfg: PolicyConfig, repeats: int, warmup: int, threads: int) -> dict[str, dict]:
    """Per engine: step-time median, quartiles and build time on one policy size."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-engines-") as tmp:
        tok = build_tokenizer()
        model = build_model(cfg, len(tok), seed=0)
        params = sum(p.numel() for p in model.parameters())
        save_policy(model, tok, Path(tmp))
        built = {label: _build(Path(tmp), stage, threads) for label, stage in ENGINES}
        torch_label = ENGINES[0][0]
        batch = fixed_batch(len(tok), next(iter(built.values()))[0].pad_id)
        times = step_times({label: t for label, (t, _) in built.items()}, batch, repeats, warmup)
    results = {}
    for label, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4)
        ratios = [t / base for t, base in zip(samples, times[torch_label], strict=True)]
        results[label] = {
            "ratio": statistics.median(ratios),
            "median": statistics.median(samples),
            "q1": q1,
            "q3": q3,
            "build_s": built[label][1],
            "params": params,
            "tokens": int(batch.mask.sum()),
        }
    return results


def table(
    results: dict[str, dict[str, dict]],
    repeats: int,
    warmup: int,
    threads: int,
    one_time_s: float,
    loads: tuple[float, float],
) -> str:
    lines = [
        f"{measured_on('torch', 'deepspeed', 'transformers')} (cores shared); "
        f"float32, {threads} torch thread(s), one process (DeepSpeed: a world of one, gloo); "
        f"batch of {PROMPTS * SAMPLES_PER_PROMPT} samples; median of {repeats} steps per "
        f"engine after {warmup} warm-up steps, engines interleaved step by step. One-time "
        f"DeepSpeed costs (process group, first engine): {one_time_s:.1f} s, not in build s. "
        f"1-minute load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end.",
        f"Command: `.venv/bin/python -m benchmarks.engines --repeats {repeats} "
        f"--warmup {warmup} --threads {threads}`.",
        "",
        *markdown_table(
            [
                "policy",
                "params",
                "engine",
                "x torch (paired median)",
                "step s (median)",
                "IQR s",
                "build s",
            ],
            [
                [
                    size,
                    f"{r['params'] / 1e6:.2f}M",
                    label,
                    f"{r['ratio']:.2f}",
                    f"{r['median']:.3f}",
                    f"{r['q1']:.3f}-{r['q3']:.3f}",
                    f"{r['build_s']:.2f}",
                ]
                for size, rows in results.items()
                for label, r in rows.items()
            ],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (train.threads)")
    parser.add_argument(
        "--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone"
    )
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
    results = {}
    for size, cfg in SIZES:
        print(f"timing {size} ...", flush=True)
        results[size] = measure(cfg, args.repeats, args.warmup, args.threads)
    loads = (load_start, os.getloadavg()[0])
    section = table(results, args.repeats, args.warmup, args.threads, one_time_s, loads)
    print(section)
    if not args.no_write:
        write_section("engines", "Training engines: torch vs DeepSpeed", section)


if __name__ == "__main__":
    main()
