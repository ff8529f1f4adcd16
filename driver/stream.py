"""``async``: every rollout worker streams prompt groups from the dispatcher
(``engines/rollout/dispatcher.py``) until told to stop, pulling new weights when it chooses;
a step trains on whatever groups are ready within ``max_staleness`` (``driver/modes.py:
stream_step``).

A worker whose process dies is restarted by Ray; its stream fails here, its unfinished
groups go back to the dispatcher's queue and its stream starts again once Ray has it back.
Training goes on. A worker whose node was lost stays restarting until a node with its
resources joins, which may take minutes or never happen; so does a worker no node had room
for when the run started (``engines/cluster/placement.py``). The run goes on with the pool
it has: held-out evaluation and the end of the run use the live workers only (``live``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from sluice.config.tree import RunConfig
from sluice.driver.batch import credit_of
from sluice.driver.restarts import Restarts, Waiter
from sluice.driver.rollout_metrics import (
    EPISODE_COUNTERS,
    RewardFailures,
    episode_metrics,
    reward_function_metrics,
)
from sluice.driver.weight_sync import ServedWeights
from sluice.engines.rollout.dispatcher import DispatcherClient
from sluice.engines.rollout.messages import Handoff, StreamSettings
from sluice.engines.rollout.worker import RolloutWorkerClient

log = logging.getLogger("sluice")

# A checkpoint waits this long at most for the workers' groups in flight (they send them at
# their next report, every 0.5 s or so), asking the dispatcher every KEEP_POLL_S.
KEEP_WAIT_S = 10.0
KEEP_POLL_S = 0.05


class StreamRollouts:
    """``async``: workers stream continuously from a dispatcher, bounded by max_staleness."""

    def __init__(
        self,
        cfg: RunConfig,
        workers: list[RolloutWorkerClient],
        dispatcher: DispatcherClient,
        wait: Waiter,
        served: ServedWeights,
        tag: str = "",
    ) -> None:
        self.cfg, self.workers, self.dispatcher, self.wait = cfg, workers, dispatcher, wait
        self.served = served  # what each worker serves, against what was published
        self.settings = [stream_settings(cfg, i) for i in range(len(workers))]
        self.tag = tag  # group ids of a resumed run (the dispatcher applies it)
        self.refs: list[Any] = []  # one stream per worker while streaming (None: restarting)
        self.last: dict[int, dict[str, float]] = {}  # each worker's counters at the last drain
        self.restarts = Restarts(workers, cfg.rollout.max_restarts)
        self.restarting: set[int] = set()  # died; its stream resumes once Ray has it back
        self.failures = RewardFailures()
        self.requeued = 0  # groups (episodes) a dead worker held, since the last drain
        self.dispatcher_at = 0  # the dispatcher's process at the last drain

    def start(self) -> None:
        self.dispatcher.resume()
        self.refs = [
            None if i in self.restarting else w.stream(self.dispatcher.handle, s)
            for i, (w, s) in enumerate(zip(self.workers, self.settings, strict=True))
        ]

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that answer now; with none left, waits for the first one back."""
        if len(self.restarting) == len(self.workers):
            first = min(self.restarting)
            self.restarts.wait_back(first)
            self.restarting.discard(first)
        return [w for i, w in enumerate(self.workers) if i not in self.restarting]

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """Its stream was stopped; it streams again once Ray has it back (``check``)."""
        handed_back = f"it was loading version {step}; {{lost}} groups go back to the queue"
        self._lost(self.workers.index(worker), error, handed_back)

    def check(self) -> None:
        """Restart the stream of a worker that died or whose stream failed.

        A stream that raised counts as its worker's failure too: a node that goes away can
        fail the call with the worker's own error (a broken connection to its raylet)
        before Ray reports the actor dead. Its groups go back to the queue and the stream
        starts again; each counts against ``rollout.max_restarts``, so an error that
        repeats fails the run, named."""
        for i in sorted(self.restarting):
            if self.restarts.back(i):  # it pulls the newest weights before generating
                self.restarting.discard(i)
                self._hand_back_stale(i)
                if self.refs:  # streaming; between stop and start, start gives it one
                    self.refs[i] = self.workers[i].stream(self.dispatcher.handle, self.settings[i])
        live = [r for i, r in enumerate(self.refs) if i not in self.restarting]
        done, _ = ray.wait(live, num_returns=len(live), timeout=0)
        for ref in done:
            try:
                ray.get(ref)  # a stream that ended early: its worker died or it raised
            except (RayActorError, RayTaskError) as error:
                i = self.refs.index(ref)
                self._lost(i, error, "its {lost} unfinished groups go back to the queue")

    def _lost(self, i: int, error: RayError, handed_back: str) -> None:
        """Worker ``i`` died: its groups go back to the queue and Ray restarts it. Counted
        once per death: ``check``, called while ``stop`` waits, can see the same one first.
        ``handed_back`` may name ``{lost}``, the number of groups requeued."""
        if i in self.restarting:
            return
        lost = self.dispatcher.requeue(i)
        self.requeued += lost
        self.restarts.died(i, error, handed_back.format(lost=lost))
        self.restarting.add(i)

    def _hand_back_stale(self, i: int) -> None:
        """A ``take`` the dead worker ``i`` sent before it died can reach the dispatcher
        after its groups were requeued, and is answered with groups nobody will run:
        hand those back too (recorded dropped, prompts requeued) before ``i`` streams again
        or the run ends."""
        lost = self.dispatcher.requeue(i)
        self.requeued += lost
        if lost:
            log.info(
                "rollout worker %d: %d groups given to it after it died go back to the queue",
                i,
                lost,
            )

    def drain(self, step: int, dropped_groups: int = 0) -> dict[str, float]:
        """Rollout metrics since the last step; ``step`` is the trainer's version now.

        ``dropped_groups``: groups the store dropped since the last step; their admission
        places go back to the dispatcher.
        """
        if dropped_groups:
            self.dispatcher.credit(dropped_groups)
        state = self.dispatcher.drain()
        if state["incarnation"] != self.dispatcher_at and state["restored"]:
            restarts = self.cfg.rollout.dispatcher_restarts
            log.warning("%s (rollout.dispatcher_restarts=%d)", state["restored"], restarts)
        self.dispatcher_at = state["incarnation"]
        t = state["totals"]
        metrics: dict[str, float] = {}
        if t.samples:
            metrics.update(
                {
                    "rollout/reward": t.reward_sum / t.samples,
                    "rollout/accuracy": t.correct / t.samples,
                    "rollout/response_length": t.tokens / t.samples,
                    "rollout/truncated": t.truncated / t.samples,
                    "rollout/reward_errors": float(t.reward_errors),
                    "rollout/groups": float(t.groups),
                    **reward_function_metrics(t.reward_metrics, t.samples - t.reward_errors),
                }
            )
        self.failures.show(t.reward_messages)
        metrics["rollout/repacked_groups"] = float(t.repacked)
        # Groups a dead worker held, started again from their prompt on another (episodes
        # of a multi-turn environment or an agent included).
        metrics["rollout/requeued_groups"], self.requeued = float(self.requeued), 0
        episodes: dict[str, float] = {}  # multi-turn counters, summed over the workers
        for w, c in state["workers"].items():
            before = self.last.get(w, {})
            if before.get("pid") != c["pid"]:  # a restarted worker counts from zero again
                log.info("rollout worker %d streams in process %d", w, int(c["pid"]))
                before = {}
            delta = {k: v - before.get(k, 0.0) for k, v in c.items()}
            busy, idle = delta["busy_s"], delta["idle_s"]
            if busy + idle > 0:
                metrics[f"rollout/worker{w}/idle_fraction"] = idle / (busy + idle)
            metrics[f"rollout/worker{w}/version_lag"] = step - c["version"]
            for warning in self.served.check(w, int(c["version"]), c["weights_digest"], step):
                log.warning(warning)
            metrics[f"rollout/worker{w}/weight_pull_s"] = delta["pull_s"]
            metrics[f"rollout/worker{w}/weight_loads"] = delta["weight_loads"]
            metrics[f"rollout/worker{w}/weight_pull_failures"] = delta["weight_pull_failures"]
            for name, value in delta.items():
                if name in EPISODE_COUNTERS or name.startswith("tool_errors/"):
                    episodes[name] = episodes.get(name, 0.0) + value
            self.last[w] = c
        metrics.update(episode_metrics(episodes, t.samples))
        return metrics

    def stop(self) -> None:
        """No more work is given out; every worker finishes what it holds and returns (a
        held-out evaluation needs vLLM; ``start`` sets the streams going again)."""
        self.dispatcher.stop()
        for i, ref in enumerate(self.refs):
            if i in self.restarting:
                self._hand_back_stale(i)
                continue  # `check` or the next `start` gives it a stream once it is back
            try:
                self.wait(ref, "rollout workers to finish their running samples")
            except (RayActorError, RayTaskError) as error:  # no more work is given out
                self._lost(i, error, "no new work was being handed out")
        self.refs = []
        if lost := self.dispatcher.settle():  # see GroupDispatcher.settle
            log.warning(
                "%d groups in flight when the dispatcher restarted were held by no rollout "
                "worker (theirs died meanwhile); recorded dropped",
                lost,
            )

    def placed(self, waiting: set[int]) -> None:
        """Workers no node has room for yet join like restarted ones once Ray places them."""
        self.restarting |= waiting

    def in_flight(self) -> list[Handoff]:
        """Every group in flight as it stands, for a checkpoint: each worker holding groups
        sends them at its next report (``GroupDispatcher.snapshot``); one that dies owes
        nothing (its groups go back to the queue). A worker that has not sent them within
        ``KEEP_WAIT_S`` is named, and its groups start over after a resume from this
        checkpoint."""
        snapshot = self.dispatcher.snapshot()
        deadline = time.monotonic() + KEEP_WAIT_S
        groups, owed = self.dispatcher.in_flight(snapshot)
        while owed and time.monotonic() < deadline:
            time.sleep(KEEP_POLL_S)  # the workers answer at their next report
            self.check()  # a worker that died owes nothing: its groups went back to the queue
            groups, owed = self.dispatcher.in_flight(snapshot)
        if owed:
            log.warning(
                "rollout worker(s) %s did not send their groups in flight within %.0f s: "
                "after a resume from this checkpoint theirs start over",
                ", ".join(map(str, owed)),
                KEEP_WAIT_S,
            )
        return groups

    def cursor(self) -> dict[str, Any]:
        return self.dispatcher.cursor()

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        admitted = step * self.cfg.rollout.prompts_per_step + held_groups
        self.dispatcher.restart_at(cursor, admitted, self.tag)


def stream_settings(cfg: RunConfig, worker: int) -> StreamSettings:
    """What worker ``worker``'s stream is told, from the ``rollout`` section."""
    r = cfg.rollout
    return StreamSettings(
        worker=worker,
        samples_per_prompt=r.samples_per_prompt,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        credit=credit_of(cfg),
        concurrency=r.concurrency or r.prompts_per_step * r.samples_per_prompt,
        partial_rollout=r.partial_rollout,
        pull_timeout_s=cfg.weights.pull_timeout_s,
        repack_max_stragglers=r.repack_max_stragglers if r.repack else 0,
    )
