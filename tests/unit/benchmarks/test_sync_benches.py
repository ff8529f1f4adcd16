"""benchmarks/weights.py and benchmarks/adapters.py: the shapes a model folder publishes
and the adapter table."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks import adapters, weights
from benchmarks.adapters import table
from benchmarks.records import Record
from benchmarks.weights import folder_shapes
from tests.support.trainers import make_trainer


def test_a_folders_shapes_are_what_the_trainer_publishes(bpe_policy):
    trainer = make_trainer(
        str(bpe_policy), lr=1e-4, clip_eps=0.2, grad_clip=1.0, micro_batch=4, threads=1, seed=0
    )
    published = {name: list(t.shape) for name, t in trainer.state().items()}
    assert folder_shapes(bpe_policy) == published


def _runs(seconds: float, nbytes: float, load: bool) -> list[dict[str, float]]:
    run = {"publish_s": seconds, "pull_s": seconds, "bytes": nbytes}
    return [{**run, **({"load_s": seconds} if load else {})} for _ in range(3)]


def test_the_adapter_table_gives_each_model_its_sync_and_the_ratio():
    scale = {"full": _runs(1.0, 2**30, False), "adapter": _runs(0.1, 2**20, False)}
    into_vllm = {"full": _runs(0.5, 2**29, True), "adapter": _runs(0.05, 2**20, True)}
    text = table([("1.1B llama, bf16", scale), ("smollm2, fp32, into vLLM", into_vllm)])
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == ["1.1B llama, bf16"] * 3 + [
        "smollm2, fp32, into vLLM"
    ] * 3
    assert "| 2000.00 [2000.00-2000.00] |" in text  # the 1.1B full sync: publish + pull
    assert "| 1500.00 [1500.00-1500.00] |" in text  # the vLLM one adds its load
    assert text.count("| 10.0x |") == 2  # full / adapter, per model
    assert "| 1,024.00 |" in text and "| 512.00 |" in text  # MiB a version


def _record(module, section: str, data: dict) -> Record:
    made = Record.measured(section, "t", module.render, data, ["torch"])
    return replace(made, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_adapter_section_is_rendered_from_its_record():
    data = {
        "repeats": 6,
        "load_before": 0.4,
        "load_after": 1.2,
        "adapter": {"rank": 16, "target_modules": ["q_proj", "v_proj"]},
        "measured": [["1.1B llama, bf16", {"full": _runs(1.0, 2**30, False),
                                            "adapter": _runs(0.1, 2**20, False)}]],
    }  # fmt: skip
    record = _record(adapters, "lora-adapters", data)
    text = record.text()
    first, command = text.splitlines()[:2]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert "median [min-max] of versions 2-6; load average 0.4 before, 1.2 after" in first
    assert "rank 16 on q_proj, v_proj" in first
    assert command == f"Command: `{record.command}`."
    assert "| 10.0x |" in text


def test_the_weights_section_is_rendered_from_its_record():
    run = {"snapshot_s": 0.5, "publish_s": 1.0, "pull_s": 0.5, "memcpy_s": 0.25,
           "pull.puller.RssAnon": 2.5 * 2**30, "pull.puller.RssShmem": 2**30,
           "publish.relay.RssAnon": 0.0, "publish.relay.RssShmem": 2**30,
           "publish.store": 2**30, "pull.store": 2**30}  # fmt: skip
    result = {"runs": [run] * 5, "model_bytes": 2**31, "bucket_bytes": 2**26,
              "params": 1.1e9, "dtype": "bfloat16"}  # fmt: skip
    data = {"repeats": 5, "load_before": 0.1, "load_after": 0.9, "result": result}
    text = _record(weights, "weights-streaming", data).text()
    assert text.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert "5 versions (GB/s: medians of versions 3-5" in text.splitlines()[0]
    gbps = 2**31 / 1e9  # the model's bytes over each step's seconds
    assert f"| pull (into the model's weights) | {gbps / 0.5:.2f} GB/s (0.50 x memcpy) |" in text


@pytest.mark.parametrize(
    ("positions", "expected"), [(256, 256), (8192, 1024)], ids=["tiny", "smollm2"]
)
def test_the_adapter_bench_gives_vllm_a_context_the_model_has(tmp_path, positions, expected):
    """vLLM refuses a context longer than the model's positions (the tiny policy's 256),
    and SmolLM2's own 8,192 would need more KV cache than the bench gives."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    assert adapters.context(tmp_path) == expected
