"""The flow's step (``flows/rl_job.py: rl_step``) on small deterministic fakes: the order of
a trajectory's life (lease, train and publish, acknowledge: ``Session.train`` itself, on
fake pools), what each mode's rollouts are told, what is logged, and when held-out
evaluation runs. No Ray, no vLLM."""

from __future__ import annotations

from typing import Any

import pytest
from ray.exceptions import OwnerDiedError, RayTaskError

from sluice.config.tree import RunConfig, build_config
from sluice.driver.health import LearningHealth
from sluice.driver.modes import schedule
from sluice.driver.session import RELEASES, Session
from sluice.driver.step_log import StoreMetrics, Totals
from sluice.driver.weight_sync import SyncWatch
from sluice.flows.rl_job import rl_step
from sluice.storage.layout import RunLayout

TRAINED = {
    "samples": 16.0,
    "tokens": 160.0,
    "loss": 0.5,
    "kl_behaviour": 1e-3,
    "entropy": 1.2,
    "staleness": 0.0,
}


class Calls:
    """Every call the step makes on the pools, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def __call__(self, name: str, arg: Any = None) -> None:
        self.log.append((name, arg))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.log]


class FakeRollouts:
    """Either mode's rollouts: what a step tells them."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def check(self) -> None:  # streams
        self.calls("check")

    def collect(self) -> None:  # batches
        self.calls("collect")

    def generate(self, step: int) -> None:
        self.calls("generate", step)

    def load(self, step: int) -> None:
        self.calls("load", step)

    def drain(self, step: int, dropped_groups: int) -> dict[str, float]:
        self.calls("drain", (step, dropped_groups))
        return {"rollout/reward": 0.25}


class FakeStore:
    def __init__(self, calls: Calls) -> None:
        self.calls, self.dropped = calls, 0

    def ack(self, lease: str, version: int) -> int:
        self.calls("ack", (lease, version))
        return 16

    def stats(self) -> dict[str, int]:
        return {"held": 0, "ready": 0, "leased": 0, "dropped": self.dropped, "expired_leases": 0}


class FakeTrainer:
    def __init__(self, calls: Calls, lost: int = 0) -> None:
        self.calls = calls
        self.lost = lost  # leases whose rows are gone when it reads them

    def train(self, lease: str) -> dict[str, float]:
        self.calls("train", lease)  # the real trainer publishes before it answers
        if self.lost:
            self.lost -= 1
            raise RayTaskError("train", "", OwnerDiedError("0" * 56, "", ""))
        return dict(TRAINED)


class FakeSession:
    """What ``rl_step`` uses of ``driver.session.Session``, its ``train`` the real one; refs
    are plain values here."""

    train = Session.train
    drops_to_credit = Session.drops_to_credit

    def __init__(self, cfg: RunConfig, step: int = 0) -> None:
        self.cfg, self.step, self.calls = cfg, step, Calls()
        self.schedule = schedule(cfg)
        self.rollouts = FakeRollouts(self.calls)
        streaming = self.schedule.streaming
        self.stream, self.batch = (self.rollouts, None) if streaming else (None, self.rollouts)
        self.store = FakeStore(self.calls)
        self.trainer = FakeTrainer(self.calls)
        self.totals, self.store_metrics = Totals(), StoreMetrics()
        self.sync = SyncWatch()
        self.end_accuracy: float | None = None
        self.health = LearningHealth(
            cfg.eval.collapse_drop, cfg.eval.entropy_floor, cfg.eval.collapse_patience
        )
        self.layout = RunLayout(cfg.run_dir, cfg.cache_dir)
        self.drops_seen = self.drops_owed = 0

    def save_policy(self, folder: str) -> None:
        self.calls("save_policy", folder)

    def wait(self, ref: Any, what: str) -> Any:
        return ref

    def lease(self) -> str:
        self.calls("lease", self.step)
        return f"lease-{self.step + 1}"

    def control_plane(self) -> None:
        self.calls("control_plane", None)

    def evaluate(self) -> dict[str, float]:
        self.calls("evaluate", self.step)
        return {"eval/accuracy": 0.5, "eval/pass_at_4": 0.75}


class FakeTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))


def _cfg(mode: str = "async", **eval_: int) -> RunConfig:
    return build_config({"mode": mode, "train": {"steps": 10}, "eval": eval_ or {"every": 5}})


# A trajectory's life in a step, whatever the mode.
TRAINED_AT_4 = [
    ("lease", 3),  # leased against the trainer's version before the step
    ("train", "lease-4"),
    ("ack", ("lease-4", 4)),  # acknowledged as trained at the published version
    ("control_plane", None),  # restarts of the store or relay 0 since the last step
]


@pytest.mark.parametrize(
    ("mode", "before", "after"),
    [
        ("async", [("check", None)], []),
        ("sync", [("collect", None)], [("load", 4), ("generate", 5)]),
        ("one_step", [("collect", None), ("generate", 5)], [("load", 4)]),
    ],
)
def test_a_step_leases_trains_then_acknowledges_at_the_new_version(
    mode: str, before: list[tuple[str, Any]], after: list[tuple[str, Any]]
) -> None:
    s, tracker = FakeSession(_cfg(mode), step=3), FakeTracker()
    rl_step(s, tracker)  # type: ignore[arg-type]
    assert s.calls.log == [*before, *TRAINED_AT_4, *after, ("drain", (4, 0))]
    assert s.step == 4
    ((step, metrics),) = tracker.logged
    assert step == 4
    assert metrics["train/loss"] == 0.5 and metrics["rollout/reward"] == 0.25
    assert metrics["perf/samples_per_s"] == pytest.approx(16.0 / metrics["perf/step_s"])
    assert "eval/accuracy" not in metrics


