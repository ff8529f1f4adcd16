"""Resident memory of each training rank at start-up and while it builds a checkpoint.

Each configuration runs ``scripts/train_ranks.py --memory`` under ``torchrun`` on a model
folder (the SmolLM2-135M-Instruct folder of ``make model``): every rank records its resident
memory after imports and joining the group (the base), its peak while the trainer is built
(the model loaded, sharded and wrapped, AdamW made), its peak in the second optimiser
step (two micro-batches a rank at two ranks, four at one, so the gradients accumulate;
AdamW's state was made by the first), then its peak while the checkpoint is written: rank
0 streams the weights and AdamW's moments into their files, each tensor gathered as it is
written, and the other ranks take part; last, its peak while every rank loads that
checkpoint back, reading it from storage. The
table gives each peak above what the rank held before, against the model's float32 bytes:
a rank that loads the whole model and then keeps its shard shows about 1.0 at start-up; one
that materialises only its shard, about 1/ranks. The start-up peak is split into the heap
(tensors, buffers) and mapped files' pages (libraries, safetensors read by mmap: shared and
reclaimable), so a peak over target says which it is. Prints the section; ``--write`` also
keeps the record (``benchmarks/records.py``) and writes the section in BENCHMARKS.md
("Trainer memory at start-up").

    .venv/bin/python -m benchmarks.startup_memory \\
        --model models/smollm2-135m-instruct --write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors import safe_open

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key
from sluice.config.tree import TrainConfig
from sluice.engines.train.ranks import free_port
from sluice.rl.batching import Sample

ROOT = Path(__file__).parents[1]
# (label, train.engine, train.zero_stage)
ENGINES = [
    ("torch (DDP)", "torch", 2),
    ("fsdp (FSDP2)", "fsdp", 2),
    ("deepspeed ZeRO-2", "deepspeed", 2),
    ("deepspeed ZeRO-3", "deepspeed", 3),
]
RANKS = (1, 2)
MIB = 1 << 20
TIMEOUT_S = 900
STEPS = 2  # the second step's peak: AdamW's state was made by the first


def float32_bytes(folder: Path) -> int:
    """The folder's weights in float32: 4 bytes an element of every stored tensor."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is no mapping)
                total += 4 * math.prod(f.get_slice(name).get_shape())
    return total


def samples() -> list[Sample]:
    """Eight short samples of token ids every vocabulary has, half rewarded, half not."""
    return [
        Sample(
            [1, 30 + i],
            [20 + (i + j) % 9 for j in range(4 + i)] + [2],
            [-3.0] * (5 + i),
            (-1.0) ** i,
        )
        for i in range(8)
    ]


def samples_file(out: Path, rows: list[Sample]) -> Path:
    path = out / "samples.json"
    path.write_text(json.dumps([asdict(r) for r in rows]))
    return path


