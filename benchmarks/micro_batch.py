"""Trainer step time by ``train.micro_batch_tokens`` and ``train.packing`` on a long-tail
batch: why the defaults are what they are.

One process, the torch engine on the default tiny policy, one torch thread (as in the trainer
actor). The batch is the long-tail workload's shape: 16 prompts x 8 samples, response lengths
drawn with the spread ``configs/longtail.yaml`` produces (median 19 tokens, p99 about 76,
capped at 86). Each setting gets its own trainer from the same saved policy; the settings take
turns step by step, and "x 4096" is the median over rounds of a setting's step time over the
4096-token padded setting's in the same round, so a load change hits both sides of a ratio
alike. Tokens/s counts the batch's real tokens (prompts and responses, no padding).
Writes the table into BENCHMARKS.md between markers.

    .venv/bin/python -m benchmarks.micro_batch --repeats 15
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import tempfile
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import torch

from benchmarks.engines import fixed_batch, step_times
from benchmarks.report import measured_commit, write_section
from benchmarks.tables import markdown_table
from sluice.config.tree import PolicyConfig, TrainConfig
from sluice.engines.train.trainer import NO_TOKEN_LIMIT, build_engine
from sluice.policy.starting import build_model, build_tokenizer, save_policy
from sluice.rl.batching import TrainBatch

# (label, micro_batch_tokens, packing)
SETTINGS: list[tuple[str, int, bool]] = [
    ("512", 512, False),
    ("1024", 1024, False),
    ("2048", 2048, False),
    ("4096", 4096, False),
    ("no split", NO_TOKEN_LIMIT, False),
    ("512 packed", 512, True),
    ("1024 packed", 1024, True),
    ("2048 packed", 2048, True),
]
BASELINE = "4096"
MEDIAN_TOKENS, SPREAD, MAX_TOKENS = 19, 0.6, 86  # lognormal: p99 = 19 * e^(2.33 * 0.6) = 77


def longtail_length(rng: random.Random) -> int:
    return min(MAX_TOKENS, max(1, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SPREAD))))


def measure(repeats: int, warmup: int) -> tuple[dict[str, dict[str, float]], TrainBatch]:
    train = TrainConfig()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-micro-") as tmp:
        tok = build_tokenizer()
        save_policy(build_model(PolicyConfig(), len(tok), seed=0), tok, Path(tmp))
        trainers = {
            label: build_engine(
                train.model_copy(update={"micro_batch_tokens": tokens, "packing": packing}),
                tmp,
                seed=0,
            )
            for label, tokens, packing in SETTINGS
        }
        batch = fixed_batch(len(tok), trainers[BASELINE].pad_id, response_len=longtail_length)
        times = step_times(dict(trainers), batch, repeats, warmup)
    tokens = float(batch.attention_mask.sum())
    results = {}
    for label, samples in times.items():
        ratios = [t / b for t, b in zip(samples, times[BASELINE], strict=True)]
        median = statistics.median(samples)
        results[label] = {
            "median": median,
            "ratio": statistics.median(ratios),
            "tokens_per_s": tokens / median,
        }
    return results, batch


def table(results: dict[str, dict[str, float]], batch: TrainBatch, repeats: int) -> str:
    lengths = batch.attention_mask.sum(dim=1)
    lines = [
        f"Measured {datetime.now(UTC):%Y-%m-%d} at {measured_commit()} on {platform.machine()}, "
        f"{os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {version('torch')}; the default policy, "
        f"float32, 1 torch thread; a batch of {len(batch)} samples, "
        f"{int(batch.mask.sum())} response tokens, rows of {int(lengths.min())} to "
        f"{int(lengths.max())} tokens ({int(lengths.sum())} in all); median of {repeats} steps "
        "per setting, settings interleaved step by step.",
        "Command: `make bench-micro-batch` "
        f"(`.venv/bin/python -m benchmarks.micro_batch --repeats {repeats}`).",
        "",
        *markdown_table(
            ["micro_batch_tokens", "step s", "x 4096", "tokens/s"],
            [
                [label, f"{r['median']:.3f}", f"{r['ratio']:.2f}", f"{r['tokens_per_s']:.0f}"]
                for label, r in results.items()
            ],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, batch = measure(args.repeats, args.warmup)
    text = table(results, batch, args.repeats)
    print(text)
    write_section("micro-batch", "Trainer micro-batches", text)


if __name__ == "__main__":
    main()
