"""The simulator against answers worked out by hand.

Costs are chosen so every quantity is a short sum: a decode step costs a + b * n for n
running requests, training costs a fixed time, weights load in a fixed time.
"""

from __future__ import annotations

from typing import Any

import pytest

from sluice.sim.engine import simulate
from sluice.sim.scenario import SKEW_HANDLING_OFF, Scenario, build_scenario


def scenario(
    *,
    lengths: dict[str, Any],
    policy: dict[str, Any],
    steps: int = 12,
    groups: int = 8,
    group_size: int = 4,
    engines: int = 2,
    concurrency: int = 16,
    costs: dict[str, Any] | None = None,
    warmup: int = 2,
    prompt: int = 0,
    cluster: dict[str, Any] | None = None,
) -> Scenario:
    return build_scenario(
        {
            "workload": {
                "steps": steps,
                "groups_per_step": groups,
                "samples_per_group": group_size,
                "prompt_tokens": prompt,
                "warmup_steps": warmup,
                "lengths": lengths,
            },
            "cluster": cluster
            or {
                "rollout_accelerators": engines,
                "train_accelerators": 1,
                "max_concurrency": concurrency,
            },
            "costs": {  # nothing but decode and a fixed training step unless a test adds it
                "decode_step_s": 0.01,
                "decode_per_request_s": 0.001,
                "prefill_per_token_s": 0.0,
                "train_step_s": 1.0,
                "train_per_token_s": 0.0,
                "model_bytes": 0.0,
                "sync_latency_s": 0.0,
                **(costs or {}),
            },
            # Dispatch and repack (on in a run by default) only where a test turns them on,
            # and then a straggler moves at any age.
            "policy": {**SKEW_HANDLING_OFF, "repack_min_age_s": 0.0, **policy},
        }
    )


EQUAL = {"kind": "constant", "median": 100}


def test_sync_step_is_generation_plus_train_plus_weight_load():
    # 8 groups x 4 samples over 2 engines: 16 running per engine, all 100 tokens long.
    # Prefill: 4 groups per engine x 50 prompt tokens x 1 ms; one generate call returns
    # 0.2 s after its last token; publishing takes 0.05 s and the pull 2 GB / 1 GB/s + 0.1 s.
    costs = {
        "prefill_per_token_s": 0.001,
        "batch_overhead_s": 0.2,
        "train_per_token_s": 1e-4,
        "publish_s": 0.05,
        "model_bytes": 2e9,
        "sync_bandwidth_bytes_per_s": 1e9,
        "sync_latency_s": 0.1,
    }
    result = simulate(scenario(lengths=EQUAL, policy={"mode": "sync"}, costs=costs, prompt=50))
    generation = 4 * 50 * 0.001 + 100 * (0.01 + 16 * 0.001) + 0.2
    training = 1.0 + 1e-4 * (32 * 100 + 32 * 50) + 0.05
    load = 2.0 + 0.1
    assert result.steady_step_s == pytest.approx(generation + training + load, rel=1e-9)
    assert result.wall_s == pytest.approx(12 * (generation + training + load), rel=1e-9)
    assert result.trainer_idle == pytest.approx(1 - training / (generation + training + load))


@pytest.mark.parametrize(
    ("train_s", "k"),
    [(0.5, 1), (0.5, 2), (2.6, 1), (2.6, 4), (4.0, 2)],
    ids=["gen-bound-k1", "gen-bound-k2", "equal-k1", "train-bound-k4", "train-bound-k2"],
)
def test_async_gain_equals_overlap_bound(train_s, k):
    # Generation of one batch: 100 steps of (0.01 + 16 * 0.001) s = 2.6 s on each engine.
    costs = {"train_step_s": train_s}
    base = scenario(lengths=EQUAL, policy={"mode": "sync"}, costs=costs)
    sync = simulate(base)
    streamed = simulate(base.with_policy(mode="async", max_staleness=k))
    one_step = simulate(base.with_policy(mode="one_step"))
    gen = 2.6
    bound = (gen + train_s) / max(gen, train_s)
    assert sync.steady_step_s == pytest.approx(gen + train_s, rel=1e-9)
    assert sync.steady_step_s / streamed.steady_step_s == pytest.approx(bound, rel=1e-9)
    assert sync.steady_step_s / one_step.steady_step_s == pytest.approx(bound, rel=1e-9)


