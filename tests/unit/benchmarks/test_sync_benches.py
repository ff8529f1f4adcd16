"""benchmarks/weights.py and benchmarks/adapters.py: the shapes a model folder publishes
and the adapter table."""

from __future__ import annotations

from benchmarks.adapters import table
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
