"""What each mode does in a step (``driver/modes.py``) and how its rollouts are driven
(``driver/batch.py``, ``driver/stream.py``), on small deterministic fakes.

``schedule`` reads the mode once; ``batch_step`` generates the next batch after the workers
loaded the new version in ``sync`` and before training in ``one_step``; ``BatchRollouts``
spreads a batch over the workers and makes a dead worker's shard again under a new tag;
``StreamRollouts`` hands a dead streaming worker's groups back to the dispatcher once. Worker
clients are fakes whose "refs" are plain values (the waiter returns them), except where
Ray's own death signal is the thing under test.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from sluice.config.tree import RunConfig, build_config
from sluice.driver.batch import BatchRollouts
from sluice.driver.modes import batch_step, schedule, stream_step
from sluice.driver.step_log import StoreMetrics
from sluice.driver.stream import StreamRollouts
from sluice.driver.weight_sync import ServedWeights
from sluice.engines.rollout.messages import BatchShard, RolloutStats, Served
from sluice.envs import make_env
from sluice.envs.prompts import PromptStream

# No version has a published digest here: served weights are not compared.
UNCHECKED = ServedWeights(lambda version: None, stale_after_s=60.0)


def _cfg(mode: str, **rollout: Any) -> RunConfig:
    return build_config(
        {
            "mode": mode,
            "max_staleness": 3,
            "train": {"steps": 3},
            "rollout": {"workers": 2, "prompts_per_step": 4, "samples_per_prompt": 2, **rollout},
        }
    )


class FakeWorker:
    """A rollout worker client: records calls; ``rollout`` answers counts at once."""

    def __init__(self, index: int, log: list[tuple[Any, ...]]) -> None:
        self.index, self.log = index, log

    def rollout(self, problems: list[Any], shard: BatchShard) -> RolloutStats:
        self.log.append(("rollout", self.index, len(problems), shard.tag, shard.version))
        n = len(problems) * shard.n
        return RolloutStats(n, len(problems), 10 * n, 0.5 * n, n // 2, 0, 0, 0)

    def sync_weights(self, at_least: int, timeout_s: float) -> Served:
        self.log.append(("sync_weights", self.index, at_least))
        return Served(at_least, "")


def _batch(mode: str) -> tuple[BatchRollouts, list[tuple[Any, ...]]]:
    cfg, log = _cfg(mode), []
    workers = [FakeWorker(i, log) for i in range(2)]
    prompts = PromptStream(make_env("addition"), 64, seed=0)
    lag = schedule(cfg).max_staleness
    rollouts = BatchRollouts(cfg, workers, prompts, lambda ref, what: ref, UNCHECKED, lag=lag)  # type: ignore[arg-type]
    return rollouts, log


def _step(mode: str, rollouts: BatchRollouts, step: int, log: list[tuple[Any, ...]]) -> None:
    """One ``batch_step``; its training logs "train" and answers at once."""

    def train(step: int) -> tuple[dict[str, float], float]:
        log.append(("train", step))
        return {}, 0.0

    batch_step(rollouts, step, 3, schedule(_cfg(mode)).overlap, train)


@pytest.mark.parametrize(
    ("mode", "staleness", "streaming", "overlap", "first"),
    [
        ("sync", 0, False, False, 2),
        ("one_step", 1, False, True, 2),
        ("async", 3, True, False, 1),
    ],
)
def test_the_mode_is_read_once_into_a_schedule(
    mode: str, staleness: int, streaming: bool, overlap: bool, first: int
) -> None:
    s = schedule(_cfg(mode))
    assert (s.max_staleness, s.streaming, s.overlap, s.min_workers) == (
        staleness,
        streaming,
        overlap,
        first,
    )


def test_sync_generates_the_next_batch_only_after_the_workers_load_the_new_version() -> None:
    rollouts, log = _batch("sync")
    rollouts.start()
    assert [c[0] for c in log] == ["rollout", "rollout"]  # the batch, split over 2 workers
    assert sorted(c[2] for c in log) == [2, 2] and {c[4] for c in log} == {0}
    log.clear()
    _step("sync", rollouts, 1, log)
    assert [c[0] for c in log] == ["train", "sync_weights", "sync_weights", "rollout", "rollout"]
    assert {c[4] for c in log if c[0] == "rollout"} == {1}  # batch 2 on version 1
    metrics = rollouts.drain(1)
    assert metrics["rollout/reward"] == 0.5 and metrics["rollout/accuracy"] == 0.5


def test_one_step_generates_the_next_batch_before_training_on_this_one() -> None:
    rollouts, log = _batch("one_step")
    rollouts.start()
    log.clear()
    _step("one_step", rollouts, 1, log)
    assert [c[0] for c in log] == ["rollout", "rollout", "train", "sync_weights", "sync_weights"]
    assert {c[4] for c in log if c[0] == "rollout"} == {0}  # batch 2 on version 0's weights
    log.clear()
    _step("one_step", rollouts, 2, log)
    assert {c[4] for c in log if c[0] == "rollout"} == {1}  # batch 3 one version behind


def test_the_last_step_generates_no_further_batch() -> None:
    for mode in ("sync", "one_step"):
        rollouts, log = _batch(mode)
        rollouts.start()
        _step(mode, rollouts, 3, log)
        assert [c for c in log if c[0] == "rollout"] == log[:2], mode


def test_an_async_step_restarts_dead_streams_then_trains() -> None:
    calls: list[str] = []

    class Streams:
        def check(self) -> None:
            calls.append("check")

    def train(step: int) -> tuple[dict[str, float], float]:
        calls.append(f"train {step}")
        return {"samples": 1.0}, 0.0

    trained, times = stream_step(Streams(), 4, train)  # type: ignore[arg-type]
    assert calls == ["check", "train 4"] and trained == {"samples": 1.0}
    assert times.start <= times.generated <= times.trained == times.synced


def test_a_shard_whose_worker_died_is_made_again_under_a_new_tag() -> None:
    rollouts, log = _batch("sync")
    deaths = iter([RayActorError()])

    def wait(ref: Any, what: str) -> Any:
        if what == "rollouts" and ref.samples and (error := next(deaths, None)):
            raise error
        return ref

    rollouts.wait = wait
    rollouts.restarts.wait_back = lambda worker: None  # type: ignore[method-assign]
    rollouts.start()
    rollouts.collect()
    tags = [c[3] for c in log if c[0] == "rollout"]
    assert len(tags) == 3 and tags[2] == f"{tags[0]}x1"
    assert rollouts.restarts.counts == [1, 0]


def test_a_resumed_batch_run_continues_the_prompt_stream_from_its_cursor() -> None:
    first, _ = _batch("sync")
    first.prompts.take(5)
    cursor = first.cursor()
    again, _ = _batch("sync")
    again.restore(cursor, step=7, held_groups=0)
    assert again.step == 7
    assert [p.prompt_id for p in again.prompts.take(4)] == [
        p.prompt_id for p in first.prompts.take(4)
    ]


class FakeDispatcher:
    """A dispatcher client: what the flow asks of it."""

    def __init__(self) -> None:
        self.requeued: list[int] = []
        self.credited: list[int] = []
        self.restarted: list[tuple[int, str]] = []

    def requeue(self, worker: int) -> int:
        self.requeued.append(worker)
        return 2

    def credit(self, groups: int) -> None:
        self.credited.append(groups)

    def drain(self) -> dict[str, Any]:
        from sluice.engines.rollout.messages import RolloutTotals

        totals = RolloutTotals(groups=1, samples=2, tokens=20, reward_sum=1.0, correct=1)
        counters = {
            "weights_digest": 0.0,
            "busy_s": 3.0,
            "idle_s": 1.0,
            "pull_s": 0.1,
            "weight_loads": 2.0,
            "weight_pull_failures": 0.0,
            "version": 4.0,
            "pid": 42.0,
        }
        return {"totals": totals, "workers": {0: counters}, "incarnation": 1, "restored": ""}

    def restart_at(self, cursor: dict[str, Any], admitted: int, tag: str) -> None:
        self.restarted.append((admitted, tag))


def _stream() -> tuple[StreamRollouts, FakeDispatcher]:
    dispatcher = FakeDispatcher()
    rollouts = StreamRollouts(
        _cfg("async", max_restarts=1),
        [object(), object()],
        dispatcher,  # type: ignore[list-item,arg-type]
        lambda ref, what: ref,
        UNCHECKED,
        tag="a1.",
    )
    return rollouts, dispatcher


def test_a_dead_streaming_worker_hands_its_groups_back_once_and_counts_once() -> None:
    rollouts, dispatcher = _stream()
    rollouts._lost(1, RayActorError(), "its {lost} unfinished groups go back to the queue")
    rollouts._lost(1, RayActorError(), "seen again by stop")  # the same death
    assert dispatcher.requeued == [1]
    assert rollouts.restarts.counts == [0, 1]
    assert rollouts.restarting == {1}
    assert rollouts.live() == [rollouts.workers[0]]


def test_a_worker_that_died_loading_weights_is_counted_and_left_out() -> None:
    """Held-out evaluation pauses the streams and syncs every worker: one that dies then is
    counted like a stream's death and left out of evaluation until Ray has it back."""
    rollouts, dispatcher = _stream()
    rollouts.died_loading(rollouts.workers[0], 5, ActorUnavailableError("restarting", None))
    assert rollouts.restarts.counts == [1, 0]
    assert rollouts.live() == [rollouts.workers[1]]
    assert dispatcher.requeued == [0]