def test_finished_groups_wait_in_the_put_buffer():
    # One engine, 1 s per decode step, B = 2 one-sample groups, k = 0: the engine runs
    # groups 0 and 1 until the trainer steps. A finished group is put in the store once two
    # wait (put_groups) or 0.5 s after the first of them (group_ready_s).
    def first_step(lengths: list[int], put_groups: int) -> float:
        sc = scenario(
            lengths={"kind": "groups", "groups": [[n] for n in lengths] + [[1]] * 20},
            policy={"mode": "async", "max_staleness": 0, "put_groups": put_groups},
            steps=2,
            groups=2,
            group_size=1,
            engines=1,
            concurrency=4,
            costs={
                "decode_step_s": 1.0,
                "decode_per_request_s": 0.0,
                "train_step_s": 0.25,
                "group_ready_s": 0.5,
            },
        )
        return simulate(sc).step_end_s[0]

    assert first_step([1, 3], 2) == pytest.approx(3 + 0.5 + 0.25)  # each waits out the timer
    assert first_step([1, 1], 2) == pytest.approx(1 + 0.25)  # a full buffer is put at once
    assert first_step([1, 3], 1) == pytest.approx(3 + 0.25)  # no buffer


def test_one_straggler_sets_the_sync_step():
    # Each batch: one sample of 1000 tokens in the first group, every other sample 10.
    # Its engine runs 16 requests for 10 steps, then the straggler alone for 990 steps.
    groups = [[1000, 10, 10, 10]] + [[10, 10, 10, 10]] * 7
    sc = scenario(lengths={"kind": "groups", "groups": groups}, policy={"mode": "sync"})
    result = simulate(sc)
    straggler = 10 * (0.01 + 16 * 0.001) + 990 * (0.01 + 1 * 0.001)
    assert result.steady_step_s == pytest.approx(straggler + 1.0, rel=1e-9)
    # The other engine finished after 10 steps and idled for the rest of generation.
    other_busy = 10 * (0.01 + 16 * 0.001)
    idle = (straggler - other_busy + 2 * 1.0) / (2 * (straggler + 1.0))
    assert result.rollout_idle == pytest.approx(idle, rel=1e-6)


def test_long_first_balance_splits_stragglers_across_engines():
    # Two long groups per batch. Round-robin (Sluice's sync submit) puts both on engine 0;
    # longest-first with balance puts one on each, so the batch ends when one finishes.
    groups = [[500] * 4, [10] * 4, [500] * 4, [10] * 4] + [[10] * 4] * 4
    lengths = {"kind": "groups", "groups": groups}
    round_robin = simulate(scenario(lengths=lengths, policy={"mode": "sync"}))
    exact = {"mode": "sync", "long_first": True, "balance": True, "predictor_sigma": 0.0}
    balanced = simulate(scenario(lengths=lengths, policy=exact))
    # Round robin: engine 0 holds groups 0, 2, 4, 6: 16 requests, 8 of them 500 long.
    packed = 10 * (0.01 + 16 * 0.001) + 490 * (0.01 + 8 * 0.001)
    # Balanced: each engine gets one long group (4 requests of 500) and three short ones.
    spread = 10 * (0.01 + 16 * 0.001) + 490 * (0.01 + 4 * 0.001)
    assert round_robin.steady_step_s == pytest.approx(packed + 1.0, rel=1e-9)
    assert balanced.steady_step_s == pytest.approx(spread + 1.0, rel=1e-9)


