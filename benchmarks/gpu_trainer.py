"""The trainer at a real size on one GPU: each engine's memory, step time and bf16 step.

A random model of a real shape is generated in bf16 (``--shape``: Qwen2.5-0.5B's by default,
with its 151,936-token vocabulary; ``1.5b`` for Qwen2.5-1.5B's; ``smoke``, a 2-layer model
with the same vocabulary, checks the plumbing on a CPU). Each engine (torch, FSDP2, ZeRO-2,
ZeRO-3) trains it at one rank in bf16 under torchrun (``scripts/train_ranks.py --memory``):
``--steps`` steps on 8 samples of 1,024 tokens (a 128-token prompt, an 896-token
response), then a streamed checkpoint and its resume. Per engine: the GPU's peak allocated
bytes at start-up, in the steps, in the checkpoint and in the resume, against the model's
float32 bytes (AdamW keeps float32 master weights and two float32 moments: start-up holds
1x, a step up to 4x plus activations); the host's resident peak at start-up above its base;
the dtypes the linear layers returned in the steps; the last step's seconds; and the
engine's largest loss gap and its update's gap (a fraction of the update's norm) to the
torch engine's (the first engine run is the reference: include torch in ``--engines``).

Each shape's results go to ``<--results>/<shape>.json``; the section is every shape's there
(``--table-only``: measure nothing). Prints the section; ``--write`` also keeps the record
(``benchmarks/records.py``) and writes the section in BENCHMARKS.md ("The trainer on one
GPU"). On a GPU machine with the project's packages, then on any:

    python -m benchmarks.gpu_trainer --shape 0.5b
    .venv/bin/python -m benchmarks.gpu_trainer --table-only --write
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.bf16_ranks import update_gap
from benchmarks.records import Record, publish
from benchmarks.report import measured_commit
from benchmarks.startup_memory import ENGINES, MIB, float32_bytes, launch
from benchmarks.tables import markdown_table
from sluice.config.tree import TrainConfig
from sluice.engines.train.trainer import MODEL_FILE
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.torch_state import bytes_to_tensors

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_trainer"  # <shape>.json
VOCAB = 151_936
# Qwen2.5's published shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B), tied embeddings.
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
    "smoke": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1},
}  # fmt: skip
PROMPT_TOKENS, RESPONSE_TOKENS, ROWS = 128, 896, 8
SMOKE_TOKENS = 16, 48  # the smoke shape's rows: a CPU's time
PHASES = ("startup", "steps", "checkpoint", "resume")  # train_ranks.py's gpu_<phase>_peak_bytes
SETTINGS = {"lr": 1e-5, "micro_batch": 4, "threads": 4, "loss": "ppo"}


def random_model(shape: str, folder: Path, device: str) -> Path:
    """A Qwen2 model of ``shape``, random (seed 0), saved in bf16 to ``folder``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def long_samples(prompt: int, response: int) -> list[Sample]:
    """``ROWS`` samples of random token ids, half rewarded, half not."""
    rng = random.Random(0)
    return [
        Sample(
            [rng.randrange(3, VOCAB) for _ in range(prompt)],
            [rng.randrange(3, VOCAB) for _ in range(response)],
            [-12.0] * response,
            (-1.0) ** i,
        )
        for i in range(ROWS)
    ]


