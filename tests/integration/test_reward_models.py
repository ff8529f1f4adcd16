"""A reward model and a judge served in Ray actors of their own, scored through the
``ModelScorer`` a rollout worker builds: the reward model's scores are the model's own (the
same forward in this process), a call past the timeout or to a dead actor fails its
samples with the reason, and the SmolLM2 folder answers as a judge (``make test-real``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from sluice.config.tree import JudgeConfig, RewardModelConfig
from sluice.engines.cluster.ray_cluster import child_env
from sluice.engines.reward_models.scorer import ModelScorer
from sluice.engines.reward_models.served import launch_served
from sluice.envs import make_env
from tests.support.cli import ROOT
from tests.support.reward_model import build_reward_model

pytestmark = pytest.mark.integration

SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def own_scores(folder, texts: list[str]) -> list[float]:
    """The reward model's sigmoid scores, one text at a time, in this process."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        return [float(torch.sigmoid(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]))
                for t in texts]  # fmt: skip


def test_a_served_reward_model_scores_as_the_model_does(ray_local, reward_model):
    env = make_env("addition")
    problems = env.problems("train", 3, seed=0)
    groups = [["4", "41", "7+"], ["1", "12345"], ["99"]]
    cfg = RewardModelConfig(model=str(reward_model), batch_size=2)  # batches of uneven texts
    served = launch_served(cfg, seed=0, env_vars=child_env())
    try:
        served.wait_loaded()
        scorer = ModelScorer(served, correct_at=0.5, verifier=env)
        results = scorer.score(problems, groups, [[len(c) for c in g] for g in groups])
        texts = [p.prompt + c for p, group in zip(problems, groups, strict=True) for c in group]
        flat = [r for group in results for r in group]
        assert [r.error for r in flat] == [None] * len(texts)
        assert [r.reward for r in flat] == pytest.approx(own_scores(reward_model, texts), abs=1e-5)
        assert [r.correct for r in flat] == [r.reward >= 0.5 for r in flat]
        assert all(set(r.metrics) == {"agrees_with_verifier", "model_s"} for r in flat)
        assert all(r.metrics["model_s"] > 0 for r in flat)  # the model's time, shared

        # A call past the timeout: the group's samples fail with the reason, nothing waits.
        slow = ModelScorer(type(served)(cfg.model_copy(update={"timeout_s": 1e-4}), served.handles))
        (late,) = slow.score(problems[:1], [["4", "5"]], [[1, 1]])
        assert {r.error for r in late} == {
            "the reward model gave no answer within 0.0001 s (reward.*.timeout_s)"
        }

        # An actor gone for good: its groups fail with the reason; the scorer goes on.
        import ray

        ray.kill(served.handles[0], no_restart=True)
        (gone,) = scorer.score(problems[:1], [["4"]], [[1]])
        assert gone[0].reward == 0.0 and gone[0].error.startswith("the reward model failed: ")
    finally:
        served.close()


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_dir(), reason=f"{SMOLLM2} is missing: `make model` writes it")
def test_smollm2_judges_completions(ray_local):
    """The real model as a judge, through vLLM in its own actor: each sample gets a verdict,
    a reward from it, and the comparison with the exact answer."""
    env = make_env("addition")
    problems = env.problems("train", 2, seed=0)
    groups = [[p.answer, "no idea"] for p in problems]
    cfg = JudgeConfig(
        model=str(SMOLLM2),
        prompt="Question: {prompt}\nReply: {completion}\nIs the reply the right answer? "
        "Answer yes or no.",
        max_new_tokens=8,
    )
    served = launch_served(cfg, seed=0, env_vars=child_env())
    try:
        served.wait_loaded()
        scorer = ModelScorer(served, verifier=env)
        results = scorer.score(problems, groups, [[1, 1]] * len(problems))
        flat = [r for group in results for r in group]
        assert all(r.error is None and r.verdict for r in flat), flat
        assert all(r.reward in (0.0, 1.0) for r in flat)
        assert [r.reward for r in flat] == [
            1.0 if r.verdict.strip().lower().startswith("yes") else 0.0 for r in flat
        ]
        assert all(set(r.metrics) == {"agrees_with_verifier", "model_s"} for r in flat)
        assert all(r.metrics["model_s"] > 0 for r in flat)  # the model's time, shared
    finally:
        served.close()
