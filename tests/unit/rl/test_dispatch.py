import random

import pytest

from sluice.rl.dispatch import (
    GroupRequest,
    InFlight,
    LengthPredictor,
    RepackPlan,
    WorkerLoad,
    plan,
    stragglers,
)

# ---------------------------------------------------------------- LengthPredictor


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.25], ids=["latest-only", "half", "quarter"])
def test_predictor_per_prompt_ema_matches_closed_form(alpha):
    means = [100.0, 200.0, 400.0]
    p = LengthPredictor(alpha=alpha)
    for m in means:
        # two samples per group whose mean is m
        p.observe("q1", "math", 30, [int(m) - 10, int(m) + 10])
    # EMA seeded with the first mean: (1-a)^2 m1 + a(1-a) m2 + a m3
    expected = (1 - alpha) ** 2 * means[0] + alpha * (1 - alpha) * means[1] + alpha * means[2]
    assert p.predict("q1", "math", 30) == pytest.approx(expected)


def test_predictor_seen_prompt_ignores_prompt_len_and_other_prompts():
    p = LengthPredictor()
    p.observe("q1", "math", 30, [50])
    p.observe("q2", "math", 30, [900])
    assert p.predict("q1", "math", 4000) == pytest.approx(50.0)


def test_predictor_keys_prompts_by_env():
    p = LengthPredictor(prior=7.0)
    p.observe("q1", "math", 30, [50])
    assert p.predict("q1", "code", 30) == pytest.approx(7.0)


def test_predictor_generalises_by_prompt_length_for_unseen_prompts():
    p = LengthPredictor()
    # short prompts get short answers, long prompts long ones
    p.observe("s1", "math", 20, [100])
    p.observe("s2", "math", 24, [140])
    p.observe("l1", "math", 600, [2000])
    # 20 and 24 share the [16, 32) bucket; 600 sits in [512, 1024)
    assert p.predict("new-short", "math", 17) == pytest.approx(120.0)
    assert p.predict("new-long", "math", 1000) == pytest.approx(2000.0)


@pytest.mark.parametrize(
    ("env", "prompt_len", "expected"),
    [
        ("math", 20, 100.0),  # bucket [16, 32) known
        ("math", 200, 150.0),  # bucket unknown: env mean of (100, 200)
        ("code", 20, 333.0),  # env unknown: prior
    ],
    ids=["bucket", "env-mean", "prior"],
)
def test_predictor_fallbacks(env, prompt_len, expected):
    p = LengthPredictor(prior=333.0)
    p.observe("a", "math", 20, [100])
    p.observe("b", "math", 4000, [200])
    assert p.predict("unseen", env, prompt_len) == pytest.approx(expected)


def test_predictor_env_mean_becomes_ema_after_window():
    p = LengthPredictor(window=2)
    for length in (100, 200, 400):
        p.observe(f"q{length}", "math", 10, [length])
    # running mean of 100, 200 is 150; then weight 1/2 on 400 gives 275
    assert p.predict("unseen", "math", 10) == pytest.approx(275.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"prior": 0.0}, "prior"),
        ({"window": 0}, "window"),
    ],
    ids=["alpha-zero", "alpha-above-one", "prior-zero", "window-zero"],
)
def test_predictor_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthPredictor(**kwargs)


@pytest.mark.parametrize(
    ("prompt_len", "lengths", "match"),
    [(10, [], "no response lengths"), (10, [5, -1], "negative"), (-1, [5], "prompt_len")],
    ids=["empty-group", "negative-length", "negative-prompt-len"],
)
def test_predictor_rejects_bad_observations(prompt_len, lengths, match):
    with pytest.raises(ValueError, match=match):
        LengthPredictor().observe("q", "math", prompt_len, lengths)


# ---------------------------------------------------------------- plan


def group(gid: str, predicted: float, samples: int = 1) -> GroupRequest:
    return GroupRequest(gid, f"p-{gid}", "math", 10, samples, predicted)


def workers(n: int, capacity: int = 100, queued: float = 0.0) -> list[WorkerLoad]:
    return [WorkerLoad(w, queued, capacity) for w in range(n)]


def loads(result, start: dict[int, float] | None = None) -> dict[int, float]:
    start = start or {}
    return {
        w: start.get(w, 0.0) + sum(g.tokens for g in gs) for w, gs in result.assignments.items()
    }


def ids(gs: list[GroupRequest]) -> list[str]:
    return [g.group_id for g in gs]


def test_plan_orders_by_predicted_total_tokens_longest_first():
    # totals: a=40, b=90, c=60, d=90 (ties keep input order)
    gs = [group("a", 10, 4), group("b", 90), group("c", 15, 4), group("d", 45, 2)]
    result = plan(gs, workers(1))
    assert ids(result.assignments[0]) == ["b", "d", "c", "a"]
    assert result.left == []


