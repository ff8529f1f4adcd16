"""Weights a trainer publishes, pulled by a live rollout worker (vLLM), make the worker's
log-probs match the trainer's model: the parameter service path a run takes."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sluice.config.tree import RolloutConfig
from sluice.engines.rollout.worker import launch_rollout_workers
from sluice.envs import make_env
from sluice.rl.batching import Sample
from sluice.storage.params import ParameterService
from tests.support.trainers import make_trainer, step

pytestmark = pytest.mark.integration

PROMPTS = ["12+34=", "7+85=", "3 5 7>22:", "99+1="]


def _samples(prompt_ids, groups, advantages):
    return [
        Sample(ids, c.token_ids, c.logprobs, adv)
        for ids, group, adv in zip(prompt_ids, groups, advantages, strict=True)
        for c in group
    ]


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(
        abs(x - y)
        for row_a, row_b in zip(a, b, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
    )


# vLLM and the trainer both in bfloat16 differ by up to a few 1e-2 in a log-prob on this
# policy (bf16 rounding on each side: ENVIRONMENT.md, bf16); in float32 by under 1e-6.
@pytest.mark.parametrize(
    "dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.05)], ids=["float32", "bfloat16"]
)
def test_weight_push_matches_trainer_logprobs(ray_local, tiny_policy, dtype, tolerance):
    _push_and_compare(ray_local, tiny_policy, PROMPTS, dtype, tolerance)


def test_a_bpe_chat_model_folder_pushes_and_matches_the_trainer(ray_local, bpe_policy):
    """A model folder of the kind users bring: a subword tokenizer, prompts rendered by its
    chat template (the prompt ids vLLM generates from are the tokenizer's, no BOS added
    twice), and end-of-turn as EOS from its generation config."""
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"what is {a}+{b}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in ((12, 34), (7, 85), (99, 1))
    ]
    _push_and_compare(ray_local, bpe_policy, prompts, "float32", 1e-4)


def _push_and_compare(ray, policy, prompts, dtype, tolerance):
    # The weights travel in the engine's dtype: the cast happens in the trainer's snapshot.
    params = ParameterService.create(relays=1, bucket_bytes=256 << 10, dtype=dtype)
    (worker,) = launch_rollout_workers(
        RolloutConfig(kv_cache_gib=0.25, dtype=dtype),
        str(policy),
        max_model_len=128,
        seed=0,
        env=make_env("addition"),
        store=None,
        params=params,
        env_vars={},
        count=1,
    )
    trainer = make_trainer(
        str(policy),
        lr=5e-2,
        clip_eps=0.2,
        grad_clip=10.0,
        micro_batch=64,
        threads=1,
        seed=0,
        dtype=dtype,  # bfloat16: the trainer's forward passes in bf16 autocast too
    )
    tokenizer = AutoTokenizer.from_pretrained(str(policy))  # what vLLM's prompts encode to
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    groups = ray.get(worker.generate(prompts, 2, 8, 1.0, 0))
    before = _samples(prompt_ids, groups, [(-1.0) ** i for i in range(len(prompts))])
    # The same weights on both sides: vLLM's behaviour log-probs equal the trainer's.
    assert _max_gap([s.behaviour_logprobs for s in before], trainer.logprobs(before)) < tolerance

    # Steps move the trainer's log-probs well away from what vLLM still serves.
    while (
        _max_gap([s.behaviour_logprobs for s in before], trainer.logprobs(before)) < 4 * tolerance
    ):
        assert trainer.version() < 10, "ten steps did not move the policy"
        step(trainer, before)

    params.publish(trainer.version(), trainer.state())
    assert ray.get(worker.sync_weights(trainer.version(), 60.0)).version == trainer.version()
    groups = ray.get(worker.generate(prompts, 2, 8, 1.0, 1))
    after = _samples(prompt_ids, groups, [0.0] * len(prompts))
    gap = _max_gap([s.behaviour_logprobs for s in after], trainer.logprobs(after))
    assert gap < tolerance, f"vLLM and trainer log-probs differ by {gap:.2e} after the push"
    ray.kill(worker.handle)
    params.shutdown()
