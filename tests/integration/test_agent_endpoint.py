"""Agents written against the ``openai`` client (plain, streamed, or two replies a call
going on with the second), or on the OpenAI Agents SDK, LangChain's ``ChatOpenAI`` or
pydantic-ai, play episodes through a rollout worker's chat endpoint, on vLLM with a chat
model (the test BPE folder): the trajectory is exactly the template's rendering of the first
messages, then per call what vLLM sampled and the template's text for the new messages,
tokenized once. An agent that uses another session or never calls fails its episode with
the reason."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sluice.engines.agents.episodes import AgentSpec
from sluice.engines.rollout.scored import played_block
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs import AdditionEnv
from sluice.envs.scoring import RecordedScorer
from sluice.rl.advantages import Credit
from sluice.storage.schema import validate_batch
from tests.support.sampled import record_sampled

pytestmark = pytest.mark.integration
ROOT = str(Path(__file__).parents[2])


def worker_with(agent: str, bpe_policy: Path) -> RolloutWorker:
    engine = partial(
        VLLMRolloutEngine, str(bpe_policy), seed=0, kv_cache_gib=0.1, max_model_len=512
    )
    spec = AgentSpec(f"tests.support.agents:{agent}", {}, 60.0, None, (ROOT,))
    return RolloutWorker(
        engine, AdditionEnv(scratch=False), partial(RecordedScorer, []), None, None, agent=spec
    )


@pytest.mark.parametrize(
    ("agent", "system"),
    [
        ("two_turns", []),
        ("streamed_two_turns", []),
        ("best_of_two", []),
        ("agents_sdk", [{"role": "system", "content": "Add the numbers."}]),
        ("langchain_chat", []),
        ("pydantic_ai_chat", []),
    ],
    ids=[
        "openai-client",
        "openai-client-streamed",
        "openai-client-n2",
        "agents-sdk",
        "langchain",
        "pydantic-ai",
    ],
)
def test_an_openai_client_agent_plays_token_exact_episodes(
    in_process_vllm, bpe_policy, agent, system
):
    worker = worker_with(agent, bpe_policy)
    sampled = record_sampled(worker.engine)
    problems = AdditionEnv(scratch=False).problems("train", 3, seed=0)
    try:
        played = worker.play(problems, 2, 64, 1.0, seed=0)
    finally:
        worker.agents.close()
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    for problem, group in zip(problems, played.values(), strict=True):
        for sample in group.samples:
            assert sample.result is not None and sample.result.error is None, sample.result
            assert sample.result.metrics == {"calls": 2.0}
            first = [*system, {"role": "user", "content": problem.prompt}]
            rendered = tokenizer.apply_chat_template(
                first, add_generation_prompt=True, tokenize=True
            )
            assert sample.prompt_ids == list(rendered["input_ids"])
            calls = sorted(
                (r for r in sampled if sample.token_ids[: len(sampled[r])] == sampled[r]), key=len
            )
            assert calls, "the first call's tokens begin the trajectory"
            one = sampled[calls[0]]
            reply = tokenizer.decode(one, skip_special_tokens=True)
            convo = [
                *first,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "and the answer is"},
            ]
            text = tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
            before = tokenizer.apply_chat_template(
                first, add_generation_prompt=True, tokenize=False
            )
            # After the reply's text: the turn's end, unless the model sampled it, then the
            # new message. (The reply's text leaves out special tokens it sampled anywhere.)
            added_text = text[len(before) + len(reply) :]
            if one[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"):
                added_text = added_text.removeprefix("<|im_end|>")
            added = tokenizer(added_text, add_special_tokens=False)["input_ids"]
            two = sample.token_ids[len(one) + len(added) :]
            assert sample.token_ids == one + added + two
            assert two in sampled.values()
            assert sample.mask == [1] * len(one) + [0] * len(added) + [1] * len(two)
    block, stats = played_block("addition", played, credit=Credit(scale_by_std=False))
    validate_batch(block)
    assert stats.reward_errors == 0


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        ("someone_elses_session", "no open session"),
        ("never_calls", "the agent never called its endpoint"),
    ],
)
def test_an_agent_that_misuses_its_endpoint_fails_its_episode(
    in_process_vllm, bpe_policy, agent, reason
):
    worker = worker_with(agent, bpe_policy)
    problems = AdditionEnv(scratch=False).problems("train", 1, seed=0)
    try:
        played = worker.play(problems, 2, 64, 1.0, seed=0)
    finally:
        worker.agents.close()
    for sample in next(iter(played.values())).samples:
        assert sample.result.error is not None and reason in sample.result.error
    block, stats = played_block("addition", played, credit=Credit(scale_by_std=False))
    validate_batch(block)
    assert stats.reward_errors == 2