def test_a_batch_whose_rows_died_with_the_store_is_leased_again() -> None:
    """The store restarted in place while the trainer was about to read the batch: its
    rows lived in the dead process's objects. The trainer changed nothing; the step leases
    again (the restarted store re-offers them), and a batch lost every time fails the step."""
    s = FakeSession(_cfg(), step=3)
    s.trainer = FakeTrainer(s.calls, lost=2)
    trained, _ = s.train(4)  # type: ignore[attr-defined]
    assert trained == TRAINED
    assert s.calls.names.count("lease") == 3 and s.calls.names.count("ack") == 1
    s.trainer = FakeTrainer(s.calls, lost=RELEASES + 1)
    with pytest.raises(RayTaskError):
        s.train(5)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("step", "evaluates"),
    [
        pytest.param(4, True, id="every-5"),
        pytest.param(6, False, id="between"),
        pytest.param(9, True, id="last-step"),
    ],
)
def test_held_out_evaluation_runs_every_n_steps_and_at_the_end(step: int, evaluates: bool) -> None:
    s, tracker = FakeSession(_cfg(), step=step), FakeTracker()
    rl_step(s, tracker)  # type: ignore[arg-type]
    assert ("evaluate" in s.calls.names) == evaluates
    logged = tracker.logged[0][1]
    assert ("eval/accuracy" in logged) == evaluates
    assert ("eval/pass_at_4" in logged) == evaluates  # every held-out metric is logged
    # How long training paused for it, so that benchmarks can take it off the wall clock.
    assert ("eval/seconds" in logged) == evaluates
    assert logged.get("eval/seconds", 0.0) >= 0.0
    assert s.end_accuracy == (0.5 if evaluates else None)


def test_groups_the_store_dropped_go_back_to_the_rollouts_as_groups() -> None:
    s, tracker = FakeSession(_cfg(), step=0), FakeTracker()
    s.store.dropped = 3 * s.cfg.rollout.samples_per_prompt  # three groups since the last step
    rl_step(s, tracker)  # type: ignore[arg-type]
    assert ("drain", (1, 3)) in s.calls.log
    assert tracker.logged[0][1]["store/dropped"] == 3 * s.cfg.rollout.samples_per_prompt


def test_drops_are_credited_once_whether_a_wait_or_the_step_sees_them_first() -> None:
    """A lease that waits credits the groups it sees dropped (``Session.ready``); the step
    then credits only what came after, and half a group waits for its other half."""
    s, tracker = FakeSession(_cfg(), step=0), FakeTracker()
    n = s.cfg.rollout.samples_per_prompt
    s.store.dropped = 2 * n
    assert s.drops_to_credit(s.store.stats()) == 2  # seen while waiting for the lease
    s.store.dropped = 3 * n + n // 2
    rl_step(s, tracker)  # type: ignore[arg-type]
    assert ("drain", (1, 1)) in s.calls.log
    s.store.dropped = 4 * n
    assert s.drops_to_credit(s.store.stats()) == 1  # the other half came
    s.store.dropped = n  # a store restarted in place counts from zero
    assert s.drops_to_credit(s.store.stats()) == 1


def test_throughput_totals_add_up_over_steps() -> None:
    s, tracker = FakeSession(_cfg(), step=0), FakeTracker()
    for _ in range(3):
        rl_step(s, tracker)  # type: ignore[arg-type]
    assert (s.totals.samples, s.totals.tokens) == (48, 480)
    assert s.totals.loop_s > 0
    # each step's weight sync is watched: the run's median so far is logged with the step
    assert len(s.sync.loads) == 3
    assert tracker.logged[-1][1]["perf/weight_load_median_s"] == s.sync.median()


def test_a_new_best_is_saved_and_a_collapse_is_said_in_the_step_line(caplog) -> None:
    s, tracker = FakeSession(_cfg(), step=4), FakeTracker()
    with caplog.at_level("INFO", logger="sluice"):
        rl_step(s, tracker)  # type: ignore[arg-type]  # held-out 0.5: the first, so the best
    assert ("save_policy", str(s.layout.best_policy)) in s.calls.log
    assert tracker.logged[-1][1]["eval/best_accuracy"] == 0.5
    s.health.held_out(2, 0.8)  # an earlier best far above what the next evaluation finds
    s.calls.log.clear()
    s.step = 9
    with caplog.at_level("INFO", logger="sluice"):
        rl_step(s, tracker)  # type: ignore[arg-type]
    assert "save_policy" not in s.calls.names
    assert tracker.logged[-1][1]["health/accuracy_collapsed"] == 1.0
    step_line = next(r.message for r in caplog.records if r.message.startswith("step   10/10"))
    assert step_line.endswith(
        "| COLLAPSE: held-out 50.0% is 30.0 points below its best (80.0% at step 2)"
    )
    assert any(
        r.levelname == "WARNING" and "collapsed at step 10" in r.message for r in caplog.records
    )
