"""Every engine's bf16 steps at two ranks against one torch process's, on a real model.

Each engine (torch DDP, FSDP2, ZeRO-2, ZeRO-3) trains the model folder (the
SmolLM2-135M-Instruct folder of ``make model``) for ``--steps`` steps at ``train.ranks=2``
in bf16 under torchrun (``scripts/train_ranks.py``), each rank on its share of one batch.
One torch process takes the same steps on the whole batch in bf16, and once more in
float32. The table gives, per engine, the largest gap between its per-step loss and the
process's, and how far its update (the weights after the steps less the folder's) is from
the process's bf16 update, as a fraction of that update's norm; the float32 row shows how
far bf16 rounding alone moves the update. Prints the section; ``--write`` also keeps the
record (``benchmarks/records.py``) and writes the section in BENCHMARKS.md ("bf16 at two
ranks").

    .venv/bin/python -m benchmarks.bf16_ranks --model models/smollm2-135m-instruct --write
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.records import Record, publish
from benchmarks.startup_memory import launch, samples
from benchmarks.tables import markdown_table
from sluice.config.tree import TrainConfig
from sluice.engines.train.trainer import MODEL_FILE, PolicyTrainer, build_engine
from sluice.rl.batching import collate
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.torch_state import bytes_to_tensors

# (label, train.engine, train.zero_stage)
ENGINES = [
    ("torch (DDP)", "torch", 2),
    ("fsdp (FSDP2)", "fsdp", 2),
    ("deepspeed ZeRO-2", "deepspeed", 2),
    ("deepspeed ZeRO-3", "deepspeed", 3),
]
# The tolerance: an engine's gaps to one bf16 process stay under the gaps bf16 rounding
# alone opens on the same steps (one process in float32 against the same in bf16). The
# tiny policy's one-step bounds (tests/unit/engines/train/test_trainer_device.py: loss 1e-4) do not
# carry over: on a 30-layer model at two ranks each rank's batch has other shapes, and bf16
# matmuls round by shape.
SETTINGS = {"lr": 1e-5, "micro_batch": 4, "threads": 1, "loss": "ppo"}


def train(dtype: str, **engine: object) -> TrainConfig:
    return TrainConfig(**SETTINGS, dtype=dtype, **engine)  # type: ignore[arg-type]


def in_process(model: Path, dtype: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One torch process's losses and weights after ``steps`` steps on the whole batch."""
    trainer: PolicyTrainer = build_engine(train(dtype), str(model), seed=0, device="cpu")
    batch = collate(samples(), trainer.pad_id)
    losses = [trainer.step_batch(batch)["loss"] for _ in range(steps)]
    return losses, trainer.cpu_state()


def largest_gap(losses: list[float], want: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, want, strict=True))


def update_gap(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """``|got - want| / |want - start|`` over every weight, flattened."""
    names = sorted(want)
    diff = torch.cat([(got[n].float() - want[n].float()).flatten() for n in names])
    moved = torch.cat([(want[n].float() - start[n].float()).flatten() for n in names])
    return float(diff.norm() / moved.norm())


def table(data: dict[str, Any]) -> list[str]:
    """The float32 process's gaps to the bf16 process, then each engine's, and whether every
    engine's gaps stay under the float32 row's."""
    want = data["bf16_losses"]
    loss_tol = largest_gap(data["float32_losses"], want)
    update_tol = data["float32_update_gap"]
    rows = [["one torch process, float32", "1", f"{loss_tol:.1e}", f"{update_tol:.3f}"]]
    under = True
    for engine in data["engines"]:
        loss_gap, gap = largest_gap(engine["losses"], want), engine["update_gap"]
        under = under and loss_gap < loss_tol and gap < update_tol
        rows.append([engine["engine"], str(engine["ranks"]), f"{loss_gap:.1e}", f"{gap:.3f}"])
    header = ["engine", "ranks", "largest loss gap to one bf16 process", "update gap (of its norm)"]
    verdict = (
        f"Every engine's gaps under bf16's own (the float32 row: loss {loss_tol:.1e}, update "
        f"{update_tol:.3f}): {'yes' if under else 'no'}."
    )
    return [*markdown_table(header, rows), "", verdict]


def render(record: Record) -> str:
    """The section: the model and steps, the table, the verdict."""
    data = record.data
    intro = (
        f"{record.measured_on()}; `{record.command}`. `{data['model']}`, {data['steps']} steps "
        f"of 8 samples at lr {data['lr']:g}, one thread a rank. Each engine at `train.ranks=2` "
        "in bf16 against one torch process in bf16 on the whole batch; the float32 row is one "
        "process in float32 against the same."
    )
    return "\n".join([intro, "", *table(data)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    model = args.model.resolve()
    print("one torch process, bf16 and float32 ...", flush=True)
    start = build_engine(train("float32"), str(model), seed=0, device="cpu").cpu_state()
    want_losses, want = in_process(model, "bfloat16", args.steps)
    float32_losses, float32 = in_process(model, "float32", args.steps)
    engines = []
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-bf16-"))
    for label, engine, stage in ENGINES:
        print(f"{label} x2 ...", flush=True)
        out = launch(model, train("bfloat16", engine=engine, zero_stage=stage), 2, args.steps, work)
        losses = [m["loss"] for m in json.loads((out / "metrics.json").read_text())["steps"]]
        saved = CheckpointStore(out.as_uri()).load_latest()
        assert saved is not None
        weights = bytes_to_tensors(saved.files[MODEL_FILE])
        gap = update_gap(weights, want, start)
        engines.append({"engine": label, "ranks": 2, "losses": losses, "update_gap": gap})
    shutil.rmtree(work, ignore_errors=True)
    data = {
        "model": args.model.name,
        "steps": args.steps,
        "lr": SETTINGS["lr"],
        "bf16_losses": want_losses,
        "float32_losses": float32_losses,
        "float32_update_gap": update_gap(float32, want, start),
        "engines": engines,
    }
    publish(Record.measured("bf16-ranks", "bf16 at two ranks", render, data), args.write)


if __name__ == "__main__":
    main()
