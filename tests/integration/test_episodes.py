"""Multi-turn episodes on the real components.

In-process, on vLLM with a subword (BPE) tokenizer: the tokens a played episode trains on
are, token for token, what vLLM sampled in each turn plus the environment's text encoded
once; re-tokenizing the episode's text would give other tokens, so a runner that did would
fail here. With a chat model, an observation that is a chat message comes after the turn
as the template renders it. The environments' steps run in their own process
(``tests/support/envs.py``). (End to end, with a rollout worker killed while it holds
episodes in flight: ``tests/integration/test_faults.py``.)
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sluice.engines.rollout.scored import played_block
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs.multi_turn import EpisodeLimits
from sluice.envs.scoring import RecordedScorer
from sluice.rl.advantages import Credit
from sluice.storage.schema import validate_batch
from tests.support.envs import OBSERVATION, ChatEcho, Echo, spec
from tests.support.sampled import record_sampled

pytestmark = pytest.mark.integration


def echo_worker(bpe_policy: Path, env=None, seed: int = 0, max_turns: int = 3) -> RolloutWorker:
    engine = partial(
        VLLMRolloutEngine, str(bpe_policy), seed=seed, kv_cache_gib=0.1, max_model_len=512
    )
    limits = EpisodeLimits(max_turns=max_turns, max_turn_tokens=6)
    scorer = partial(RecordedScorer, [])
    env = env or Echo()
    return RolloutWorker(engine, env, scorer, None, None, limits=limits, steps=spec(env))


def test_an_episode_trains_on_exactly_the_sampled_tokens_and_the_environments(
    in_process_vllm, bpe_policy
):
    worker = echo_worker(bpe_policy)
    sampled = record_sampled(worker.engine)
    try:
        played = worker.play(Echo().problems("train", 3, 0), 2, 60, 1.0, seed=5)
    finally:
        worker.episodes.close()  # its step process
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    retokenized_differs = 0
    for group_id, group in played.items():
        for sample in group.samples:
            request = f"{group_id}/{sample.index}"
            turns = [sampled[request], sampled[f"{request}#2"], sampled[f"{request}#4"]]
            observations = [
                tokenizer(OBSERVATION.format(turn=t), add_special_tokens=False)["input_ids"]
                for t in (1, 3)
            ]
            expected = turns[0] + observations[0] + turns[1] + observations[1] + turns[2]
            assert sample.token_ids == expected
            mask = [1] * len(turns[0]) + [0] * len(observations[0]) + [1] * len(turns[1])
            mask += [0] * len(observations[1]) + [1] * len(turns[2])
            assert sample.mask == mask
            assert [lp for lp, m in zip(sample.logprobs, mask, strict=True) if not m] == [0.0] * (
                len(observations[0]) + len(observations[1])
            )
            assert all(lp < 0 for lp, m in zip(sample.logprobs, mask, strict=True) if m)
            text = tokenizer.decode(group.prompt_ids + sample.token_ids, skip_special_tokens=False)
            retokenized_differs += tokenizer(text, add_special_tokens=False)["input_ids"] != (
                group.prompt_ids + sample.token_ids
            )
    assert retokenized_differs > 0  # re-tokenizing would have changed the trained tokens
    block, stats = played_block("echo", played, credit=Credit(scale_by_std=False))
    validate_batch(block)
    assert block.column("loss_mask").to_pylist() == [
        s.mask for g in played.values() for s in g.samples
    ]
    assert stats.correct == 6


def test_a_chat_models_observation_is_the_templates_message_after_the_sampled_turn(
    in_process_vllm, bpe_policy
):
    worker = echo_worker(bpe_policy, ChatEcho(), seed=1, max_turns=2)
    try:
        played = worker.play(ChatEcho().problems("train", 2, 0), 2, 80, 1.0, seed=3)
    finally:
        worker.episodes.close()
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for group in played.values():
        for sample in group.samples:
            assert sample.mask is not None, sample.result
            first = sample.token_ids[: sample.mask.index(0)]
            ending = "\n" if first[-1] == end else "<|im_end|>\n"
            chatml = f"{ending}<|im_start|>user\n{OBSERVATION.format(turn=1).strip()}<|im_end|>\n"
            added = tokenizer(chatml + "<|im_start|>assistant\n", add_special_tokens=False)
            rest = sample.token_ids[len(first) :]
            assert rest[: len(added["input_ids"])] == added["input_ids"]
            assert sample.mask == [1] * len(first) + [0] * len(added["input_ids"]) + [1] * (
                len(rest) - len(added["input_ids"])
            )