def launch(
    model: Path,
    train: TrainConfig,
    ranks: int,
    steps: int,
    work: Path,
    *extra: str,
    rows: list[Sample] | None = None,
) -> Path:
    """``scripts/train_ranks.py`` at ``ranks`` ranks under torchrun, one thread a rank, on
    ``rows`` (``samples()`` by default); returns its output folder (metrics, checkpoint,
    memory records)."""
    out = Path(tempfile.mkdtemp(dir=work))
    (out / "train.json").write_text(train.model_dump_json())
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)),
        *("--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        str(ROOT / "scripts" / "train_ranks.py"),
        *("--policy", str(model), "--samples", str(samples_file(out, rows or samples()))),
        *("--train", str(out / "train.json"), "--out", str(out), "--steps", str(steps), *extra),
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{train.engine} x{ranks} failed:\n{done.stderr[-3000:]}")
    return out


def run(model: Path, engine: str, stage: int, ranks: int, work: Path) -> list[dict[str, int]]:
    """Each rank's memory record for one launch."""
    train = TrainConfig(engine=engine, zero_stage=stage, micro_batch=2, threads=1)  # type: ignore[arg-type]
    out = launch(model, train, ranks, STEPS, work, "--memory")
    return [json.loads((out / f"memory-{r}.json").read_text()) for r in range(ranks)]


# Each phase's peak and what it is measured above.
PHASES = (
    ("startup", "base"),
    ("step", "before_step"),
    ("checkpoint", "before_checkpoint"),
    ("resume", "before_resume"),
)


def _worst(per_rank: list[dict[str, int]], peak: str, before: str) -> dict[str, int]:
    """The rank whose ``peak`` rose most above ``before``."""
    return max(per_rank, key=lambda m: m[peak] - m[before])


def _mb(b: int, weights: int) -> str:
    return f"{b / MIB:,.0f} MB ({b / weights:.2f}x)"


def table(launches: list[dict[str, Any]], weights: int) -> str:
    """Per launch (engine and rank count), each phase's peak above what the worst rank held
    before it; at start-up also the heap (anonymous) and mapped-file parts of that peak and
    the heap the rank keeps once built, where the records have them."""
    rows = []
    for launch in launches:
        cells = []
        for phase, before in PHASES:
            m = _worst(launch["per_rank"], f"{phase}_peak_bytes", f"{before}_bytes")
            cells.append(_mb(m[f"{phase}_peak_bytes"] - m[f"{before}_bytes"], weights))
            if phase == "startup":
                cells.append(_split(m, weights))
        rows.append([launch["engine"], str(launch["ranks"]), *cells])
    header = [
        "engine",
        "ranks",
        "start-up peak above base, worst rank",
        "of it heap / mapped files; heap kept",
        "second step's peak above before, worst rank",
        "checkpoint peak above before, worst rank",
        "resume peak above before, worst rank",
    ]
    return "\n".join(markdown_table(header, rows))


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``), per launch (``deepspeed-zero-3.x2``)
    in the weights' float32 bytes, worst rank: each phase's peak above what came before it
    (``.startup``, ``.step``, ``.checkpoint``, ``.resume``) and the start-up peak's heap and
    mapped pages and the heap kept once built (``.heap``, ``.mapped``, ``.kept``)."""
    weights, out = record.data["float32_bytes"], {}
    for launch in record.data["launches"]:
        key = f"{quote_key(launch['engine'])}.x{launch['ranks']}"
        for phase, before in PHASES:
            m = _worst(launch["per_rank"], f"{phase}_peak_bytes", f"{before}_bytes")
            rise = m[f"{phase}_peak_bytes"] - m[f"{before}_bytes"]
            out[f"{key}.{phase}"] = f"{rise / weights:.2f}x"
        m = _worst(launch["per_rank"], "startup_peak_bytes", "base_bytes")
        if "startup_peak_anon_bytes" in m:
            heap, mapped, kept = _parts(m)
            out |= {
                f"{key}.heap": f"{heap / weights:.2f}x",
                f"{key}.mapped": f"{mapped / weights:.2f}x",
                f"{key}.kept": f"{kept / weights:.2f}x",
            }
    return out


def _parts(m: dict[str, int]) -> tuple[int, int, int]:
    """The start-up peak's heap and mapped files' pages above the base, and the heap kept."""
    return (
        m["startup_peak_anon_bytes"] - m["base_anon_bytes"],
        m["startup_peak_file_bytes"] - m["base_file_bytes"],
        m["after_startup_anon_bytes"] - m["base_anon_bytes"],
    )


def _split(m: dict[str, int], weights: int) -> str:
    if "startup_peak_anon_bytes" not in m:
        return "-"
    heap, mapped, kept = _parts(m)
    return f"{heap / weights:.2f}x / {mapped / weights:.2f}x; {kept / weights:.2f}x"


def render(record: Record) -> str:
    """The section: the model and what each phase's peak is, then every launch's peaks."""
    data = record.data
    weights = data["float32_bytes"]
    intro = (
        f"{record.measured_on()}; `{record.command}`. `{data['model']}`, float32 weights "
        f"{weights / MIB:,.0f} MB, one thread a rank. "
        "Resident memory of each rank (`/proc/self/status`), above what it held before: "
        "at start-up (the model loaded, sharded and wrapped, AdamW built), in the second "
        "step (micro-batches of 2 samples out of 8, so a rank accumulates the gradients "
        "of 2 at two ranks and of 4 at one), while the checkpoint is written after it "
        "(streamed: each tensor gathered as it is written), and while it is loaded back "
        "from storage. The start-up peak's "
        "parts: the peak of the heap (`RssAnon`) and of mapped files' pages (`RssFile`: "
        "libraries, safetensors read by mmap) above the base, sampled every 2 ms, and the "
        "heap the rank still holds once built."
    )
    return intro + "\n\n" + table(data["launches"], weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model folder")
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    weights = float32_bytes(args.model)
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-memory-"))
    launches = []
    for label, engine, stage in ENGINES:
        for ranks in RANKS:
            print(f"{label} x{ranks} ...", flush=True)
            per_rank = run(args.model.resolve(), engine, stage, ranks, work)
            launches.append({"engine": label, "ranks": ranks, "per_rank": per_rank})
    shutil.rmtree(work, ignore_errors=True)
    data = {"model": args.model.name, "float32_bytes": weights, "launches": launches}
    title = "Trainer memory at start-up"
    publish(Record.measured("startup-memory", title, render, data), args.write)


if __name__ == "__main__":
    main()
