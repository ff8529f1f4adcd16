"""verifiers tasksets written with verifiers' own API (``tests/support/verifiers_tasksets``)
train through Sluice: their tasks are the problems, and verifiers' episode of each (its
harness, its rubric) plays against a rollout worker's chat endpoint on vLLM with a chat
model (the test BPE folder). The trajectory starts with exactly the chat template's
rendering of the task's messages, the reward is the rubric's, and a multi-turn harness's
second turn follows the first, token-exact."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sluice.config.tree import VERIFIERS_AGENT
from sluice.engines.agents.episodes import AgentSpec
from sluice.engines.rollout.scored import played_block
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs.scoring import RecordedScorer
from sluice.envs.verifiers_tasksets import VerifiersEnv, task_messages
from sluice.rl.advantages import Credit
from sluice.storage.schema import validate_batch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parents[2]
TASKSETS = ROOT / "tests" / "support" / "verifiers_tasksets"


def play(taskset: str, bpe_policy: Path, monkeypatch) -> tuple[dict, object]:
    monkeypatch.syspath_prepend(str(TASKSETS))  # verifiers imports a taskset by its id
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    env = VerifiersEnv(taskset)
    env.render_prompts(
        lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
    )
    engine = partial(
        VLLMRolloutEngine, str(bpe_policy), seed=0, kv_cache_gib=0.1, max_model_len=512
    )
    spec = AgentSpec(VERIFIERS_AGENT, {"taskset": taskset}, 120.0, None, (str(ROOT), str(TASKSETS)))
    worker = RolloutWorker(engine, env, partial(RecordedScorer, []), None, None, agent=spec)
    problems = env.problems("train", 2, seed=0)
    try:
        played = worker.play(problems, 2, 64, 1.0, seed=0)
    finally:
        worker.agents.close()
    block, stats = played_block(env.name, played, credit=Credit(scale_by_std=False))
    validate_batch(block)
    assert stats.reward_errors == 0
    return played, tokenizer


def test_a_single_turn_taskset_with_a_rubric(in_process_vllm, bpe_policy, monkeypatch):
    played, tokenizer = play("vftest_qa", bpe_policy, monkeypatch)
    for group in played.values():
        task = group.problem.fields["task"]
        first = tokenizer.apply_chat_template(
            task_messages(task), add_generation_prompt=True, tokenize=True
        )
        for sample in group.samples:
            assert sample.result is not None and sample.result.error is None, sample.result
            assert sample.prompt_ids == list(first["input_ids"])
            # the rubric reads verifiers' ``Trace.last_reply``: the reply's text, stripped
            reply = tokenizer.decode(sample.token_ids, skip_special_tokens=True).strip()
            assert sample.result.reward == float(task["answer"] in reply)  # the rubric's
            assert sample.result.metrics["reply_chars"] == float(len(reply))
            assert sample.mask is None or set(sample.mask) == {1}


def test_a_multi_turn_taskset_with_its_own_harness(in_process_vllm, bpe_policy, monkeypatch):
    played, _ = play("vftest_calc", bpe_policy, monkeypatch)
    for group in played.values():
        for sample in group.samples:
            assert sample.result is not None and sample.result.error is None, sample.result
            mask = sample.mask
            assert mask is not None and mask[0] == 1 and 0 in mask
            # two model turns: sampled, the template's text between (masked), sampled
            runs = [m for i, m in enumerate(mask) if i == 0 or mask[i - 1] != m]
            assert runs == [1, 0, 1]
