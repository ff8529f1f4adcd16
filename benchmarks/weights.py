"""Weights that stream: the memory and the speed of one publish and one pull of a model.

In one Ray session (a local instance of its own), a publisher actor holds a llama model's
state dict in float32 with random weights (the shapes from transformers' ``LlamaConfig``,
about 1.1B parameters by default, TinyLlama's; nothing is downloaded) and publishes it
through a parameter service whose wire dtype is bfloat16, the rollout dtype. A puller
actor holds the model's own weights in bfloat16, as a vLLM worker does, and pulls each
version into them tensor by tensor (``ParameterService.pull``, then ``copy_``: what
vLLM's ``reload_weights`` does with the iterator). Per version the driver times:

- publish: from ``publish`` until relay 0 has committed the version (``flush``): the
  snapshot (the cast to bfloat16 while copying), the puts and the relay's copy;
- pull: from ``pull`` until the last tensor is in the puller's weights;
- memcpy: a plain numpy copy of the same number of bytes in the puller's process.

and samples, every few milliseconds, ``/proc/<pid>/status`` of the puller and of relay 0:
private memory (``RssAnon``) and mapped object-store pages (``RssShmem``, which Ray's
object store counts once for the node), above each process's baseline: for the puller,
the process before it allocated the model, so the model's own weights are in its figure;
and the object store's bytes in use. Ray frees an object's memory in batches every
``free_objects_period_milliseconds`` (1 s by default): the session sets it with
``--free-period-ms`` (default 10 ms), so the object store shows what the service holds,
not what Ray has yet to free.

``--model DIR`` takes the shapes from a model folder's config.json instead (for
SmolLM2-135M-Instruct, the tied embedding published under both of its names, as Sluice's
trainer publishes it), into a section of its own.

Prints the section and a JSON line of the numbers; ``--write`` also keeps the record
(``benchmarks/records.py``) and writes the section "Weights that stream" of BENCHMARKS.md.

    .venv/bin/python -m benchmarks.weights --write
    .venv/bin/python -m benchmarks.weights --model models/smollm2-135m-instruct --write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table
from sluice.storage.params import ParameterService

GB = 1e9
MIB = 1 << 20
# How long the driver waits for one publish or one pull of the whole model.
STEP_TIMEOUT_S = 300.0
# Sampling period of the memory readers: a pull of a 64 MiB bucket takes ~30 ms.
SAMPLE_S = 0.003
# Longest a pull waits for Ray to free the version the relay dropped before it is measured.
SETTLE_S = 10.0
# The first versions write memory never touched before (the staging buffer, then each of
# the two areas of the object store that versions alternate between): their page faults
# are reported apart (first publish, first pull), not in the medians.
WARMUP = 2
# The plain copy beside a pull moves the model's bytes through buffers of this size.
MEMCPY_CHUNK = 256 * MIB
# TinyLlama-1.1B's shape: a llama of about 1.1B parameters.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}


def llama_shapes(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, list[int]]:
    """The state dict's names and shapes of a llama (transformers' own modules, on meta)."""
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 8),
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    return config_shapes(config)


def folder_shapes(folder: Path) -> dict[str, list[int]]:
    """The state dict's names and shapes of a model folder's architecture (its config.json):
    what Sluice's trainer publishes for it, a tied embedding under both names."""
    from transformers import AutoConfig

    return config_shapes(AutoConfig.from_pretrained(folder))


