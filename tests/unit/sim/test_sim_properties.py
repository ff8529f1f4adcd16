"""Invariants of the simulator on long-tail workloads: bounds, conservation, determinism."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.sim.engine import simulate
from sluice.sim.scenario import SKEW_HANDLING_OFF, Scenario, build_scenario


def longtail(
    policy: dict[str, Any], *, seed: int = 0, failures: float = 0.0, steps: int = 25
) -> Scenario:
    """16 groups of 4 per step on 4 engines; 5% of responses 10x the median."""
    return build_scenario(
        {
            "seed": seed,
            "workload": {
                "steps": steps,
                "groups_per_step": 16,
                "samples_per_group": 4,
                "prompt_tokens": 32,
                "lengths": {
                    "kind": "mixture",
                    "median": 100,
                    "sigma": 0.5,
                    "group_sigma": 0.5,
                    "tail_fraction": 0.05,
                    "tail_median": 1500,
                    "max_tokens": 2000,
                },
            },
            "cluster": {
                "rollout_accelerators": 4,
                "train_accelerators": 2,
                "max_concurrency": 32,
                "failure_rate_per_hour": failures,
                "repair_s": 20.0,
            },
            "costs": {
                "decode_step_s": 0.01,
                "decode_per_request_s": 0.0005,
                "prefill_per_token_s": 1e-4,
                "train_step_s": 2.0,
                "train_per_token_s": 1e-4,
                "model_bytes": 1e9,
                "sync_bandwidth_bytes_per_s": 1e10,
                "sync_latency_s": 0.0,
            },
            # each variant switches on its own part of dispatch and repack
            "policy": {**SKEW_HANDLING_OFF, "repack_min_age_s": 0.0, **policy},
        }
    )


ASYNC_VARIANTS = [
    pytest.param({"max_staleness": 0}, id="k0"),
    pytest.param({"max_staleness": 1}, id="k1"),
    pytest.param({"max_staleness": 2, "long_first": True, "balance": True}, id="k2-dispatch"),
    pytest.param({"max_staleness": 2, "partial_rollout": False}, id="k2-no-partial"),
    pytest.param({"max_staleness": 2, "repack": True, "repack_max_stragglers": 4}, id="k2-repack"),
    pytest.param({"max_staleness": 4, "credit_drops": False}, id="k4-no-credit"),
    pytest.param({"max_staleness": 1, "stale_by": "first_token"}, id="k1-first-token"),
    pytest.param({"max_staleness": 2, "weight_check_s": 0.1, "refill_at": 0.25}, id="k2-polling"),
]


@pytest.mark.parametrize("variant", ASYNC_VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_trained_samples_are_never_staler_than_k(variant, seed):
    sc = longtail({"mode": "async", **variant}, seed=seed)
    result = simulate(sc)
    k = sc.policy.max_staleness
    assert result.max_staleness <= k
    if sc.policy.stale_by == "first_token":
        assert result.first_token_lag == result.staleness
    else:  # the first tokens of long samples may be older than their last
        assert max(result.first_token_lag) >= result.max_staleness
    assert result.trained_samples == 25 * 16 * 4
    assert sum(result.staleness.values()) == result.trained_samples


# The rule that drops long samples, so that there are drops to count.
FIRST_TOKEN = {"mode": "async", "stale_by": "first_token"}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_without_credit_at_most_k_batches_are_ever_dropped(k):
    # Without credit a dropped group counts as issued, so drops eat into the
    # (k + 1) * B window for good; once k * B groups are gone the trainer needs every
    # group in flight and none is bypassed (or dropped) again.
    policy = {**FIRST_TOKEN, "max_staleness": k, "credit_drops": False}
    result = simulate(longtail(policy, steps=60))
    assert 0 < result.dropped_samples <= k * 16 * 4


def test_crediting_drops_keeps_the_window_open():
    strict = simulate(
        longtail({**FIRST_TOKEN, "max_staleness": 1, "credit_drops": False}, steps=60)
    )
    credited = simulate(longtail({**FIRST_TOKEN, "max_staleness": 1}, steps=60))
    assert credited.dropped_samples > strict.dropped_samples
    assert credited.samples_per_s > strict.samples_per_s


def test_counting_the_last_token_keeps_the_long_samples_the_first_token_drops():
    first = simulate(longtail({**FIRST_TOKEN, "max_staleness": 1}, steps=60))
    last = simulate(longtail({"mode": "async", "max_staleness": 1}, steps=60))
    assert first.dropped_samples > 0.1 * first.generated_samples
    assert last.dropped_samples <= 0.1 * last.generated_samples
    assert last.samples_per_s >= first.samples_per_s


POLICIES = [
    pytest.param({"mode": "sync"}, id="sync"),
    pytest.param({"mode": "one_step"}, id="one_step"),
    pytest.param({"mode": "async", "max_staleness": 2}, id="async-k2"),
    pytest.param(
        {"mode": "async", "max_staleness": 2, "long_first": True, "balance": True, "repack": True},
        id="async-k2-dispatch-repack",
    ),
    pytest.param({"mode": "async", "max_staleness": 1, "partial_rollout": False}, id="async-k1-np"),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_failures_requeue_work_without_losing_or_duplicating_samples(policy):
    # About two failures per engine every minute, 20 s to repair: dozens of failures.
    result = simulate(longtail(policy, failures=120.0))
    assert result.failures > 10
    assert result.requeued_samples > 0
    # Every issued sample finished exactly once or is still running; none vanished.
    assert result.issued_samples == result.generated_samples + result.in_flight_samples
    assert result.trained_samples == 25 * 16 * 4
    assert result.generated_samples >= result.trained_samples + result.dropped_samples


@pytest.mark.parametrize("policy", POLICIES)
def test_without_failures_every_issued_sample_is_accounted_for(policy):
    result = simulate(longtail(policy))
    assert result.failures == result.requeued_samples == 0
    assert result.issued_samples == result.generated_samples + result.in_flight_samples
    if policy["mode"] != "async":  # batch modes generate exactly what they train
        assert result.generated_samples == result.trained_samples == result.issued_samples


def test_failures_slow_sync_down():
    healthy = simulate(longtail({"mode": "sync"}))
    failing = simulate(longtail({"mode": "sync"}, failures=60.0))
    assert failing.wall_s > healthy.wall_s


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_result(policy):
    assert simulate(longtail(policy, failures=30.0)) == simulate(longtail(policy, failures=30.0))


def test_another_seed_another_result():
    a = simulate(longtail({"mode": "async", "max_staleness": 2}, seed=0))
    b = simulate(longtail({"mode": "async", "max_staleness": 2}, seed=1))
    assert a.step_end_s != b.step_end_s


def test_every_policy_sees_the_same_responses():
    # Common random numbers: group g has the same lengths whatever the policy, so the
    # batch modes (which train groups 0..steps*B-1) train the same tokens.
    sync = simulate(longtail({"mode": "sync"}))
    one_step = simulate(longtail({"mode": "one_step", "long_first": True, "balance": True}))
    assert sync.trained_tokens == one_step.trained_tokens


def test_rollout_and_trainer_idle_are_fractions():
    for policy in ({"mode": "sync"}, {"mode": "async", "max_staleness": 2}):
        result = simulate(longtail(policy))
        assert 0.0 <= result.rollout_idle <= 1.0
        assert 0.0 <= result.trainer_idle <= 1.0
