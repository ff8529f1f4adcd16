import pytest

from sluice.config.tree import EnvConfig
from sluice.driver.environment import make_environment
from sluice.envs.prompts import PromptStream


@pytest.mark.parametrize(
    "cfg",
    [EnvConfig(scratch=False), EnvConfig(), EnvConfig(name="countdown"), EnvConfig(long_tail=1.0)],
    ids=["addition", "addition-scratch", "countdown", "long-tail"],
)
def test_make_environment_builds_what_the_config_names(cfg):
    env, signature = make_environment(cfg)
    assert env.name == cfg.name
    assert cfg.name in signature
    (problem,) = env.problems("train", 1, 0)
    assert problem.env == cfg.name


def test_signature_changes_with_the_knobs():
    assert make_environment(EnvConfig())[1] != make_environment(EnvConfig(scratch=False))[1]
    assert make_environment(EnvConfig())[1] != make_environment(EnvConfig(digits=3))[1]


def test_prompt_stream_is_distinct_deterministic_and_cycles():
    env, _ = make_environment(EnvConfig())
    stream = PromptStream(env, pool_size=64, seed=0)
    pool = len(stream._pool)
    first = [p.prompt for p in stream.take(pool)]
    assert len(set(first)) == pool  # no duplicates within an epoch
    assert stream.epoch == 1
    second = [p.prompt for p in stream.take(pool)]
    assert sorted(second) == sorted(first)
    assert stream.epoch == 2
    again = PromptStream(env, pool_size=64, seed=0)
    assert [p.prompt for p in again.take(pool)] == first


def test_problems_whose_prompts_read_the_same_stay_apart():
    """The guessing game's prompt never shows its secret: a stream that kept one problem
    per prompt text would train on one secret and teach the model to say it."""
    env, _ = make_environment(EnvConfig(name="guessing"))
    stream = PromptStream(env, pool_size=256, seed=0)
    secrets = {env.secret(p) for p in stream.take(len(stream._pool))}
    assert len({p.prompt for p in stream._pool}) == 1
    assert len(secrets) == 32  # every secret in 1..32, each once