def test_streaming_metrics_credit_drops_and_read_worker_counters() -> None:
    rollouts, dispatcher = _stream()
    metrics = rollouts.drain(step=6, dropped_groups=2)
    assert dispatcher.credited == [2]
    assert metrics["rollout/reward"] == 0.5 and metrics["rollout/groups"] == 1.0
    assert metrics["rollout/worker0/idle_fraction"] == 0.25
    assert metrics["rollout/worker0/version_lag"] == 2.0


def test_a_resumed_stream_counts_trained_and_re_offered_groups_as_admitted() -> None:
    rollouts, dispatcher = _stream()
    rollouts.restore({"prompts": {}, "issued": 40}, step=5, held_groups=3)
    assert dispatcher.restarted == [(5 * 4 + 3, "a1.")]


def test_workers_not_placed_yet_join_later_like_restarted_ones() -> None:
    rollouts, _ = _stream()
    rollouts.placed({1})
    assert rollouts.restarting == {1}
    assert rollouts.live() == [rollouts.workers[0]]


def test_a_stream_that_raised_counts_as_its_workers_failure(ray_local) -> None:
    """A node that goes away can fail a stream with the worker's own error (a broken
    connection to its raylet) before Ray reports the actor dead: handled as its loss."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    def broken() -> None:
        raise OSError("connection to the raylet reset")

    rollouts, dispatcher = _stream()
    rollouts.refs = [ray.put(None), broken.remote()]
    ray.wait(rollouts.refs, num_returns=2)
    rollouts.check()
    assert dispatcher.requeued == [1]
    assert rollouts.restarts.counts == [0, 1]
    assert rollouts.restarting == {1}


def test_store_counters_of_a_store_restarted_in_place_count_from_zero():
    metrics = StoreMetrics()
    gauges = {"held": 0, "ready": 0, "leased": 0, "expired_leases": 0}
    assert metrics.update({**gauges, "dropped": 10})["store/dropped"] == 10
    assert metrics.update({**gauges, "dropped": 14})["store/dropped"] == 4
    assert metrics.update({**gauges, "dropped": 3})["store/dropped"] == 3  # restarted