def measure(shape: str, steps: int, labels: list[str], path: Path, commit: str) -> None:
    """Each engine of ``labels`` in turn, the results so far written to ``path`` after each
    (a run cut short keeps what it measured)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-gpu-"))
    try:
        print(f"generating a {shape} model on {device} ...", flush=True)
        model = random_model(shape, work / "model", device)
        start = {k: v.float() for k, v in _folder_weights(model).items()}
        prompt, response = SMOKE_TOKENS if shape == "smoke" else (PROMPT_TOKENS, RESPONSE_TOKENS)
        rows = long_samples(prompt, response)
        engines: dict[str, dict[str, Any]] = {}
        result = {
            "shape": shape,
            "parameters": sum(t.numel() for t in start.values()),
            "float32_bytes": float32_bytes(model),
            "steps": steps,
            "tokens_per_step": ROWS * (prompt + response),
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "date": f"{datetime.now(UTC):%Y-%m-%d}",
            "commit": commit,
            "engines": engines,
        }
        want: dict[str, torch.Tensor] | None = None
        want_losses: list[float] = []
        for label, engine, stage in [e for e in ENGINES if e[0] in labels]:
            print(f"{label} ...", flush=True)
            # float32 on a CPU: without AVX-512 BF16 its bf16 matmuls are emulated, ~100x slower
            dtype = "bfloat16" if device == "cuda" else "float32"
            train = TrainConfig(**SETTINGS, dtype=dtype, engine=engine, zero_stage=stage)  # type: ignore[arg-type]
            out = launch(model, train, 1, steps, work, "--memory", rows=rows)
            metrics = json.loads((out / "metrics.json").read_text())
            saved = CheckpointStore(out.as_uri()).load_latest()
            assert saved is not None
            saved_weights = bytes_to_tensors(saved.files[MODEL_FILE])
            weights = {name: saved_weights[name] for name in start}  # not the tied copy
            losses = [m["loss"] for m in metrics["steps"]]
            if want is None:  # the torch engine's run is the reference
                want, want_losses = weights, losses
            engines[label] = {
                "memory": json.loads((out / "memory-0.json").read_text()),
                "losses": losses,
                "step_s": metrics["step_s"],
                "linear_dtypes": metrics["linear_dtypes"],
                "loss_gap": max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)),
                "update_gap": update_gap(weights, want, start),
            }
            shutil.rmtree(out, ignore_errors=True)
            path.write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def _gib(n: int | None, weights: int) -> str:
    return "-" if n is None else f"{n / (1024 * MIB):.2f} GiB ({n / weights:.2f}x)"


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        weights = result["float32_bytes"]
        for label, got in result["engines"].items():
            memory = got["memory"]
            host = memory["startup_peak_bytes"] - memory["base_bytes"]
            rows.append(
                [
                    f"{result['shape']} ({weights / (1024 * MIB):.1f} GiB)",
                    label,
                    *(_gib(memory.get(f"gpu_{p}_peak_bytes"), weights) for p in PHASES),
                    f"{host / MIB:,.0f} MB ({host / weights:.2f}x)",
                    ", ".join(d.removeprefix("torch.") for d in got["linear_dtypes"]),
                    f"{got['step_s'][-1]:.2f}",
                    f"{got['loss_gap']:.1e}",
                    f"{got['update_gap']:.3f}",
                ]
            )
    header = [
        "model (float32 weights)",
        "engine",
        *(f"GPU peak, {p}" for p in PHASES),
        "host start-up peak above base",
        "linear layers' outputs",
        "step s",
        "loss gap to torch",
        "update gap to torch",
    ]
    return "\n".join(markdown_table(header, rows))


def shared_commit(runs: list[dict[str, Any]]) -> str | None:
    """The commit every run measured, the record's; None when they differ (the record then
    names the checkout's, each run its own)."""
    commits = {r["commit"] for r in runs}
    return commits.pop() if len(commits) == 1 else None


def render(record: Record) -> str:
    """The section: each shape's run (its date, commit, device and torch), the workload,
    then every shape's engines."""
    results = record.data["runs"]
    runs = "; ".join(
        f"{r['shape']}: {r['date']}, commit {r['commit']}, {r['device']}, torch {r['torch']}"
        for r in results
    )
    intro = (
        f"{record.measured_on()}; `{record.command}`. The shapes' runs (`python -m "
        f"benchmarks.gpu_trainer --shape <shape>` on a GPU machine): {runs}. "
        f"A random model of a Qwen2.5 shape (vocabulary {VOCAB:,}, tied, stored in bf16), "
        f"each engine at one rank in bf16: {results[0]['steps']} steps of "
        f"{results[0]['tokens_per_step']:,} tokens ({ROWS} rows of {PROMPT_TOKENS} + "
        f"{RESPONSE_TOKENS}), then a streamed checkpoint and its resume. GPU peaks are "
        "`torch.cuda.max_memory_allocated` in each phase, against the float32 weights; the "
        "gaps are to the torch engine's per-step losses and its update (a fraction of that "
        "update's norm)."
    )
    return intro + "\n\n" + table(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results' folder")
    labels = [label for label, _, _ in ENGINES]
    parser.add_argument("--engines", nargs="+", choices=labels, default=labels, metavar="LABEL")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    parser.add_argument("--table-only", action="store_true", help="read --results, run nothing")
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    if not args.table_only:
        args.results.mkdir(parents=True, exist_ok=True)
        path = args.results / f"{args.shape}.json"
        measure(args.shape, args.steps, args.engines, path, args.commit or measured_commit())
    found = {p.stem: json.loads(p.read_text()) for p in args.results.glob("*.json")}
    runs = [found[shape] for shape in SHAPES if shape in found]
    title = "The trainer on one GPU"
    record = Record.measured(
        "gpu-trainer", title, render, {"runs": runs}, commit=shared_commit(runs)
    )
    publish(record, args.write)


if __name__ == "__main__":
    main()
