"""The trainer's peak memory and step time at real vocabularies, logits whole against chunked.

Two models: SmolLM2-135M-Instruct (vocabulary 49,152; ``make model`` writes its folder) and
a generated 2-layer llama with Qwen2.5's vocabulary (151,936) and Qwen2.5-0.5B's width.
Each micro-batch of 1,024, 4,096 and 8,192 tokens (rows of a 128-token prompt and an
896-token response) is trained by the torch engine with the logits computed:

- **whole**: as the trainer did before ``train.logits_chunk_tokens`` (the model's logits at
  every position, log-softmax over all of them, the entropy in the graph);
- **chunked**: as it does now (the response positions only, 1,024 tokens at a time, the
  backward recomputing each chunk; the entropy a metric).

Each setting runs in its own process, under a 20 GiB address-space limit (a setting that
needs more reports "out of memory" instead of taking the machine): one step allocates the
optimiser's state, the peak resident memory is reset (``/proc/self/clear_refs``), and the
next steps give the peak above that baseline and the median step time. Prints the section;
``--write`` also keeps the record (``benchmarks/records.py``) and writes the section in
BENCHMARKS.md.

    .venv/bin/python -m benchmarks.vocab --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_meter import resident_bytes
from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key

ROOT = Path(__file__).parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
TOKENS = (1024, 4096, 8192)
PROMPT, RESPONSE = 128, 896
VARIANTS = ("whole", "chunked")
LIMIT_BYTES = 20 << 30
GIB = 1 << 30


def qwen_vocab_model(folder: Path) -> Path:
    """A 2-layer llama at Qwen2.5-0.5B's width with its vocabulary, random, tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    config = LlamaConfig(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def whole_logits_forward(trainer, batch):  # type: ignore[no-untyped-def]
    """The trainer's forward pass before chunking, verbatim in what it holds: logits of
    every position in float32, log-softmax over all of them, the entropy's graph kept."""
    from sluice.engines.train.trainer import Passed, model_inputs

    out = trainer._network(**model_inputs(batch))
    logits = out.logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return Passed(chosen, entropy, None)


def measure_one(model: Path, tokens: int, variant: str, steps: int) -> dict[str, Any]:
    """One setting, in this process: peak bytes above the post-warm-up baseline, and the
    seconds of each timed step."""
    from sluice.config.tree import TrainConfig
    from sluice.engines.train.trainer import build_engine
    from sluice.rl.batching import Sample, collate

    train = TrainConfig(lr=1e-5, micro_batch=64, threads=2, micro_batch_tokens=tokens)
    trainer = build_engine(train, str(model), seed=0)
    if variant == "whole":
        trainer._forward = lambda batch: whole_logits_forward(trainer, batch)  # type: ignore[method-assign]
    vocab = int(trainer.model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    rows = tokens // (PROMPT + RESPONSE)
    samples = [
        Sample(
            torch.randint(vocab, (PROMPT,), generator=gen).tolist(),
            torch.randint(vocab, (RESPONSE,), generator=gen).tolist(),
            [-5.0] * RESPONSE,
            1.0 if i % 2 else -1.0,
        )
        for i in range(rows)
    ]
    # AdamW's state is allocated by the first step.
    trainer.step_batch(collate(samples, trainer.pad_id))
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    base = resident_bytes("VmRSS")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step_batch(collate(samples, trainer.pad_id))
        times.append(time.perf_counter() - start)
    return {"peak_bytes": resident_bytes("VmHWM") - base, "step_s": times}


def run_setting(model: Path, tokens: int, variant: str, steps: int) -> dict[str, Any] | None:
    """``measure_one`` in a child under the address-space limit; None when it ran out."""
    code = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_BYTES}, {LIMIT_BYTES}))\n"
        "from benchmarks.vocab import measure_one\n"
        f"print(json.dumps(measure_one(__import__('pathlib').Path({str(model)!r}), "
        f"{tokens}, {variant!r}, {steps})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        if "memory" in done.stderr.lower() or "alloc" in done.stderr.lower():
            return None
        raise RuntimeError(f"{model.name} {tokens} {variant}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(settings: list[dict[str, Any]]) -> list[list[str]]:
    """Per model and micro-batch size: one logits tensor's size, the peak and median step of
    whole beside chunked ("out of memory" where a setting ran out), chunked over whole."""
    results = {(s["model"], s["tokens"], s["variant"]): s["result"] for s in settings}
    rows = []
    for (name, tokens, variant), r in results.items():
        if variant != "chunked":
            continue
        whole = results.get((name, tokens, "whole"))
        vocab = 49_152 if name.startswith("SmolLM2") else 151_936
        logits_gib = tokens * vocab * 4 / GIB
        cells = [name, f"{tokens:,}", f"{logits_gib:.2f}"]
        for x in (whole, r):
            cells.append("out of memory" if x is None else f"{x['peak_bytes'] / GIB:.2f}")
        whole_s, chunked_s = (
            None if x is None else statistics.median(x["step_s"]) for x in (whole, r)
        )
        cells.extend("-" if x is None else f"{x:.1f}" for x in (whole_s, chunked_s))
        cells.append("-" if whole_s is None or chunked_s is None else f"{chunked_s / whole_s:.2f}")
        rows.append(cells)
    return rows


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each model's and micro-batch size's
    peaks in GiB (``qwen2-5-vocabulary-2-layers.4096.whole``: "out of memory" where it ran
    out) and the range of chunked over whole step time."""
    out, ratios = {}, []
    for row in table(record.data["settings"]):
        name, tokens, _, whole, chunked, *_, ratio = row
        key = f"{quote_key(name)}.{tokens.replace(',', '')}"
        out |= {f"{key}.whole": whole, f"{key}.chunked": chunked}
        if ratio != "-":
            ratios.append(float(ratio))
    out["chunked-over-whole"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    return out


def render(record: Record) -> str:
    """The section: the settings, then each model and micro-batch, whole against chunked."""
    header = [
        "model",
        "micro-batch tokens",
        "one logits tensor (GiB)",
        "peak, whole (GiB)",
        "peak, chunked (GiB)",
        "step s, whole",
        "step s, chunked",
        "chunked / whole",
    ]
    intro = (
        f"{record.measured_on()}, {record.machine['cpu']}; `{record.command}`. 2 torch "
        f"threads, {record.data['steps']} timed steps per setting after one warm-up, each "
        "setting in its own process under a 20 GiB address-space limit. Peak: resident memory "
        "above the process's after the warm-up step (model, gradients and AdamW state "
        "excluded)."
    )
    return "\n".join([intro, "", *markdown_table(header, table(record.data["settings"]))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    if not SMOLLM2.is_dir():
        raise SystemExit(f"{SMOLLM2} is missing: `make model` writes it")
    settings = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "SmolLM2-135M": SMOLLM2,
            "Qwen2.5 vocabulary, 2 layers": qwen_vocab_model(Path(tmp) / "qwen-vocab"),
        }
        for name, folder in models.items():
            for tokens in args.tokens:
                for variant in VARIANTS:
                    r = run_setting(folder, tokens, variant, args.steps)
                    settings.append(
                        {"model": name, "tokens": tokens, "variant": variant, "result": r}
                    )
                    print(name, tokens, variant, r, flush=True)
    data = {"steps": args.steps, "settings": settings}
    title = "Logits memory at real vocabularies"
    record = Record.measured("vocab-memory", title, render, data, ["torch", "transformers"])
    publish(record, args.write)


if __name__ == "__main__":
    main()