def test_plan_lpt_on_graham_worst_case_gives_known_makespan():
    # Graham's tight instance for m=3: jobs 5,5,4,4,3,3,3. Optimal is 9 (5+4, 5+4, 3+3+3);
    # LPT gives 11 = (4/3 - 1/(3m)) * 9.
    gs = [group(f"g{i}", t) for i, t in enumerate([3, 5, 3, 4, 5, 3, 4])]
    result = plan(gs, workers(3))
    assert max(loads(result).values()) == pytest.approx(11.0)
    # trace: 5->w0, 5->w1, 4->w2, 4->w2 (4 is least), then the 3s to w0, w1, w0 (ties to
    # the earlier worker)
    assert [[g.predicted for g in result.assignments[w]] for w in range(3)] == [
        [5, 3, 3],
        [5, 3],
        [4, 4],
    ]


def test_plan_long_first_beats_input_order_on_a_skewed_batch():
    gs = [group("s1", 1), group("s2", 1), group("s3", 1), group("s4", 1), group("long", 4)]
    lpt = plan(gs, workers(2))
    greedy = plan(gs, workers(2), long_first=False)
    assert max(loads(lpt).values()) == pytest.approx(4.0)
    assert max(loads(greedy).values()) == pytest.approx(6.0)
    assert ids(lpt.assignments[0]) == ["long"]


def test_plan_balance_accounts_for_tokens_already_queued():
    ws = [WorkerLoad(0, 100.0, 5), WorkerLoad(1, 0.0, 5)]
    result = plan([group("a", 60), group("b", 30), group("c", 20)], ws)
    # w1 is the least loaded until it passes w0's 100 queued tokens: 0, 60, 90 < 100
    assert ids(result.assignments[0]) == []
    assert ids(result.assignments[1]) == ["a", "b", "c"]


def test_plan_respects_capacity_and_returns_leftovers_in_dispatch_order():
    ws = [WorkerLoad(0, 0.0, 1), WorkerLoad(1, 0.0, 2), WorkerLoad(2, 0.0, 0)]
    gs = [group(f"g{t}", t) for t in (1, 2, 3, 4, 5)]
    result = plan(gs, ws)
    assert {w: len(v) for w, v in result.assignments.items()} == {0: 1, 1: 2, 2: 0}
    # 5->w0 (full), 4->w1, 3->w1 (full); 2 and 1 fit nowhere
    assert ids(result.assignments[0]) == ["g5"]
    assert ids(result.assignments[1]) == ["g4", "g3"]
    assert ids(result.left) == ["g2", "g1"]


def test_plan_with_no_capacity_leaves_everything():
    gs = [group("a", 1), group("b", 2)]
    result = plan(gs, workers(2, capacity=0))
    assert result.assignments == {0: [], 1: []}
    assert ids(result.left) == ["b", "a"]
    assert plan(gs, []).left == plan(gs, workers(2, capacity=0)).left


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "round-robin"])
def test_plan_long_first_off_keeps_input_order(balance):
    gs = [group("a", 1), group("b", 9), group("c", 5)]
    result = plan(gs, workers(1), long_first=False, balance=balance)
    assert ids(result.assignments[0]) == ["a", "b", "c"]


def test_plan_balance_off_round_robins_over_workers_with_capacity():
    ws = [WorkerLoad(0, 1e9, 3), WorkerLoad(1, 0.0, 1), WorkerLoad(2, 0.0, 3)]
    gs = [group(f"g{i}", 10 - i) for i in range(6)]
    result = plan(gs, ws, balance=False)
    # w1 fills after one group and is skipped thereafter; queued tokens are ignored
    assert ids(result.assignments[0]) == ["g0", "g3", "g5"]
    assert ids(result.assignments[1]) == ["g1"]
    assert ids(result.assignments[2]) == ["g2", "g4"]
    assert result.left == []


def test_plan_rejects_duplicate_workers():
    with pytest.raises(ValueError, match="unique"):
        plan([group("a", 1)], [WorkerLoad(0, 0.0, 1), WorkerLoad(0, 0.0, 1)])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GroupRequest("g", "p", "math", 10, 0, 1.0), "samples"),
        (lambda: GroupRequest("g", "p", "math", 10, 1, -1.0), "predicted"),
        (lambda: WorkerLoad(0, 0.0, -1), "capacity"),
    ],
    ids=["no-samples", "negative-prediction", "negative-capacity"],
)
def test_dispatch_records_reject_bad_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- stragglers

NOW = 1000.0


def req(rid: str, age: float = 60.0, done: int = 0, predicted: float = 100.0) -> InFlight:
    return InFlight(rid, f"g-{rid}", NOW - age, done, predicted)


def test_no_repack_when_workers_are_busy():
    in_flight = {0: [req(f"a{i}") for i in range(8)], 1: [req(f"b{i}") for i in range(8)]}
    assert stragglers(in_flight, max_stragglers=2, min_age_s=10.0, now=NOW) is None


def test_repack_when_two_workers_hold_few_old_requests():
    in_flight = {0: [req("a1")], 1: [req("b1"), req("b2")], 2: [req(f"c{i}") for i in range(8)]}
    plan_ = stragglers(in_flight, max_stragglers=2, min_age_s=10.0, now=NOW)
    # w1 holds the most stragglers, so w0's one request moves there; busy w2 is untouched
    assert plan_ == RepackPlan(target=1, moves={0: ["a1"]})


