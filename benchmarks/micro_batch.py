"""Trainer step time by ``train.micro_batch_tokens`` and ``train.packing`` on a long-tail
batch: why the defaults are what they are.

One process, the torch engine on the default tiny policy, one torch thread (as in the trainer
actor). The batch is the long-tail workload's shape: 16 prompts x 8 samples, response lengths
drawn with the spread ``configs/longtail.yaml`` produces (median 19 tokens, p99 about 76,
capped at 86). Each setting gets its own trainer from the same saved policy; the settings take
turns step by step, and "x 4096" is the median over rounds of a setting's step time over the
4096-token padded setting's in the same round, so a load change hits both sides of a ratio
alike. Tokens/s counts the batch's real tokens (prompts and responses, no padding).
Prints the section, keeps the record (``benchmarks/records.py``) and writes the section in
BENCHMARKS.md.

    .venv/bin/python -m benchmarks.micro_batch --repeats 15
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.engines import fixed_batch, step_times
from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key
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


def measure(repeats: int, warmup: int) -> tuple[dict[str, list[float]], TrainBatch]:
    """Each setting's step seconds, round by round (the settings taking turns), and the
    batch they stepped on."""
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
        return step_times(dict(trainers), batch, repeats, warmup), batch


def batch_shape(batch: TrainBatch) -> dict[str, int]:
    """The batch's samples, response tokens, shortest and longest row and real tokens in all
    (prompts and responses, no padding)."""
    lengths = batch.attention_mask.sum(dim=1)
    return {
        "samples": len(batch),
        "response_tokens": int(batch.mask.sum()),
        "row_min": int(lengths.min()),
        "row_max": int(lengths.max()),
        "tokens": int(lengths.sum()),
    }


def table(step_s: dict[str, list[float]], tokens: int) -> list[str]:
    """Per setting: its median step, the median over rounds of its step over the baseline's,
    and ``tokens`` over its median step."""
    rows = []
    for label, samples in step_s.items():
        median = statistics.median(samples)
        ratio = statistics.median(t / b for t, b in zip(samples, step_s[BASELINE], strict=True))
        rows.append([label, f"{median:.3f}", f"{ratio:.2f}", f"{tokens / median:.0f}"])
    return markdown_table(["micro_batch_tokens", "step s", "x 4096", "tokens/s"], rows)


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each setting's median step seconds
    and its step over the 4096-token one's (``no-split.x-4096``), a packed step over the
    padded one at the same size (``1024-packed.x-padded``)."""
    step_s = record.data["step_s"]
    out: dict[str, str] = {}
    for label, samples in step_s.items():
        ratio = statistics.median(t / b for t, b in zip(samples, step_s[BASELINE], strict=True))
        out[f"{quote_key(label)}.step-s"] = f"{statistics.median(samples):.3f}"
        out[f"{quote_key(label)}.x-4096"] = f"{ratio:.2f}x"
        padded = label.removesuffix(" packed")
        if padded != label and padded in step_s:
            over = statistics.median(samples) / statistics.median(step_s[padded])
            out[f"{quote_key(label)}.x-padded"] = f"{over:.2f}x"
    return out


def render(record: Record) -> str:
    """The section: the batch, then each setting's step time against the 4096-token one."""
    data = record.data
    batch, repeats = data["batch"], data["repeats"]
    header = (
        f"{record.measured_on()}; `{record.command}`. The default policy, float32, 1 torch "
        f"thread; a batch of {batch['samples']} samples, {batch['response_tokens']} response "
        f"tokens, rows of {batch['row_min']} to {batch['row_max']} tokens ({batch['tokens']} "
        f"in all); median of {repeats} steps per setting after {data['warmup']} warm-up steps, "
        "settings interleaved step by step."
    )
    return "\n".join([header, "", *table(data["step_s"], batch["tokens"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    step_s, batch = measure(args.repeats, args.warmup)
    data = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "batch": batch_shape(batch),
        "step_s": step_s,
    }
    publish(Record.measured("micro-batch", "Trainer micro-batches", render, data, ["torch"]))


if __name__ == "__main__":
    main()
