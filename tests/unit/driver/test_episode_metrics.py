"""Multi-turn counters become per-episode metrics; a single-turn run logs none."""

from sluice.driver.rollout_metrics import episode_metrics


def test_counters_become_per_episode_metrics():
    counts = {
        "env_steps": 30.0,
        "env_s": 6.0,
        "env_tokens": 400.0,
        "tool_calls": 12.0,
        "episodes_cut": 2.0,
        "tool_errors/bad_call": 3.0,
        "tool_errors/timeout": 1.0,
    }
    assert episode_metrics(counts, 10) == {
        "rollout/episode/turns": 3.0,
        "rollout/episode/env_s_per_turn": 0.2,
        "rollout/episode/env_tokens": 40.0,
        "rollout/episode/tool_calls": 1.2,
        "rollout/episode/cut": 2.0,
        "rollout/episode/tool_errors/bad_call": 3.0,
        "rollout/episode/tool_errors/timeout": 1.0,
    }
    assert episode_metrics({}, 10) == {} and episode_metrics(counts, 0) == {}
