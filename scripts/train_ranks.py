"""Training ranks under torchrun take steps on one batch; rank 0 writes what they reached.

One process per rank, each building the trainer of the ``train`` section in ``--train``
(``train.engine`` torch: DDP; fsdp: FSDP2; deepspeed: ZeRO at ``train.zero_stage``) from
the same model folder and training on its token-balanced share of the same samples
(``engines.train.ranks.shares``), as the trainer actors of a pool of ``train.ranks`` do: each step
follows a weight publish's gathers, and the checkpoint follows a log-prob check's forward.
After the steps the trainer's checkpoint (gathered from all ranks) goes to
``<out>/checkpoints/`` and the per-step metrics and seconds to ``<out>/metrics.json``, both
written by rank 0. ``tests/integration/test_train_ranks.py`` compares them with one torch
process's steps; ``benchmarks/ranks.py`` times the engines with them. On a 2-core machine
give each rank one thread:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port 29511 scripts/train_ranks.py --policy <model folder> \\
        --samples samples.json --train train.json --out <folder> --steps 3

``samples.json`` holds a list of ``rl.batching.Sample`` fields; ``train.json`` the config's
``train`` section (``config.tree.TrainConfig``: engine, zero_stage, lr, micro_batch, lora, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# A script of the checkout: its memory meter is the benchmarks' (not shipped in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cpu_meter import ResidentKinds, resident_bytes, resident_kinds
from sluice.config.tree import TrainConfig
from sluice.engines.train.ranks import Rendezvous, join, shares
from sluice.engines.train.trainer import PolicyTrainer, build_engine
from sluice.rl.batching import Sample, collate
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.safetensors_stream import drain


def publish(trainer: PolicyTrainer, rank: int) -> None:
    """What a pool's weight publish asks of each rank (``engines/train/pool.py``): a
    sharded engine's ranks gather the weights one tensor at a time, rank 0 reading their
    layout first. The gathered tensors go nowhere here."""
    if trainer.sharded:
        if rank == 0:
            trainer.layout()
        for _ in trainer.gathered():
            pass


class GpuPeaks:
    """On a GPU, the peak bytes allocated on it in each phase, into ``memory`` as
    ``gpu_<phase>_peak_bytes`` (``gpu_base_bytes``: allocated before the model); nothing on
    a CPU."""

    def __init__(self, memory: dict[str, int]) -> None:
        self.memory = memory
        self.on = torch.cuda.is_available()
        if self.on:
            memory["gpu_base_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def record(self, phase: str) -> None:
        if self.on:
            self.memory[f"gpu_{phase}_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()


def kinds(phase: str, found: dict[str, int]) -> dict[str, int]:
    """``found`` (bytes by kind of resident memory) as ``<phase>_<kind>_bytes`` entries."""
    return {f"{phase}_{kind}_bytes": value for kind, value in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="model folder to start from")
    parser.add_argument("--samples", required=True, type=Path, help="JSON list of samples")
    parser.add_argument("--train", required=True, type=Path, help="JSON train section")
    parser.add_argument("--out", required=True, type=Path, help="folder for rank 0's output")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3, help="optimiser steps to take")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="write each rank's resident memory at start-up, in the last step, in the "
        "checkpoint and in loading it back to <out>/memory-<rank>.json (Linux: "
        "/proc/self/status), and on a GPU the peak allocated on it in each of those and in "
        "the steps (gpu_*)",
    )
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():  # one device a rank, as Ray gives each trainer actor
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    place = Rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world)
    join(place, timeout_s=120)
    samples = [Sample(**row) for row in json.loads(args.samples.read_text())]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    mine = [samples[i] for i in shares(lengths, world)[rank]]
    train = TrainConfig.model_validate_json(args.train.read_text())
    memory = {"base_bytes": resident_bytes("VmRSS")}  # imports and the group, before the model
    memory |= kinds("base", resident_kinds())
    gpu = GpuPeaks(memory)
    with ResidentKinds(args.memory) as startup:
        trainer = build_engine(train, args.policy, args.seed)
    memory["startup_peak_bytes"] = resident_bytes("VmHWM")
    memory |= kinds("startup_peak", startup.peaks) | kinds("after_startup", resident_kinds())
    gpu.record("startup")
    metrics, seconds = [], []
    seen: set[str] = set()  # the dtypes the linear layers return in the steps
    linears = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(str(out.dtype))) for m in linears]
    for step in range(args.steps):
        if args.memory and step == args.steps - 1:  # AdamW's state is there by now
            Path("/proc/self/clear_refs").write_text("5")
            memory["before_step_bytes"] = resident_bytes("VmRSS")
        publish(trainer, rank)
        start = time.perf_counter()
        metrics.append(trainer.step_batch(collate(mine, trainer.pad_id)))
        seconds.append(time.perf_counter() - start)  # the pool's: every step ends collectively
    if args.memory:
        memory["step_peak_bytes"] = resident_bytes("VmHWM")
    for hook in hooks:
        hook.remove()
    # A session's log-prob check (a forward with no backward) may come right before a
    # checkpoint: the checkpoint must find the optimiser's state as a step left it.
    trainer.logprobs(mine)
    gpu.record("steps")
    if args.memory:
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        memory["before_checkpoint_bytes"] = resident_bytes("VmRSS")
        memory |= kinds("before_checkpoint", resident_kinds())
    files, counters = trainer.checkpoint_files()
    args.out.mkdir(parents=True, exist_ok=True)
    with ResidentKinds(args.memory) as writing:
        if rank == 0:  # streamed: each tensor gathered (by every rank) as it is written
            CheckpointStore(args.out.resolve().as_uri()).save(args.steps, files, counters)
        else:
            drain(files)
    if args.memory:
        memory["checkpoint_peak_bytes"] = resident_bytes("VmHWM")
        memory |= kinds("checkpoint_peak", writing.peaks)
        gpu.record("checkpoint")
        dist.barrier()  # the checkpoint is complete
        Path("/proc/self/clear_refs").write_text("5")
        memory["before_resume_bytes"] = resident_bytes("VmRSS")
        memory |= kinds("before_resume", resident_kinds())
        saved = CheckpointStore(args.out.resolve().as_uri()).load_latest()
        assert saved is not None
        with ResidentKinds(args.memory) as loading:  # read from storage, tensor by tensor
            trainer.load_checkpoint(saved.files, saved.meta)
        memory["resume_peak_bytes"] = resident_bytes("VmHWM")
        memory |= kinds("resume_peak", loading.peaks)
        gpu.record("resume")
        (args.out / f"memory-{rank}.json").write_text(json.dumps(memory))
    if rank == 0:
        (args.out / "metrics.json").write_text(
            json.dumps(
                {
                    "world_size": world,
                    "steps": metrics,
                    "step_s": seconds,
                    "linear_dtypes": sorted(seen),
                }
            )
        )
    dist.barrier()


if __name__ == "__main__":
    main()