def test_concurrency_cap_queues_requests_in_order():
    # 32 requests of 100 tokens on one engine that runs 8 at a time: four waves.
    sc = scenario(lengths=EQUAL, policy={"mode": "sync"}, engines=1, concurrency=8)
    result = simulate(sc)
    assert result.steady_step_s == pytest.approx(4 * 100 * (0.01 + 8 * 0.001) + 1.0, rel=1e-9)


def test_colocated_sync_adds_the_switch_and_divides_training():
    cluster = {
        "placement": "colocated",
        "rollout_accelerators": 2,
        "train_accelerators": 2,
        "max_concurrency": 16,
    }
    costs = {"train_per_token_s": 2e-4, "colocated_switch_s": 0.3}
    result = simulate(
        scenario(lengths=EQUAL, policy={"mode": "sync"}, costs=costs, cluster=cluster)
    )
    # 3200 response tokens over 2 accelerators at 2e-4 accelerator-seconds each.
    assert result.steady_step_s == pytest.approx(2.6 + 1.0 + 0.32 + 0.3, rel=1e-9)
    assert result.label == "sync (colocated)"


@pytest.mark.parametrize("stale_by", ["first_token", "last_token"])
def test_one_long_group_started_two_versions_back(stale_by):
    # B = 2 groups of one sample, k = 1, one engine, 1 s per decode step, 0.5 s per train
    # step. Group 0 is 50 tokens, every other group 1. At t=0 the engine admits groups 0-3
    # ((0 + 1 + 1) * 2); 1, 2, 3 finish at t=1 and the trainer takes 1, 2. From then on
    # each version admits two more one-token groups and the trainer steps every 1.5 s.
    # Group 0 (version 0) finishes at t=50 under the weights of version 33 (33 steps of
    # 1.5 s have ended by then): first_token drops it, last_token trains it at version 33
    # with its first token 33 versions old.
    groups = [[50]] + [[1]] * 500
    sc = scenario(
        lengths={"kind": "groups", "groups": groups},
        policy={"mode": "async", "max_staleness": 1, "stale_by": stale_by},
        steps=40,
        groups=2,
        group_size=1,
        engines=1,
        concurrency=4,
        costs={"decode_step_s": 1.0, "decode_per_request_s": 0.0, "train_step_s": 0.5},
    )
    result = simulate(sc)
    assert result.step_end_s[:4] == pytest.approx([1.5, 3.0, 4.5, 6.0])
    assert result.max_staleness <= 1
    assert result.trained_samples == 80
    if stale_by == "first_token":
        assert result.dropped_samples == 1
        assert max(result.first_token_lag) <= 1
    else:
        assert result.dropped_samples == 0
        assert max(result.first_token_lag) == 33 and result.first_token_lag[33] == 1


def test_repack_moves_the_stragglers_onto_one_engine():
    # Two engines, one group each: [500, 10, 10, 10]. After 10 steps of 4 requests each
    # engine runs one straggler; repack moves engine 1's onto engine 0, which recomputes
    # its 10 generated tokens (prefill, 1 ms each) and runs both: (a + 2b) per step.
    # Synchronous training gains nothing from it (the batch still waits for the longest
    # response), and it pays the migration and the slower shared steps.
    groups = [[500, 10, 10, 10], [500, 10, 10, 10]]
    common = {
        "lengths": {"kind": "groups", "groups": groups},
        "groups": 2,
        "steps": 6,
        "costs": {"prefill_per_token_s": 0.001},
    }
    plain = simulate(scenario(policy={"mode": "sync"}, **common))
    packed = simulate(
        scenario(policy={"mode": "sync", "repack": True, "repack_max_stragglers": 1}, **common)
    )
    head = 10 * (0.01 + 4 * 0.001)
    assert plain.steady_step_s == pytest.approx(head + 490 * (0.01 + 0.001) + 1.0, rel=1e-9)
    assert packed.steady_step_s == pytest.approx(
        head + 10 * 0.001 + 490 * (0.01 + 2 * 0.001) + 1.0, rel=1e-9
    )
    assert packed.repacked_requests == 6
    assert plain.repacked_requests == 0
