"""The Prefect task of the eval flow (``flows/evaluate.py``): held-out accuracy of a policy."""

from __future__ import annotations

from pathlib import Path

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from sluice.config.tree import RunConfig
from sluice.driver.environment import (
    agent_spec,
    episode_limits,
    eval_tokens,
    make_environment,
    max_model_len,
    plays_episodes,
    scorer_factory,
    step_spec,
)
from sluice.driver.held_out import evaluate
from sluice.engines.cluster.ray_cluster import child_env
from sluice.engines.rollout.worker import launch_rollout_workers
from sluice.engines.train.lora import is_adapter, read_adapter


@task(name="evaluate-policy", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_policy(cfg: RunConfig, policy_dir: str) -> dict[str, float]:
    """Held-out metrics of ``policy_dir`` (a model folder, or a LoRA adapter folder over its
    base) with one vLLM rollout worker: greedy accuracy, and mean@k / pass@k with
    ``eval.k > 1``."""
    env, _ = make_environment(cfg.env, cfg.policy)
    heldout = env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
    model, lora, adapter = policy_dir, None, None
    if is_adapter(Path(policy_dir)):
        (model, lora), adapter = read_adapter(Path(policy_dir)), policy_dir
    (worker,) = launch_rollout_workers(
        cfg.rollout,
        model,
        max_model_len(cfg.policy),
        cfg.seed,
        env,
        None,
        None,
        child_env(),
        count=1,
        limits=episode_limits(cfg.env),
        agent=agent_spec(cfg),
        steps=step_spec(cfg),
        lora=lora,
        adapter=adapter,
    )
    scorer = scorer_factory(env, cfg.reward, cfg.env)()  # here: the worker only generates
    try:
        e = cfg.eval
        tokens = eval_tokens(cfg, heldout)
        return evaluate(
            [worker], scorer, heldout, tokens, e.k, e.temperature, episodes=plays_episodes(cfg)
        )
    finally:
        scorer.close()
        ray.kill(worker.handle)