def config_shapes(config: Any) -> dict[str, list[int]]:
    """The state dict's names and shapes of a transformers model config, built on meta."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def memory(pid: int) -> dict[str, int]:
    """RssAnon and RssShmem of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def store_bytes() -> int:
    """Bytes in use in the object store of this (one-node) session."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)


class Peaks:
    """Samples the memory of some processes (and the object store) in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak: dict[str, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        now = {"store": store_bytes()}
        for who, pid in self.pids.items():
            for key, value in memory(pid).items():
                now[f"{who}.{key}"] = value
        for key, value in now.items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def _run(self) -> None:
        while not self._done.is_set():
            self._sample()
            time.sleep(SAMPLE_S)


@ray.remote(num_cpus=0)
class _Publisher:
    def __init__(self, service: ParameterService, shapes: dict[str, list[int]]) -> None:
        gen = torch.Generator().manual_seed(0)
        self._state = {
            name: torch.empty(shape).uniform_(-0.02, 0.02, generator=gen)
            for name, shape in shapes.items()
        }
        self._service = service

    def publish(self, version: int) -> tuple[float, float]:
        """Seconds until the snapshot is copied, and until relay 0 has the version."""
        start = time.perf_counter()
        self._service.publish(version, self._state)
        self._service.wait_snapshot(timeout=STEP_TIMEOUT_S)
        snapshot_s = time.perf_counter() - start
        self._service.flush(timeout=STEP_TIMEOUT_S)
        return snapshot_s, time.perf_counter() - start


@ray.remote(num_cpus=0)
class _Puller:
    """A rollout worker's share of a pull: the model's weights, loaded from the service."""

    def __init__(self, service: ParameterService) -> None:
        self._service = service
        self._model: dict[str, torch.Tensor] = {}

    def pid(self) -> int:
        return os.getpid()

    def allocate(self, shapes: dict[str, list[int]], dtype: str) -> None:
        """The model's own weights, resident (as an engine's are)."""
        self._model = {n: torch.zeros(s, dtype=getattr(torch, dtype)) for n, s in shapes.items()}

    def pull(self, after: int) -> tuple[int, float]:
        start = time.perf_counter()
        weights = self._service.pull(after, timeout=STEP_TIMEOUT_S)
        if weights is None:
            raise RuntimeError(f"nothing newer than version {after} to pull")
        with torch.no_grad():
            for name, tensor in weights:
                self._model[name].copy_(tensor)
        return weights.version, time.perf_counter() - start

    def memcpy(self, nbytes: int) -> float:
        """Seconds of a plain copy of ``nbytes``, in chunks of ``MEMCPY_CHUNK`` bytes between
        two resident numpy arrays (far larger than the caches)."""
        src = np.ones(min(nbytes, MEMCPY_CHUNK), dtype=np.uint8)
        dst = np.zeros_like(src)
        chunks, rest = divmod(nbytes, src.nbytes)
        start = time.perf_counter()
        for _ in range(chunks):
            np.copyto(dst, src)
        np.copyto(dst[:rest], src[:rest])
        return time.perf_counter() - start


def settle(limit: int, timeout: float = SETTLE_S) -> None:
    """Until the object store holds at most ``limit`` bytes, or ``timeout`` seconds; what
    it still holds then shows in the next peak."""
    deadline = time.monotonic() + timeout
    while store_bytes() > limit and time.monotonic() < deadline:
        time.sleep(SAMPLE_S)


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def measure(
    shapes: dict[str, list[int]], bucket_bytes: int, dtype: str, repeats: int
) -> dict[str, Any]:
    """Publish and pull ``repeats`` versions; needs a running one-node Ray session."""
    wire = getattr(torch, dtype)
    model_bytes = sum(int(np.prod(s)) * wire.itemsize for s in shapes.values())
    service = ParameterService.create(relays=1, bucket_bytes=bucket_bytes, dtype=dtype)
    puller = _Puller.remote(service)  # type: ignore[attr-defined]
    pids = {"puller": ray.get(puller.pid.remote(), timeout=30), "relay": _pid(service.relays[0])}
    base = {f"{who}.{k}": v for who, pid in pids.items() for k, v in memory(pid).items()}
    base["store"] = store_bytes()
    ray.get(puller.allocate.remote(shapes, dtype), timeout=STEP_TIMEOUT_S)
    publisher = _Publisher.remote(service, shapes)  # type: ignore[attr-defined]
    ray.get(publisher.__ray_ready__.remote(), timeout=STEP_TIMEOUT_S)
    runs = []
    for version in range(1, repeats + 1):
        with Peaks(pids) as publishing:
            snapshot_s, publish_s = ray.get(
                publisher.publish.remote(version), timeout=STEP_TIMEOUT_S
            )
        # Ray frees the version the relay dropped some time after its last reference goes
        # (later on a loaded machine): the pull's peak is to show the pull, not that.
        settle(base["store"] + int(1.01 * model_bytes))
        with Peaks(pids) as pulling:
            pulled, pull_s = ray.get(puller.pull.remote(version - 1), timeout=STEP_TIMEOUT_S)
        if pulled != version:
            raise RuntimeError(f"pulled version {pulled}, expected {version}")
        memcpy_s = ray.get(puller.memcpy.remote(model_bytes), timeout=STEP_TIMEOUT_S)
        grown = {
            "publish": {k: v - base[k] for k, v in publishing.peak.items()},
            "pull": {k: v - base[k] for k, v in pulling.peak.items()},
        }
        runs.append(
            {
                "version": version,
                "snapshot_s": snapshot_s,
                "publish_s": publish_s,
                "pull_s": pull_s,
                "memcpy_s": memcpy_s,
            }
            | {f"{phase}.{k}": v for phase, peaks in grown.items() for k, v in peaks.items()}
        )
        print(
            f"version {version}: publish {model_bytes / publish_s / GB:.2f} GB/s, pull "
            f"{model_bytes / pull_s / GB:.2f} GB/s, memcpy {model_bytes / memcpy_s / GB:.2f} GB/s",
            flush=True,
        )
    for actor in (publisher, puller):
        ray.kill(actor)
    service.shutdown()
    return {
        "params": sum(int(np.prod(s)) for s in shapes.values()),
        "model_bytes": model_bytes,
        "bucket_bytes": bucket_bytes,
        "dtype": dtype,
        "runs": runs,
    }


def summary(result: dict[str, Any]) -> dict[str, float]:
    """Medians over versions (GB/s) and peaks over versions (in model and bucket units)."""
    runs, model, bucket = result["runs"], result["model_bytes"], result["bucket_bytes"]
    warm = runs[WARMUP:] or runs

    def peak(key: str) -> int:
        return max(run[key] for run in runs)

    def gbps(key: str, of: list[dict[str, Any]]) -> float:
        return statistics.median(model / r[key] / GB for r in of)

    return {
        "snapshot_gbps": gbps("snapshot_s", warm),
        "publish_gbps": gbps("publish_s", warm),
        "pull_gbps": gbps("pull_s", warm),
        "memcpy_gbps": gbps("memcpy_s", warm),
        "first_publish_gbps": gbps("publish_s", runs[:1]),
        "first_pull_gbps": gbps("pull_s", runs[:1]),
        # The puller's private memory during a pull, over the process before the model:
        # the model's own weights plus what the pull adds, in buckets.
        "pull_private_over_model_buckets": (peak("pull.puller.RssAnon") - model) / bucket,
        "pull_shared_models": peak("pull.puller.RssShmem") / model,
        "relay_private_buckets": max(peak("publish.relay.RssAnon"), 0) / bucket,
        "relay_shared_models": peak("publish.relay.RssShmem") / model,
        # The object store during the first publish (nothing older held) and any later one.
        "store_first_publish_models": runs[0]["publish.store"] / model,
        "store_publish_models": peak("publish.store") / model,
        "store_pull_models": peak("pull.store") / model,
    }


def table(result: dict[str, Any], s: dict[str, float]) -> str:
    model, bucket = result["model_bytes"] / GB, result["bucket_bytes"] / MIB
    header = ["what", "measured", "target"]
    rows = [
        ["model", f"{result['params'] / 1e9:.2f}B params, {model:.2f} GB in {result['dtype']}",
         ""],
        ["bucket", f"{bucket:.0f} MiB", ""],
        ["snapshot (float32 read, cast, bfloat16 written)", f"{s['snapshot_gbps']:.2f} GB/s",
         ""],
        ["publish (snapshot, puts, relay copy, until relay 0 has it)",
         f"{s['publish_gbps']:.2f} GB/s ({s['publish_gbps'] / s['memcpy_gbps']:.2f} x memcpy)",
         ""],
        ["pull (into the model's weights)",
         f"{s['pull_gbps']:.2f} GB/s ({s['pull_gbps'] / s['memcpy_gbps']:.2f} x memcpy)", ""],
        ["plain memcpy of the same bytes", f"{s['memcpy_gbps']:.2f} GB/s", ""],
        ["first publish / first pull (fresh pages)",
         f"{s['first_publish_gbps']:.2f} / {s['first_pull_gbps']:.2f} GB/s", ""],
        ["puller private memory during a pull, beyond the model",
         f"{s['pull_private_over_model_buckets']:.2f} buckets", "<= 1.25 buckets"],
        ["puller object-store pages mapped during a pull",
         f"{s['pull_shared_models']:.2f} x model", "(shared: the relay's copy)"],
        ["relay private memory", f"{s['relay_private_buckets']:.2f} buckets", ""],
        ["relay object-store pages mapped", f"{s['relay_shared_models']:.2f} x model", ""],
        ["object store, first publish", f"{s['store_first_publish_models']:.2f} x model",
         "<= 1 model + 1 bucket"],
        ["object store, later publishes", f"{s['store_publish_models']:.2f} x model",
         "(the version served stays until the next is complete)"],
    ]  # fmt: skip
    return "\n".join(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=LLAMA_1B["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=LLAMA_1B["intermediate_size"])
    parser.add_argument("--vocab", type=int, default=LLAMA_1B["vocab_size"])
    parser.add_argument(
        "--model", type=Path, help="a model folder whose shapes to use instead (its config.json)"
    )
    parser.add_argument("--free-period-ms", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    shapes = (
        folder_shapes(args.model)
        if args.model
        else llama_shapes(args.layers, args.hidden, args.intermediate, args.vocab)
    )
    params = sum(int(np.prod(s)) for s in shapes.values())
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        # The publisher's float32 state lives in its process; the store holds bf16 copies.
        object_store_memory=max(3 * params * getattr(torch, args.dtype).itemsize, 256 * MIB),
        _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
        _system_config={"free_objects_period_milliseconds": args.free_period_ms},
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        result = measure(shapes, args.bucket_mib * MIB, args.dtype, args.repeats)
    finally:
        ray.shutdown()
    data = {
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "result": result,
    }
    line = json.dumps(result | {"summary": summary(result)})
    if args.json:
        args.json.write_text(line)
    key, title = "weights-streaming", "Weights that stream"
    if args.model:
        key, title = f"{key}-{args.model.name}", f"{title}: {args.model.name}"
    publish(Record.measured(key, title, render, data, ["torch", "ray"]), args.write)
    print(line)


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): the table's rates and memory."""
    s, bucket = summary(record.data["result"]), record.data["result"]["bucket_bytes"]
    return {
        "publish": f"{s['publish_gbps']:.2f} GB/s",
        "pull": f"{s['pull_gbps']:.2f} GB/s",
        "pull-over-memcpy": f"{s['pull_gbps'] / s['memcpy_gbps']:.2f}x",
        "relay-private-mb": f"{s['relay_private_buckets'] * bucket / 1e6:.1f}",
        "pull-private-buckets": f"{s['pull_private_over_model_buckets']:.2f}",
        "store-first-publish": f"{s['store_first_publish_models']:.2f}x",
        "store-later-publish": f"{s['store_publish_models']:.2f}x",
    }


def render(record: Record) -> str:
    """The section: how the versions were timed, then the table of their summary."""
    data = record.data
    result, repeats = data["result"], data["repeats"]
    return (
        f"{record.measured_on()}; {repeats} versions (GB/s: medians of versions "
        f"{WARMUP + 1}-{repeats}; memory: peaks over all); load average "
        f"{data['load_before']:.1f} before, {data['load_after']:.1f} after.\n"
        f"Command: `{record.command}`.\n\n" + table(result, summary(result))
    )


if __name__ == "__main__":
    main()
