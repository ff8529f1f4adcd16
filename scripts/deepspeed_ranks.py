"""DeepSpeed ranks under torchrun take steps on one batch; rank 0 writes what they reached.

One process per rank, each building ``engines.deepspeed_trainer.DeepSpeedTrainer`` from the
same model folder and calling ``step`` with the same samples (every rank trains on its share
of the micro-batches). After the steps the trainer's checkpoint (gathered from all ranks)
goes to ``<out>/checkpoints/`` and the per-step metrics to ``<out>/metrics.json``, both
written by rank 0. ``tests/integration/test_deepspeed_ranks.py`` compares them with the
torch engine's steps. On a 2-core machine give each rank one thread:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port 29511 scripts/deepspeed_ranks.py --policy <model folder> \\
        --samples samples.json --settings settings.json --out <folder> --zero-stage 2 --steps 3

``samples.json`` holds a list of ``rl.batching.Sample`` fields; ``settings.json`` the
trainer's keyword arguments (lr, clip_eps, grad_clip, micro_batch, threads, seed, ...).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from sluice.engines.deepspeed_trainer import DeepSpeedTrainer
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="model folder to start from")
    parser.add_argument("--samples", required=True, type=Path, help="JSON list of samples")
    parser.add_argument("--settings", required=True, type=Path, help="JSON trainer arguments")
    parser.add_argument("--out", required=True, type=Path, help="folder for rank 0's output")
    parser.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage: 1, 2 or 3")
    parser.add_argument("--steps", type=int, default=3, help="optimiser steps to take")
    args = parser.parse_args()

    samples = [Sample(**row) for row in json.loads(args.samples.read_text())]
    settings = json.loads(args.settings.read_text())
    trainer = DeepSpeedTrainer(args.policy, zero_stage=args.zero_stage, **settings)
    metrics = [trainer.step(samples) for _ in range(args.steps)]
    files, counters = trainer.checkpoint_files()  # collective: every rank gathers
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        CheckpointStore(args.out.resolve().as_uri()).save(args.steps, files, counters)
        world = {"world_size": dist.get_world_size(), "zero_stage": trainer.zero_stage}
        (args.out / "metrics.json").write_text(json.dumps({**world, "steps": metrics}))
    dist.barrier()


if __name__ == "__main__":
    main()