def test_repack_moves_everything_from_every_other_straggler():
    in_flight = {3: [req("a")], 1: [req("b1"), req("b2"), req("b3")], 2: [req("c1"), req("c2")]}
    plan_ = stragglers(in_flight, max_stragglers=3, min_age_s=0.0, now=NOW)
    assert plan_ == RepackPlan(target=1, moves={2: ["c1", "c2"], 3: ["a"]})


def test_repack_breaks_count_ties_by_predicted_remaining_tokens():
    in_flight = {
        0: [req("a", done=90, predicted=100.0)],  # 10 tokens to go
        1: [req("b", done=150, predicted=100.0)],  # overran its prediction: 0 to go
        2: [req("c", done=10, predicted=100.0)],  # 90 to go: the longest tail
    }
    plan_ = stragglers(in_flight, max_stragglers=1, min_age_s=0.0, now=NOW)
    assert plan_ is not None
    assert plan_.target == 2
    assert plan_.moves == {0: ["a"], 1: ["b"]}


def test_repack_breaks_full_ties_by_smallest_worker_id():
    in_flight = {5: [req("a")], 4: [req("b")]}
    assert stragglers(in_flight, max_stragglers=1, min_age_s=0.0, now=NOW) == RepackPlan(
        target=4, moves={5: ["a"]}
    )


@pytest.mark.parametrize(
    "in_flight",
    [
        {0: [req("a")], 1: [req(f"b{i}") for i in range(5)]},  # w1 busy
        {0: [req("a")], 1: []},  # w1 idle
        {0: [req("a")], 1: [req("b", age=1.0)]},  # w1's request too young
        {0: [req("a")], 1: [req("b1"), req("b2", age=1.0)]},  # one young request keeps w1
        {0: [req("a")]},  # a single worker
        {},
    ],
    ids=["other-busy", "other-idle", "other-young", "other-mixed-age", "single-worker", "empty"],
)
def test_no_repack_without_a_second_straggler(in_flight):
    assert stragglers(in_flight, max_stragglers=2, min_age_s=10.0, now=NOW) is None


def test_repack_never_targets_or_drains_a_non_straggler():
    # w9 has the most predicted work but is busy; the target must be a straggler
    in_flight = {
        0: [req("a", done=0, predicted=10.0)],
        1: [req("b", done=0, predicted=20.0)],
        9: [req(f"z{i}", predicted=1e6) for i in range(4)],
    }
    plan_ = stragglers(in_flight, max_stragglers=1, min_age_s=10.0, now=NOW)
    assert plan_ == RepackPlan(target=1, moves={0: ["a"]})


def test_min_age_boundary_is_inclusive():
    in_flight = {0: [req("a", age=10.0)], 1: [req("b", age=10.0)]}
    assert stragglers(in_flight, max_stragglers=1, min_age_s=10.0, now=NOW) is not None


@pytest.mark.parametrize(
    ("max_stragglers", "min_age_s", "match"),
    [(0, 1.0, "max_stragglers"), (1, -1.0, "min_age_s")],
    ids=["zero-stragglers", "negative-age"],
)
def test_stragglers_rejects_bad_thresholds(max_stragglers, min_age_s, match):
    with pytest.raises(ValueError, match=match):
        stragglers({}, max_stragglers=max_stragglers, min_age_s=min_age_s, now=NOW)


def _plan_by_scanning(groups, workers, long_first, balance):
    """The plan as first written, scanning every open worker for each group: the reference
    the heap-based ``plan`` must equal."""
    order = sorted(groups, key=lambda g: -g.tokens) if long_first else list(groups)
    load = [w.queued_tokens for w in workers]
    room = [w.capacity for w in workers]
    out = {w.worker: [] for w in workers}
    left, cursor = [], 0
    for group in order:
        open_ = [i for i in range(len(workers)) if room[i] > 0]
        if not open_:
            left.append(group)
            continue
        if balance:
            pick = min(open_, key=lambda i: (load[i], i))
        else:
            pick = min(open_, key=lambda i: (i - cursor) % len(workers))
            cursor = pick + 1
        out[workers[pick].worker].append(group)
        load[pick] += group.tokens
        room[pick] -= 1
    return out, left


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("balance", [True, False])
def test_plan_equals_the_scan_over_every_worker(seed, balance):
    rng = random.Random(seed)
    groups = [
        GroupRequest(f"g{i}", f"p{i}", "math", 10, rng.randint(1, 4), rng.choice([5.0, 20.0]))
        for i in range(rng.randint(0, 40))
    ]
    workers = [
        WorkerLoad(w, float(rng.choice([0, 0, 50, 100])), rng.randint(0, 4))
        for w in rng.sample(range(100), rng.randint(1, 12))
    ]
    got = plan(groups, workers, long_first=seed % 2 == 0, balance=balance)
    assert (got.assignments, got.left) == _plan_by_scanning(groups, workers, seed % 2 == 0, balance)
