"""The control plane under load: the real trajectory store, dispatcher and parameter relay,
driven by hundreds of real rollout workers on clock engines, beside what the simulator says
64, 256 and 1024 accelerators need at 7B and 32B scale.

Components, in one local Ray session (127.0.0.1), fresh controllers for every load level:

- Under test, the real actors: ``storage.trajectory_store.TrajectoryStore`` (its ledger in a
  local folder, flushed at every ack), ``engines.rollout.dispatcher.Dispatcher`` (admission,
  skew-aware dispatch over every worker's reported load, a ``dispatched`` ledger event per sample
  sent to the store) and a ``storage.params.ParameterService`` relay.
- ``WorkerHost`` actors (``HOSTS``), each running its share of the rollout workers as threads:
  the real ``engines/rollout/worker.py: RolloutWorker`` and its stream loop
  (``engines/rollout/stream_loop.py: StreamLoop``), scoring with an environment's verifier,
  with the engine replaced by a clock (``ClockEngine``): a request generates for its drawn
  response length (the simulator's 7B workload, about 4k tokens on average, 512 prompt
  tokens, 12 bytes a token in a row) at a pace that gives the level's offered rate. So the
  workers take groups from the dispatcher when a quarter of their slots is free, put finished
  groups as one block within ``PUT_EVERY_S``, report done groups and their load as the
  dispatcher paces them, wait while admission holds them back (``Work.held_until``), and ask
  the relay for newer weights every ``WEIGHT_CHECK_S``, loading a new version between engine
  steps, exactly as in a run; the benchmark only times their calls (``_TimedSource``,
  ``_TimedStore``, ``_TimedParams``).
- ``Trainer``, the trainer's stand-in (``flows/rl_job.py: rl_step``) on a thread of the
  driver: each step it reads the store's counters, leases a batch of whole groups, reads the
  rows, waits ``--step-s``, publishes the next weight version (4 MB), acknowledges the lease,
  gives the admission of groups dropped as stale back to the dispatcher and drains the
  dispatcher's totals.
- The driver (``main``) runs the levels, reads each process's CPU time (psutil) over a window
  after the warm-up, stops a level cleanly and checks that the ledger has every dispatched
  sample trained or dropped exactly once, runs the call-rate probes, profiles the store and
  the dispatcher with py-spy during each level, and derives from ``benchmarks/sim_scale.py``
  what the control plane must serve at scale (``Demand``).

A level's sustained rate is acknowledged samples per second; it is saturated when it falls
short of the offered rate. After the levels comes the ramp: as many workers as the largest
simulated demand has engines (7B on 1024 accelerators: 418), offered that demand's rate for
RAMP_FIRST_S (a minute), then two, three and four times it, which shows the rate at which
the control plane stops keeping up, measured rather than projected. On 2 cores the rollout
workers, the trainer and Ray's own processes share the machine with the controllers, so the
report also projects each controller's load at scale: the simulator's demand times the CPU
each unit of work cost here (a sample through the store, a held take, a report, a take at
the cell's shape measured in process with its ledger events sent to a real store, a relay
check), a node's relay answering the engines on its node (``weights.relays: per_node``). A
controller runs its calls one at a time and also waits (the dispatcher, for the store to
take the previous take's ledger events), which CPU time leaves out: the projected load is a
lower bound.

Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and puts
the section in BENCHMARKS.md ("Control plane under load").

    .venv/bin/python -m benchmarks.control_plane            # about 9 minutes
    .venv/bin/python -m benchmarks.control_plane --quick    # about 55 s, smoke use
    .venv/bin/python -m benchmarks.control_plane --write    # and keeps it
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import ray
import torch

from benchmarks.records import Record, publish
from benchmarks.sim_scale import GROUP, GROUPS_PER_STEP, PROMPT_TOKENS, SIZES, WORKLOADS
from benchmarks.sim_scale import scenario as scale_scenario
from benchmarks.tables import markdown_table, span
from sluice.engines.protocols import Completion, Delta
from sluice.engines.rollout.dispatcher import (
    LOOKAHEAD_STEPS,
    REPORTS_PER_S,
    Dispatcher,
    GroupDispatcher,
)
from sluice.engines.rollout.messages import GroupDone, StreamSettings
from sluice.engines.rollout.stream_loop import PUT_EVERY_S, PUT_GROUPS, REFILL_AT
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs import Problem, RewardResult
from sluice.envs.scoring import VerifierScorer
from sluice.rl.advantages import Credit
from sluice.sim.engine import simulate
from sluice.sim.lengths import draw_lengths
from sluice.sim.results import SimResult
from sluice.sim.scenario import ClusterSpec
from sluice.storage.batches import TRAIN_FIELDS
from sluice.storage.ledger import Ledger, LedgerEvent, check_exactly_once, dispatch_accounting
from sluice.storage.params import (
    NamedTensors,
    ParameterError,
    ParameterService,
    PendingPull,
    PullFailed,
)
from sluice.storage.trajectory_store import (
    DispatchRecovery,
    StoreClient,
    create_store,
    materialize,
)

ROOT = Path(__file__).parents[1]
ENV = "control-plane"
# Processes the rollout workers are spread over: two keep one host's GIL from being the
# limit (a worker needs a few ms of Python a group) and leave the cores to the controllers.
HOSTS = 2
# Groups' worth of samples a worker runs at once (its concurrency over the group). A 7B
# engine holds 16 groups and asks for 4 at a time, a 32B one holds 5 and asks for 2
# (REFILL_AT); 2 slots ask for one group a take, the most control-plane calls per sample.
SLOTS = 2
# The trainer leases what the offered rate makes in this long, so a short measurement window
# holds several steps (the sim's recipe, 512 groups of 16, would be 2-16 s a step here); the
# store's work per sample does not depend on it.
STEP_EVERY_S = 1.0
# A weight version is one 4 MB bucket: a relay's work per check does not depend on the size,
# and pulling a large version is the data plane (benchmarks/params.py).
WEIGHTS_MB = 4
# The real worker asks its relay every StreamSettings.weight_check_s (0.1 s). With 512
# workers on 2 cores that alone is 5k relay calls/s, which would starve the store
# under test; the relay probe measures what a relay can answer, against the 0.1 s demand.
WEIGHT_CHECK_S = 1.0
# The real worker's timing, as the flow leaves it (driver/stream.py: stream_settings).
_REAL = StreamSettings(worker=0, samples_per_prompt=GROUP, max_new_tokens=1, temperature=1.0,
                       credit=Credit(scale_by_std=False), concurrency=1)  # fmt: skip
REAL_WEIGHT_CHECK_S = _REAL.weight_check_s
REPORT_EVERY_S = _REAL.report_every_s
# A clock engine's longest step: a decode step of a large engine takes tens of ms; 0.1 s
# keeps the loops of 512 simulated engines from taking the cores the controllers are
# measured on, and a request due sooner ends the step when it is due.
ENGINE_STEP_S = 0.1
# Responses are cut at 16,384 tokens, 3.9 times the 7B workload's mean: a group lasts at
# most about this many times a sample's mean.
LONGEST_OVER_MEAN = 4
ANSWER_RESOLUTION_S = 0.005  # a weight check's time to its answer is timed to this
LENGTH_POOL = 4096  # response lengths a clock engine draws from (the 7B workload's)
MAX_NEW_TOKENS = WORKLOADS["7B"].lengths.max_tokens
# Longest the warm-up waits for the dispatcher to load the fleet; a level whose fleet is not
# loaded by then is measured as it is.
WARMUP_TIMEOUT_S = 20.0
BYTES_PER_TOKEN = 12  # of a response token in a row: id, behaviour log-prob, policy version
LEASE_WAIT_S = 0.25  # the trainer looks at its stop flag this often while waiting for data
STOP_TIMEOUT_S = 60.0
# Accelerators a node: a relay on each node answers the engines there (8-GPU nodes).
NODE_ACCELERATORS = 8
NEVER = 2**62  # a version no relay holds: "anything newer?" is answered "no"
UNBOUNDED = 10**9  # a staleness bound admission never reaches (the take probe)
OBJECT_STORE_BYTES = 6 << 30
PROFILE_RATE = 50  # py-spy samples per second: about 1% of a core, without pausing the target
# The policies whose demand is derived (fields of sim.scenario's policy, over sim_scale.py's
# defaults): Sluice's defaults (sluice/config/tree.py), and the loosest bound sim_scale.py tries,
# for which it predicts the most samples per second.
DEMAND_POLICIES: dict[str, dict[str, Any]] = {
    "async k=2 +dispatch +repack": {
        "mode": "async", "max_staleness": 2, "long_first": True, "balance": True, "repack": True
    },
    "async k=16 +dispatch": {
        "mode": "async", "max_staleness": 16, "long_first": True, "balance": True
    },
}  # fmt: skip
# A level is saturated when it carries less than this share of its offered rate, or when it
# grows less than SATURATION_GROWTH times over the level before.
SATURATION_SHARE = 0.9
SATURATION_GROWTH = 1.1
# Headroom below this many times the 1024-accelerator demand: time to shard the controller.
SAFE_HEADROOM = 3.0
FULL_LEVELS = "64:1000 256:1500 512:1500"
QUICK_LEVELS = "32:500 128:1500"
# The ramp: the largest simulated demand (its engines, its samples/s) times these, after the
# levels; the first held for RAMP_FIRST_S, the rest for --window each.
RAMP = (1, 2, 3, 4)
RAMP_FIRST_S = 60.0


# -- pure parts: latencies, demand, ceilings -----------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """Nearest-rank percentiles of a set of latencies, in seconds."""

    count: int
    p50: float
    p99: float

    def ms(self) -> str:
        return f"{self.p50 * 1e3:.1f} / {self.p99 * 1e3:.1f}" if self.count else "-"

    def to_dict(self) -> dict[str, Any]:
        """The count and percentiles as JSON holds them: None for no latencies (nan)."""
        return asdict(self) if self.count else {"count": 0, "p50": None, "p99": None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Latency:
        """The latency ``to_dict`` wrote: nan percentiles for no latencies."""
        if not data["count"]:
            return cls(0, math.nan, math.nan)
        return cls(data["count"], data["p50"], data["p99"])


def percentile(values: Sequence[float] | np.ndarray, p: float) -> float:
    """The nearest-rank ``p``-th percentile: the smallest value with at least p% of the values
    at or below it; nan for no values."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not len(values):
        return math.nan
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[math.ceil(p / 100 * len(ordered)) - 1])


def summarise(values: Sequence[float] | np.ndarray) -> Latency:
    return Latency(len(values), percentile(values, 50), percentile(values, 99))


@dataclass(frozen=True)
class Demand:
    """What the control plane must serve for one simulated cell (model x accelerators x
    policy): the simulator's rates, turned into calls by the real worker's call pattern."""

    model: str
    accelerators: int
    policy: str
    engines: int
    concurrency: int  # requests per engine
    samples_s: float  # samples trained or dropped a second: each was put into the store
    trained_s: float
    accelerators_per_engine: int = 1
    group: int = GROUP
    groups_per_step: int = GROUPS_PER_STEP

    @property
    def groups_s(self) -> float:
        return self.samples_s / self.group

    @property
    def puts_s(self) -> float:
        """A worker puts its finished groups at least every PUT_EVERY_S, at most PUT_GROUPS a
        block: at well under one group per engine per PUT_EVERY_S, one put per group."""
        per_engine = self.groups_s / self.engines
        return self.groups_s / min(PUT_GROUPS, max(1.0, per_engine * PUT_EVERY_S))

    @property
    def groups_per_take(self) -> int:
        """A worker asks once REFILL_AT of its requests are free, for that many groups."""
        return max(1, math.ceil(REFILL_AT * self.concurrency / self.group))

    @property
    def takes_s(self) -> float:
        """Takes that bring work."""
        return self.groups_s / self.groups_per_take

    @property
    def leases_s(self) -> float:
        """One lease, one ack and one weight version per training step."""
        return self.trained_s / (self.groups_per_step * self.group)

    @property
    def reports_s(self) -> float:
        """Every engine every report_every_s, paced by the dispatcher to REPORTS_PER_S."""
        return min(self.engines / REPORT_EVERY_S, REPORTS_PER_S)

    @property
    def checks_s(self) -> float:
        """Every engine asks its relay for newer weights every weight_check_s."""
        return self.engines / REAL_WEIGHT_CHECK_S

    @property
    def checks_per_relay_s(self) -> float:
        """The weight checks a node's relay answers (``weights.relays: per_node``): those of
        the engines on its node, NODE_ACCELERATORS accelerators a node."""
        per_node = min(self.engines, max(1, NODE_ACCELERATORS // self.accelerators_per_engine))
        return per_node / REAL_WEIGHT_CHECK_S

    @property
    def pulls_s(self) -> float:
        """Every engine pulls every version once."""
        return self.engines * self.leases_s

    @property
    def held_takes_s(self) -> float:
        """Takes admission answers empty, at most: a held engine asks again once it holds the
        version the answer named (``Work.held_until``), so once a version at most."""
        return self.engines * self.leases_s


def demand_of(
    model: str, accelerators: int, policy: str, result: SimResult, cluster: ClusterSpec
) -> Demand:
    """The control-plane demand of one simulated run in its steady state (the warm-up
    steps, where a pipelined policy is still filling, left out): a batch per steady step
    trained, and the samples dropped on top in the run's proportion."""
    trained_s = GROUPS_PER_STEP * GROUP / result.steady_step_s
    ended = (result.trained_samples + result.dropped_samples) / max(result.trained_samples, 1)
    return Demand(
        model=model,
        accelerators=accelerators,
        policy=policy,
        engines=cluster.instances,
        concurrency=cluster.max_concurrency,
        samples_s=trained_s * ended,
        trained_s=trained_s,
        accelerators_per_engine=cluster.accelerators_per_instance,
    )


def simulated_demand(steps: int, sizes: Sequence[int] = SIZES) -> list[Demand]:
    """The demand of every model x size under each of ``DEMAND_POLICIES``."""
    out = []
    for name in WORKLOADS:
        for size in sizes:
            for label, policy in DEMAND_POLICIES.items():
                sc = scale_scenario(name, size, label, policy, steps)
                out.append(demand_of(name, size, label, simulate(sc), sc.cluster))
    return out


def headroom(ceiling: float, demand: float) -> float:
    """How many times the demand a ceiling carries (inf when nothing is demanded)."""
    if ceiling < 0 or demand < 0:
        raise ValueError(f"rates must be >= 0, got ceiling {ceiling} and demand {demand}")
    return math.inf if demand == 0 else ceiling / demand


def projected(rate: float, cpu_shares: Sequence[float]) -> float:
    """``rate`` scaled to a whole core for the busiest controller: ``rate / max(shares)``."""
    busiest = max(cpu_shares, default=0.0)
    return math.inf if busiest <= 0 else rate / busiest


@dataclass(frozen=True)
class Costs:
    """CPU seconds the controllers spend per unit of work, as measured here."""

    store_per_sample: float  # all of the store's work, over the samples it carried
    call: float  # the dispatcher's cost of one call that does nothing (a held-back take)
    report: float  # the dispatcher's cost of one report (counters, no groups)
    relay_per_check: float
    take: dict[tuple[int, int], float]  # (engines, groups a take) -> a take's own work

    def store(self, d: Demand) -> float:
        """Cores the store is busy at ``d``."""
        return d.samples_s * self.store_per_sample

    def dispatcher(self, d: Demand) -> float:
        """Cores the dispatcher is busy at ``d``: takes that bring work, reports, and takes
        admission answers empty."""
        take = self.take[d.engines, d.groups_per_take] + self.call
        return d.takes_s * take + d.reports_s * self.report + d.held_takes_s * self.call

    def relay(self, d: Demand) -> float:
        """Cores a node's relay is busy at ``d`` answering its engines' weight checks."""
        return d.checks_per_relay_s * self.relay_per_check

    def one_relay(self, d: Demand) -> float:
        """Cores a single relay would be busy answering every engine (``weights.relays: 1``)."""
        return d.checks_s * self.relay_per_check


class _NoLedger:
    """A ``LedgerSink`` that keeps nothing: the in-process take costs the dispatcher alone."""

    def record(self, events: list[LedgerEvent], wait: bool = True) -> None:
        """Dropped: the take's cost is measured without a ledger."""

    def settle_records(self) -> None:
        """Nothing is ever in flight."""

    def journal(self, state: dict[str, Any]) -> None:
        """Dropped, like the events."""

    def recovery(self) -> DispatchRecovery | None:
        return None


def take_cost(
    engines: int,
    want: int,
    groups_per_step: int = GROUPS_PER_STEP,
    takes: int = 10,
    ledger: Any = None,
) -> float:
    """Seconds one ``take`` of ``want`` groups costs the real dispatcher (``GroupDispatcher``,
    in this process) once ``engines`` workers have reported their loads and its look-ahead
    pool is full, as at scale: building a request per pooled group, planning them over every
    worker (``rl.dispatch.plan``) and sending the ``dispatched`` ledger events to ``ledger``
    (a ``StoreClient`` of a real store, as in a run; None: dropped)."""
    sink = ledger or _NoLedger()
    dispatcher = GroupDispatcher(
        sink, _Prompts(), ENV, groups_per_step, GROUP, UNBOUNDED, 0, long_first=True,
        balance=True, prior_length=float(WORKLOADS["7B"].lengths.median),
    )  # fmt: skip
    for w in range(engines):
        counters = {"in_flight_tokens": 1e3 * w, "free_groups": float(want), "version": 0.0}
        dispatcher.report(w, [], counters)
    dispatcher.take(0, want, 0)  # fills the pool
    clock = time.perf_counter()
    for i in range(takes):
        dispatcher.take(i % engines, want, 0)
    sink.settle_records()  # the store has taken every take's events
    return (time.perf_counter() - clock) / takes


def take_costs(shapes: Iterable[tuple[int, int]], folder: Path) -> dict[tuple[int, int], float]:
    """``take_cost`` at each (engines, groups a take) shape, its ledger events going to a real
    trajectory store (a fresh one a shape, its ledger under ``folder``)."""
    costs = {}
    for i, shape in enumerate(sorted(shapes)):
        (folder / f"takes-{i}").mkdir(parents=True)
        store = create_store(f"file://{folder / f'takes-{i}'}", capacity=GROUP)
        try:
            costs[shape] = take_cost(*shape, ledger=StoreClient(store))
        finally:
            ray.kill(store)
    return costs


@dataclass(frozen=True)
class Ceiling:
    samples_s: float  # the best acknowledged rate of any level
    saturated: list[str]  # why the load stopped growing (empty: it never did)


def find_ceiling(levels: Sequence[LevelResult]) -> Ceiling:
    """The best level, and the signs of saturation: a level carrying less than
    SATURATION_SHARE of its offered rate, growing less than SATURATION_GROWTH times over the
    level before, or with a controller at SATURATION_SHARE of a core."""
    if not levels:
        raise ValueError("no levels measured")
    best = max(levels, key=lambda r: r.acked_s)
    signs = []
    for before, level in zip([None, *levels], levels, strict=False):
        name = f"{level.workers} workers"
        if level.acked_s < SATURATION_SHARE * level.offered:
            signs.append(f"{name} carried {level.acked_s / level.offered:.0%} of the offered rate")
        if before is not None and 0 < level.acked_s < SATURATION_GROWTH * before.acked_s:
            signs.append(f"{name} carried {level.acked_s / before.acked_s:.2f}x the level before")
        busiest = max(level.cpu, key=lambda k: level.cpu[k])
        if level.cpu[busiest] >= SATURATION_SHARE:
            signs.append(f"{name}: the {busiest} used {level.cpu[busiest]:.0%} of a core")
    return Ceiling(best.acked_s, signs)


def top_frames(lines: Sequence[str], root: Path = ROOT, count: int = 6) -> list[tuple[str, float]]:
    """The functions of this repository that a thread of a py-spy ``raw --threads --idle``
    profile spends the most of its wall time in, inclusive, as shares of that thread's
    samples (the busiest thread's share for a function several threads run)."""
    per_thread: Counter[str] = Counter()
    hits: Counter[tuple[str, str]] = Counter()
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        thread, *frames = stack.split(";")
        per_thread[thread] += int(count_text)
        for frame in {_ours(f, root) for f in frames} - {None}:
            hits[thread, frame] += int(count_text)  # type: ignore[index]
    shares: dict[str, float] = {}
    for (thread, frame), n in hits.items():
        shares[frame] = max(shares.get(frame, 0.0), n / per_thread[thread])
    return sorted(shares.items(), key=lambda item: -item[1])[:count]


def _ours(frame: str, root: Path) -> str | None:
    """``TrajectoryStore.put (storage/trajectory_store.py)`` from py-spy's
    ``put (/repo/storage/trajectory_store.py:210)``; None for code outside ``root``."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    prefix = f"{root}/"
    if not path.startswith(prefix) or "/.venv/" in path:
        return None
    return f"{name} ({path.removeprefix(prefix)})"


# -- rollout workers on clock engines -------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What the rollout workers of one level do."""

    workers: int
    offered: float  # samples/s they generate together when nothing holds them back
    group: int = GROUP
    slots: int = SLOTS
    weight_check_s: float = WEIGHT_CHECK_S

    @property
    def running(self) -> float:
        """Samples a worker runs on average: it has room for ``slots`` groups' worth and
        takes whole groups, so it runs between one group fewer and that many."""
        return (self.slots - 0.5) * self.group

    @property
    def generation_s(self) -> float:
        """Mean seconds a sample generates (Little's law: samples running over the rate)."""
        return self.workers * self.running / self.offered

    @property
    def groups_per_step(self) -> int:
        """The trainer's lease: the groups the offered rate makes in STEP_EVERY_S, in 8s, and
        enough that the dispatcher's look-ahead pool (LOOKAHEAD_STEPS steps) holds a group per
        worker, as the sim's recipe does at scale (1024 pooled groups, at most 418 engines).
        The dispatcher plans its whole pool over every worker that reported room and hands an
        asker only its share: with more such workers than pooled groups, an asker that ties
        with them (no load) is handed nothing."""
        by_rate = round(self.offered * STEP_EVERY_S / self.group / 8) * 8
        by_pool = math.ceil(self.workers / LOOKAHEAD_STEPS / 8) * 8
        return max(8, by_rate, by_pool)

    @property
    def max_staleness(self) -> int:
        """Admission wide enough never to hold a worker back, and a bound that neither a long
        generation nor the weight-check interval reaches: what is measured is the
        controllers, not the bound. A group lasts as long as its longest sample, at most
        LONGEST_OVER_MEAN times a sample's mean, so a worker holds up to that many times
        ``slots`` groups part-done."""
        in_flight = self.workers * self.slots * LONGEST_OVER_MEAN
        admitted = math.ceil(in_flight / self.groups_per_step)
        versions = math.ceil(
            (LONGEST_OVER_MEAN * self.generation_s + self.weight_check_s) / STEP_EVERY_S
        )
        return max(2, admitted, versions) + 1


class ClockEngine:
    """A ``StreamingRolloutEngine`` whose requests take clock time instead of a model's:
    what the real rollout worker (``RolloutWorker.stream``, ``StreamLoop``) runs here, so
    every call the benchmark makes on the controllers is the real worker's.

    A request's response length is drawn from the simulator's 7B workload (one pool of
    ``LENGTH_POOL`` lengths) and it generates for that length times ``per_token_s``: a
    sample lasts ``load.generation_s`` on average, a group as long as its longest sample
    (about 3.2 times that). ``step`` waits for the next request due, at most
    ``ENGINE_STEP_S``, and returns the finished ones whole (the tokens of a response come
    from one template list). The first ``warm`` requests are part-way through already, so
    that samples finish at the steady rate as soon as the fleet is loaded; once ``hurry`` is
    set (the level ends), everything running finishes at the next step.
    """

    def __init__(self, load: Load, lengths: np.ndarray, seed: int, hurry: threading.Event) -> None:
        self.rng = np.random.default_rng(seed)
        self.hurry = hurry
        self.lengths = lengths
        self.per_token_s = load.generation_s / float(lengths.mean())
        self.tokens = (np.arange(int(self.lengths.max())) % 30000 + 3).tolist()
        self.logprobs = [-0.5] * len(self.tokens)
        self.prompt = list(range(3, PROMPT_TOKENS + 3))
        self.warm = load.slots * load.group
        self.due: list[tuple[float, str]] = []  # heap of (due, request)
        self.running: dict[str, tuple[float, float, int]] = {}  # request: started, due, length
        self._version = 0

    def start(
        self, request_id: str, prompt_ids: list[int], max_new_tokens: int, temperature: float,
        seed: int,
    ) -> None:  # fmt: skip
        length = min(int(self.lengths[self.rng.integers(len(self.lengths))]), max_new_tokens)
        took = length * self.per_token_s
        if self.warm:
            took, self.warm = took * self.rng.uniform(), self.warm - 1
        now = time.monotonic()
        self.running[request_id] = (now, now + took, length)
        heapq.heappush(self.due, (now + took, request_id))

    def step(self) -> list[Delta]:
        now = time.monotonic()
        if not self.hurry.is_set():
            first = self.due[0][0] if self.due else now + ENGINE_STEP_S
            time.sleep(min(max(first - now, 0.0), ENGINE_STEP_S))
            now = time.monotonic()
        out = []
        while self.due and (self.hurry.is_set() or self.due[0][0] <= now):
            _, request = heapq.heappop(self.due)
            if request in self.running:  # not aborted
                length = self.running.pop(request)[2]
                out.append(
                    Delta(request, self.tokens[:length], self.logprobs[:length], True, "stop")
                )
        return out

    def generated(self, request_id: str) -> int | None:
        if request_id not in self.running:
            return None
        started, due, length = self.running[request_id]
        share = (time.monotonic() - started) / max(due - started, 1e-9)
        return min(length, int(length * share))

    def abort(self, request_ids: list[str]) -> None:
        for request in request_ids:
            self.running.pop(request, None)  # its heap entry is skipped when due

    def decode(self, token_ids: list[int]) -> str:
        return "odd" if len(token_ids) % 2 else "even"  # what ``_Env`` rewards

    def encode(self, text: str) -> list[int]:
        return []

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        return [self.prompt for _ in prompts]

    def load_weights(self, weights: NamedTensors | list[bytes], version: int) -> None:
        # Each tensor read as an engine reads it (bucket by bucket out of the object store);
        # the copy into a model is the data plane's (benchmarks/weights.py).
        try:
            self.tensors_read = sum(1 for _ in weights)
        except ParameterError as err:
            # A bucket gone half way through the read (Ray has freed objects a borrower
            # still held under this load): a real engine would hold part of the version and
            # its worker fail; a clock holds no weights, so it stays on its version and the
            # stream loop logs the skip ("skips version", in the host's log).
            raise PullFailed(str(err)) from err
        self._version = version

    def version(self) -> int:
        return self._version

    def generate(
        self, prompts: list[str], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        """``n`` samples of each prompt, started together and stepped until all are done."""
        for i in range(len(prompts)):
            for j in range(n):
                self.start(f"generate-{i}/{j}", self.prompt, max_new_tokens, temperature, seed)
        done: dict[str, Delta] = {}
        while len(done) < len(prompts) * n:
            done.update((d.request_id, d) for d in self.step())
        return [
            [
                Completion(d.token_ids, d.logprobs, self.decode(d.token_ids), True)
                for d in (done[f"generate-{i}/{j}"] for j in range(n))
            ]
            for i in range(len(prompts))
        ]


def length_pool() -> np.ndarray:
    """``LENGTH_POOL`` response lengths of the simulator's 7B workload."""
    rng = np.random.default_rng(0)
    drawn = draw_lengths(WORKLOADS["7B"].lengths, LENGTH_POOL // GROUP, GROUP, rng)
    return drawn.astype(int).ravel()


class _Env:
    """The benchmark's environment: a response of odd length is right (about half are, as
    the workload's groups need both for an advantage)."""

    name = ENV

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        return _Prompts().take(n)  # distinct synthetic prompts, as the dispatcher's

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        return RewardResult(float(completion == "odd"), completion == "odd")


# (wall time when the call started, seconds it took, a count: groups, samples or pulls)
Call = tuple[float, float, int]


@dataclass
class _Calls:
    takes: list[Call] = field(default_factory=list)  # count: groups given
    puts: list[Call] = field(default_factory=list)  # count: samples
    checks: list[Call] = field(default_factory=list)  # count: 1
    reports: list[Call] = field(default_factory=list)  # count: groups reported


def _timed(ref: ray.ObjectRef, calls: list[Call], count: Callable[[Any], int]) -> ray.ObjectRef:
    """``ref``, a call sent now; once answered, (its start, seconds to the answer,
    ``count(answer)``) goes into ``calls``."""
    started, clock = time.time(), time.perf_counter()

    def answered(future: Future[Any]) -> None:
        took = time.perf_counter() - clock
        calls.append((started, took, count(future.result()) if future.exception() is None else 0))

    ref.future().add_done_callback(answered)
    return ref


class _TimedSource:
    """The dispatcher's handle as a worker's ``GroupSource``, each take and report
    recorded."""

    class _Method:
        def __init__(self, send: Any, record: Callable[..., Any]) -> None:
            self.send, self.record = send, record

        def remote(self, *args: Any) -> ray.ObjectRef:
            return self.record(self.send.remote(*args), *args)

    def __init__(self, dispatcher: Any, calls: _Calls) -> None:
        def take(ref: ray.ObjectRef, *args: Any) -> ray.ObjectRef:
            return _timed(ref, calls.takes, lambda work: len(work.assignments) if work else 0)

        def report(ref: ray.ObjectRef, worker: int, done: list[GroupDone], *_: Any) -> Any:
            calls.reports.append((time.time(), 0.0, len(done)))  # unanswered, as the worker's
            return ref

        self.take = self._Method(dispatcher.take, take)
        self.report = self._Method(dispatcher.report, report)
        self.hand_over = dispatcher.hand_over


class _TimedStore(StoreClient):
    """A worker's store client, each put timed (validating, encoding, the object-store put
    and the store's answer)."""

    def __init__(self, store: StoreClient, calls: list[Call]) -> None:
        super().__init__(store.handle)  # no Parquet copy of the rows: that is the data plane
        self.calls = calls

    def put(self, batch: pa.RecordBatch, group_size: int | None = None) -> int:
        started, clock = time.time(), time.perf_counter()
        number = super().put(batch, group_size)
        self.calls.append((started, time.perf_counter() - clock, batch.num_rows))
        return number


class _Answered:
    """Times calls to their answers without reading them, on a thread of its own that waits
    on every call in flight (to ``ANSWER_RESOLUTION_S``). A relay's answer holds the
    version's object refs: read a second time beside the worker's read, its borrow of them
    can be dropped and the buckets freed under the worker."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[ray.ObjectRef, tuple[float, float, list[Call]]] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="answered", daemon=True)
        self.thread.start()

    def add(self, ref: ray.ObjectRef, calls: list[Call]) -> None:
        with self.lock:
            self.pending[ref] = (time.time(), time.perf_counter(), calls)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.done.is_set():
            with self.lock:
                refs = list(self.pending)
            if not refs:
                self.done.wait(ANSWER_RESOLUTION_S)
                continue
            ready, _ = ray.wait(
                refs, num_returns=len(refs), timeout=ANSWER_RESOLUTION_S, fetch_local=False
            )
            now = time.perf_counter()
            with self.lock:
                for ref in ready:
                    started, clock, calls = self.pending.pop(ref)
                    calls.append((started, now - clock, 1))


class _TimedParams(ParameterService):
    """A worker's parameter-service handle, each "anything newer?" timed to its answer."""

    def __init__(self, params: ParameterService, calls: list[Call], answered: _Answered) -> None:
        super().__init__(
            params.relays, params.node_ids, params.bucket_bytes, params.fetch_timeout, params.dtype
        )
        self.calls, self.answered = calls, answered

    def ask(self, after: int) -> PendingPull:
        asked = super().ask(after)
        self.answered.add(asked.answer, self.calls)
        return asked


def _as_arrays(calls: Sequence[_Calls]) -> dict[str, np.ndarray]:
    """Every worker's calls by kind, as (n, 3) arrays of ``Call`` rows."""
    return {
        kind: np.asarray([row for c in calls for row in getattr(c, kind)], np.float64).reshape(
            -1, 3
        )
        for kind in ("takes", "puts", "checks", "reports")
    }


@ray.remote(num_cpus=0, max_concurrency=2)  # type: ignore[call-overload]  # Ray's stubs lack it
class WorkerHost:
    """A process running real rollout workers on clock engines, a thread each; ``hurry``
    ends a level (after the dispatcher's stop)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.lengths = length_pool()
        self.halt = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def stream(
        self,
        workers: list[int],
        load: Load,
        store: StoreClient,
        dispatcher: Any,
        params: ParameterService,
    ) -> dict[str, np.ndarray]:
        """Run ``workers``' streams until the dispatcher stops them: their calls. A
        worker's error is raised here."""
        self.halt.clear()
        env = _Env()
        answered = _Answered()

        def stream(worker: int) -> _Calls:
            calls = _Calls()
            rollout = RolloutWorker(
                partial(ClockEngine, load, self.lengths, self.seed * 100_003 + worker, self.halt),
                env,
                partial(VerifierScorer, env),
                _TimedStore(store, calls.puts),
                _TimedParams(params, calls.checks, answered),
            )
            settings = StreamSettings(
                worker=worker, samples_per_prompt=load.group, max_new_tokens=MAX_NEW_TOKENS,
                temperature=1.0, credit=Credit(scale_by_std=False),
                concurrency=load.slots * load.group,
                weight_check_s=load.weight_check_s,
            )  # fmt: skip
            rollout.stream(_TimedSource(dispatcher, calls), settings)
            return calls

        try:
            with ThreadPoolExecutor(len(workers), thread_name_prefix="rollout-worker") as pool:
                return _as_arrays(list(pool.map(stream, workers)))
        finally:
            answered.stop()

    def probe(
        self, call: Callable[[int], object], callers: list[int], seconds: float
    ) -> np.ndarray:
        """``call(caller)`` back to back, a thread per caller, for ``seconds``: (wall time,
        seconds) of every call."""

        def loop(caller: int) -> list[tuple[float, float]]:
            out, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                started, clock = time.time(), time.perf_counter()
                call(caller)
                out.append((started, time.perf_counter() - clock))
            return out

        with ThreadPoolExecutor(len(callers), thread_name_prefix="probe") as pool:
            rows = [row for rows in pool.map(loop, callers) for row in rows]
        return np.asarray(rows, dtype=np.float64).reshape(-1, 2)

    def hurry(self) -> None:
        """Every request running finishes at its engine's next step."""
        self.halt.set()


# -- the trainer's stand-in ----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    at: float  # wall time when the ack returned
    samples: int
    lease_s: float  # from the ask to the grant, the wait for a full batch included
    ready: bool  # the batch was in the store when asked: lease_s is the controller's alone
    ack_s: float
    stale: int  # samples the store has dropped as too stale so far


class _Prompts:
    """Distinct synthetic prompts of PROMPT_TOKENS tokens (4 characters each)."""

    def __init__(self) -> None:
        self.issued = 0

    def take(self, count: int) -> list[Problem]:
        first, self.issued = self.issued, self.issued + count
        text = "x" * (4 * PROMPT_TOKENS)
        return [Problem(f"p{i}", ENV, text, "", "train") for i in range(first, self.issued)]

    def cursor(self) -> dict[str, Any]:
        return {"issued": self.issued}

    def restore(self, cursor: dict[str, Any]) -> None:
        self.issued = int(cursor["issued"])


class Trainer:
    """Leases, reads, publishes and acknowledges as ``rl_step`` does, on a thread of the
    driver, until ``stop``."""

    def __init__(
        self,
        store: StoreClient,
        dispatcher: Any,
        params: ParameterService,
        batch: int,
        max_staleness: int,
        step_s: float,
        group: int,
    ) -> None:
        self.store, self.dispatcher, self.params = store, dispatcher, params
        self.batch, self.max_staleness, self.step_s, self.group = (
            batch,
            max_staleness,
            step_s,
            group,
        )
        self.weights = {"w": torch.zeros((WEIGHTS_MB << 20) // 4)}
        self.halt = threading.Event()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.steps = self.thread.submit(self.train)

    def train(self) -> list[Step]:
        steps: list[Step] = []
        version = stale = 0
        while not self.halt.is_set():
            stats = self.store.stats()  # the flow reads the store's counters every step
            if stats["dropped"] > stale:  # their admission places go back
                self.dispatcher.credit.remote((stats["dropped"] - stale) // self.group)
                stale = stats["dropped"]
            clock = time.perf_counter()
            ask = self.store.request(self.batch, version, self.max_staleness, LEASE_WAIT_S)
            grant = ray.get(ask)
            if grant is None:
                continue
            lease_s = time.perf_counter() - clock
            materialize(grant, list(TRAIN_FIELDS))  # the trainer reads the rows
            time.sleep(self.step_s)
            version += 1
            self.params.publish(version, self.weights)
            self.params.wait_snapshot()
            clock = time.perf_counter()
            self.store.ack(grant, version)
            ack_s = time.perf_counter() - clock
            ray.get(self.dispatcher.drain.remote())
            ready = stats["ready"] >= self.batch
            steps.append(Step(time.time(), len(grant.sample_ids), lease_s, ready, ack_s, stale))
        self.params.flush()
        return steps

    def stop(self) -> list[Step]:
        """The steps it took; its error, if it failed."""
        self.halt.set()
        try:
            return self.steps.result(timeout=STOP_TIMEOUT_S)
        finally:
            self.thread.shutdown()


# -- one level --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LevelResult:
    workers: int
    offered: float
    window_s: float
    acked_s: float
    rates: dict[str, float]  # per second: groups, takes, empty takes, puts, reports, checks
    latency: dict[str, Latency]  # take, put, lease, ack, check
    lease_waited: bool  # no batch was waiting when asked: the lease latency holds the waits
    cpu: dict[str, float]  # CPU seconds per wall second of each controller
    others_cpu: dict[str, float]  # of the worker hosts, the trainer, the whole machine
    groups_per_step: int
    max_staleness: int
    stale: int
    stop_s: float  # the clean stop: the workers' groups all put, the store closed
    loaded: tuple[float, int]  # seconds the dispatcher took to load the fleet, groups it did
    ledger: dict[str, int]  # dispatch_accounting of the ledger after the level
    violations: list[str]  # check_exactly_once, with the run finished
    profile: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON holds them (a latency by ``Latency.to_dict``)."""
        latency = {name: v.to_dict() for name, v in self.latency.items()}
        return {**asdict(self), "latency": latency}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LevelResult:
        """The result ``to_dict`` wrote, its tuples (JSON's lists) tuples again."""
        return cls(**{
            **data,
            "latency": {name: Latency.from_dict(v) for name, v in data["latency"].items()},
            "loaded": tuple(data["loaded"]),
            "profile": {name: [(frame, share) for frame, share in frames]
                        for name, frames in data["profile"].items()},
        })  # fmt: skip


def _pid(handle: Any) -> int:
    return int(ray.get(handle.__ray_call__.remote(lambda self: os.getpid())))


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each process, and of the whole machine ("machine")."""
    out = {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}
    total = psutil.cpu_times()
    out["machine"] = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    return out


def _wait_loaded(dispatcher: Any, groups: int) -> tuple[float, int]:
    """The warm-up: until the dispatcher has handed out ``groups`` (every worker full), at
    most WARMUP_TIMEOUT_S. At a level's start every worker asks at once, so this is how long
    the dispatcher needs to load the fleet. Returns the seconds and the groups handed out."""
    started = time.monotonic()
    while (issued := ray.get(dispatcher.cursor.remote())["issued"]) < groups:
        if time.monotonic() - started > WARMUP_TIMEOUT_S:
            break
        time.sleep(0.25)
    return time.monotonic() - started, issued


def _inside(rows: np.ndarray, t0: float, t1: float) -> np.ndarray:
    return rows[(rows[:, 0] >= t0) & (rows[:, 0] < t1)]


def _acked_rate(steps: Sequence[Step], t0: float, t1: float) -> float:
    """Samples per second from the first to the last ack inside the window."""
    inside = [s for s in steps if t0 <= s.at < t1]
    if len(inside) < 2:
        return sum(s.samples for s in inside) / (t1 - t0)
    return sum(s.samples for s in inside[1:]) / (inside[-1].at - inside[0].at)


def run_level(
    load: Load,
    hosts: list[Any],
    folder: Path,
    window_s: float,
    step_s: float,
    profile: bool,
) -> LevelResult:
    """Fresh controllers, the rollout workers and the trainer for a warm-up and
    ``window_s``; then a clean stop (the workers put every group they hold, the store drops
    what is not trained) and the ledger's check."""
    groups, k = load.groups_per_step, load.max_staleness
    batch = groups * load.group
    folder.mkdir(parents=True)
    url = f"file://{folder}"
    store_handle = create_store(url, capacity=(k + 1) * batch)
    store = StoreClient(store_handle)  # no Parquet copy of the rows: that is the data plane
    dispatcher: Any = Dispatcher.remote(
        store, _Prompts(), ENV, groups, load.group, k, 0, long_first=True, balance=True,
        prior_length=float(WORKLOADS["7B"].lengths.median),
    )  # fmt: skip
    params = ParameterService.create()
    controllers = {"store": store_handle, "dispatcher": dispatcher, "relay": params.relays[0]}
    pids = {name: _pid(handle) for name, handle in controllers.items()}
    others = {f"host {i}": ray.get(h.pid.remote()) for i, h in enumerate(hosts)}
    others["driver"] = os.getpid()  # the trainer runs here
    trainer = Trainer(store, dispatcher, params, batch, k, step_s, load.group)
    ids = list(range(load.workers))
    streams = [
        h.stream.remote(ids[i :: len(hosts)], load, store, dispatcher, params)
        for i, h in enumerate(hosts)
    ]
    loading = _wait_loaded(dispatcher, load.workers * load.slots)
    # The first groups of the fleet all start at once, and a group lasts as long as its
    # longest sample: groups finish at the steady rate once the longest has had its time.
    time.sleep(max(2 * STEP_EVERY_S, LONGEST_OVER_MEAN * load.generation_s))
    before, t0 = _cpu_seconds({**pids, **others}), time.time()
    spies = _profile(pids, window_s, folder) if profile else {}
    time.sleep(window_s)
    after, t1 = _cpu_seconds({**pids, **others}), time.time()
    profiles = {name: _read_profile(spy, path) for name, (spy, path) in spies.items()}
    stopping = time.monotonic()
    store.drain(True)  # the workers' last puts must not wait for room
    ray.get(dispatcher.stop.remote())  # as the flow ends a stream: no more groups
    for h in hosts:
        h.hurry.remote()  # and what runs finishes now
    logs = ray.get(streams, timeout=STOP_TIMEOUT_S)
    steps = trainer.stop()
    ray.get(store_handle.close.remote("the benchmark level ended"), timeout=STOP_TIMEOUT_S)
    stop_s = time.monotonic() - stopping
    table = Ledger(url).read()
    for handle in (store_handle, dispatcher):
        ray.kill(handle)
    params.shutdown()

    calls = {kind: _inside(np.concatenate([log[kind] for log in logs]), t0, t1) for kind in logs[0]}
    takes, seconds = calls["takes"], t1 - t0
    inside = [s for s in steps if t0 <= s.at < t1]
    ready = [s.lease_s for s in inside if s.ready]
    used = {name: (after[name] - before[name]) / seconds for name in after}
    return LevelResult(
        workers=load.workers,
        offered=load.offered,
        window_s=seconds,
        acked_s=_acked_rate(steps, t0, t1),
        rates={
            "groups": takes[:, 2].sum() / seconds,
            "takes": (takes[:, 2] > 0).sum() / seconds,
            "empty takes": (takes[:, 2] == 0).sum() / seconds,
            "puts": len(calls["puts"]) / seconds,
            "reports": len(calls["reports"]) / seconds,
            "checks": len(calls["checks"]) / seconds,
        },
        latency={
            "take": summarise(takes[:, 1]),
            "put": summarise(calls["puts"][:, 1]),
            "lease": summarise(ready or [s.lease_s for s in inside]),
            "ack": summarise([s.ack_s for s in inside]),
            "check": summarise(calls["checks"][:, 1]),
        },
        lease_waited=not ready,
        cpu={name: used[name] for name in pids},
        others_cpu={
            "workers": sum(used[name] for name in others if name.startswith("host")),
            "driver (trainer)": used["driver"],
            "machine": used["machine"],
        },
        groups_per_step=groups,
        max_staleness=k,
        stale=steps[-1].stale if steps else 0,
        stop_s=stop_s,
        loaded=loading,
        ledger=dispatch_accounting(table),
        violations=check_exactly_once(table, finished=True),
        profile=profiles,
    )


def _profile(
    pids: dict[str, int], seconds: float, folder: Path
) -> dict[str, tuple[subprocess.Popen[bytes], Path]]:
    """py-spy on the store and the dispatcher for ``seconds``, every thread's wall time."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy is not installed: no profile", flush=True)
        return {}
    out = {}
    for name in ("store", "dispatcher"):
        path = folder / f"profile-{name}.txt"
        command = [
            spy, "record", "--pid", str(pids[name]), "--duration", str(max(1, int(seconds))),
            "--rate", str(PROFILE_RATE), "--nonblocking", "--idle", "--threads",
            "--full-filenames", "--format", "raw", "--output", str(path),
        ]  # fmt: skip
        out[name] = (
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            path,
        )
    return out


def _read_profile(spy: subprocess.Popen[bytes], path: Path) -> list[tuple[str, float]]:
    _, err = spy.communicate(timeout=STOP_TIMEOUT_S)
    if spy.returncode != 0 or not path.exists():
        print(f"py-spy failed: {err.decode(errors='replace')[-500:]}", flush=True)
        return []
    return top_frames(path.read_text().splitlines())


# -- probes: the call rates the workers' polling asks for ---------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    name: str
    callers: int
    calls_s: float
    latency: Latency
    cpu: float  # the controller's CPU seconds per wall second

    @property
    def projected_s(self) -> float:
        return projected(self.calls_s, [self.cpu])

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON holds them (the latency by ``Latency.to_dict``)."""
        return {**asdict(self), "latency": self.latency.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(**{**data, "latency": Latency.from_dict(data["latency"])})


def _relay_check(params: ParameterService, caller: int) -> None:
    params.pull(after=NEVER)  # "anything newer?": no


def _take(dispatcher: Any, want: int, caller: int) -> None:
    ray.get(dispatcher.take.remote(caller, want, 0, None))


def _report(dispatcher: Any, caller: int) -> None:
    counters = {"version": 0.0, "pid": 1.0, "in_flight_tokens": 1e3, "free_groups": 1.0}
    ray.get(dispatcher.report.remote(caller, [], counters))


def probe(
    name: str, call: Callable[[int], object], target: Any, hosts: list[Any], callers: int,
    seconds: float,
) -> ProbeResult:  # fmt: skip
    """``callers`` threads over the hosts call ``call`` back to back; the middle half of the
    run is measured."""
    pid = _pid(target)
    ids = list(range(callers))
    refs = [h.probe.remote(call, ids[i :: len(hosts)], seconds) for i, h in enumerate(hosts)]
    time.sleep(seconds / 4)
    before, t0 = _cpu_seconds({name: pid}), time.time()
    time.sleep(seconds / 2)
    after, t1 = _cpu_seconds({name: pid}), time.time()
    inside = _inside(np.concatenate(ray.get(refs, timeout=seconds + STOP_TIMEOUT_S)), t0, t1)
    cpu = (after[name] - before[name]) / (t1 - t0)
    return ProbeResult(name, callers, len(inside) / (t1 - t0), summarise(inside[:, 1]), cpu)


def run_probes(hosts: list[Any], callers: int, seconds: float) -> list[ProbeResult]:
    """A relay's "anything newer?"; the dispatcher's take when admission holds a worker back;
    a worker's report (counters, no groups); and a take that brings one group, with its
    ledger events."""
    params = ParameterService.create()
    store = StoreClient(create_store(None, capacity=GROUP))
    held: Any = Dispatcher.remote(store, _Prompts(), ENV, 64, GROUP, 2, 0)
    given: Any = Dispatcher.remote(store, _Prompts(), ENV, 64, GROUP, UNBOUNDED, 0)
    try:
        return [
            probe("relay: anything newer?", partial(_relay_check, params), params.relays[0],
                  hosts, callers, seconds),
            probe("dispatcher: take, admission holds it back", partial(_take, held, 0), held,
                  hosts, callers, seconds),
            probe("dispatcher: report", partial(_report, held), held, hosts, callers, seconds),
            probe("dispatcher: take of one group", partial(_take, given, 1), given, hosts,
                  callers, seconds),
        ]  # fmt: skip
    finally:
        for handle in (held, given, store.handle):
            ray.kill(handle)
        params.shutdown()


# -- report -----------------------------------------------------------------------------------


def _table(columns: Sequence[tuple[str, Callable[[Any], str]]], rows: Sequence[Any]) -> str:
    return "\n".join(
        markdown_table([h for h, _ in columns], [[f(r) for _, f in columns] for r in rows])
    )


def _ledger(r: LevelResult) -> str:
    n = r.ledger
    verdict = f"{len(r.violations)} violations" if r.violations else "exactly once"
    return (
        f"{verdict}: {n['dispatched']:,} dispatched, {n['trained']:,} trained, "
        f"{n['dropped']:,} dropped ({r.stale:,} as stale, the rest when the level ended)"
    )


def _loaded(r: LevelResult) -> str:
    seconds, issued = r.loaded
    wanted = r.workers * SLOTS
    return f"in {seconds:.1f} s" if issued >= wanted else f"no: {issued:,} of {wanted:,} groups"


LEVEL_COLUMNS: list[tuple[str, Callable[[LevelResult], str]]] = [
    ("workers", lambda r: str(r.workers)),
    ("offered samples/s", lambda r: f"{r.offered:,.0f}"),
    ("acked samples/s", lambda r: f"{r.acked_s:,.0f}"),
    ("groups/s", lambda r: f"{r.rates['groups']:,.0f}"),
    ("takes/s (empty)", lambda r: f"{r.rates['takes']:,.0f} ({r.rates['empty takes']:,.0f})"),
    ("puts/s", lambda r: f"{r.rates['puts']:,.0f}"),
    ("reports/s", lambda r: f"{r.rates['reports']:,.0f}"),
    ("take ms p50 / p99", lambda r: r.latency["take"].ms()),
    ("put ms", lambda r: r.latency["put"].ms()),
    ("lease ms", lambda r: r.latency["lease"].ms() + (" (waits incl.)" if r.lease_waited else "")),
    ("ack ms", lambda r: r.latency["ack"].ms()),
    ("weight check ms", lambda r: r.latency["check"].ms()),
    ("CPU store / dispatcher / relay", lambda r: " / ".join(f"{v:.2f}" for v in r.cpu.values())),
    ("CPU workers / driver (trainer) / machine",
     lambda r: " / ".join(f"{v:.2f}" for v in r.others_cpu.values())),
    ("groups a step, k", lambda r: f"{r.groups_per_step}, {r.max_staleness}"),
    ("fleet loaded", _loaded),
    ("ledger", _ledger),
]  # fmt: skip

PROBE_COLUMNS: list[tuple[str, Callable[[ProbeResult], str]]] = [
    ("call", lambda p: p.name),
    ("callers", lambda p: str(p.callers)),
    ("calls/s", lambda p: f"{p.calls_s:,.0f}"),
    ("ms p50 / p99", lambda p: p.latency.ms()),
    ("controller CPU", lambda p: f"{p.cpu:.2f}"),
    ("projected calls/s", lambda p: f"{p.projected_s:,.0f}"),
]

DEMAND_COLUMNS: list[tuple[str, Callable[[Demand], str]]] = [
    ("cell", lambda d: f"{d.model} x{d.accelerators}"),
    ("policy", lambda d: d.policy),
    ("engines", lambda d: str(d.engines)),
    ("samples/s", lambda d: f"{d.samples_s:,.0f}"),
    ("trained/s", lambda d: f"{d.trained_s:,.0f}"),
    ("groups/s", lambda d: f"{d.groups_s:,.1f}"),
    ("takes/s", lambda d: f"{d.takes_s:,.1f}"),
    ("puts/s", lambda d: f"{d.puts_s:,.1f}"),
    ("leases/s", lambda d: f"{d.leases_s:.3f}"),
    ("reports/s (paced)", lambda d: f"{d.reports_s:,.0f}"),
    ("held takes/s (at most)", lambda d: f"{d.held_takes_s:,.1f}"),
    ("weight checks/s", lambda d: f"{d.checks_s:,.0f}"),
    ("a node's relay, checks/s", lambda d: f"{d.checks_per_relay_s:,.0f}"),
    ("weight pulls/s", lambda d: f"{d.pulls_s:,.1f}"),
]


def _times(x: float) -> str:
    return "no demand" if math.isinf(x) else f"{x:,.1f}x"


def costs_of(
    results: Sequence[LevelResult],
    probes: Sequence[ProbeResult],
    takes: dict[tuple[int, int], float],
) -> Costs:
    """The CPU cost of each unit of work: the store's from the level that carried the most,
    the dispatcher's per call and the relay's per check from the probes, a take's own work
    at each cell's shape (``take_costs``)."""
    best = max(results, key=lambda r: r.acked_s)
    relay, held, reported = probes[0], probes[1], probes[2]
    for what, rate in (
        ("every level", best.acked_s),
        (relay.name, relay.calls_s),
        (held.name, held.calls_s),
        (reported.name, reported.calls_s),
    ):
        if rate <= 0:
            raise RuntimeError(f"{what}: nothing got through, so no cost can be derived")
    return Costs(
        store_per_sample=best.cpu["store"] / best.acked_s,
        call=held.cpu / held.calls_s,
        report=reported.cpu / reported.calls_s,
        relay_per_check=relay.cpu / relay.calls_s,
        take=takes,
    )


def largest_demand(demands: Sequence[Demand]) -> Demand:
    """The cell and policy at the largest size that asks for the most samples a second."""
    return max((d for d in demands if d.accelerators == max(SIZES)), key=lambda d: d.samples_s)


def ramp_levels(demand: Demand, window_s: float) -> list[tuple[Load, float]]:
    """The ramp at ``demand``'s engines: RAMP times its samples/s, each with its window (the
    first, at the demand itself, RAMP_FIRST_S)."""
    return [
        (Load(demand.engines, times * demand.samples_s), RAMP_FIRST_S if i == 0 else window_s)
        for i, times in enumerate(RAMP)
    ]


def ramp_text(demand: Demand, ramp: Sequence[LevelResult]) -> str:
    """What the ramp shows: the demand held, and where the control plane saturates."""
    held = ramp[0]
    text = (
        f"The ramp: {demand.engines} rollout workers, the engines of the largest demand "
        f"({demand.model} x{demand.accelerators}, {demand.policy}: {demand.samples_s:,.0f} "
        f"samples/s), offered {', '.join(f'{t}x' for t in RAMP)} that rate. At the demand "
        f"itself, held {held.window_s:.0f} s: {held.acked_s:,.0f} samples/s acknowledged "
        f"({held.acked_s / held.offered:.0%} of the offered rate), takes "
        f"{held.latency['take'].ms()} ms p50 / p99, {_ledger(held)}. "
    )
    short = next((r for r in ramp if r.acked_s < SATURATION_SHARE * r.offered), None)
    most = max(ramp, key=lambda r: r.acked_s)
    times = most.acked_s / demand.samples_s
    if short is None:
        return text + (
            f"Every step carried at least {SATURATION_SHARE:.0%} of its offered rate, up to "
            f"{most.acked_s:,.0f} samples/s ({times:.1f}x the demand): saturation lies above."
        )
    return text + (
        f"It saturates at {short.offered / demand.samples_s:.0f}x: offered "
        f"{short.offered:,.0f}, it carried {short.acked_s:,.0f} "
        f"({short.acked_s / short.offered:.0%}); the most any step carried was "
        f"{most.acked_s:,.0f} samples/s, {times:.1f}x the demand"
        + (f", below {SAFE_HEADROOM:g}x." if times < SAFE_HEADROOM else ".")
    )


def scale_table(demands: Sequence[Demand], costs: Costs, ceiling: Ceiling) -> str:
    """Per cell (the larger demand of the two policies for each kind of work): the cores
    each controller would be busy, and the headroom, 1 / busy (the store's also measured)."""
    cells: dict[str, list[Demand]] = {}
    for d in demands:
        cells.setdefault(f"{d.model} x{d.accelerators}", []).append(d)
    Cell = tuple[str, list[Demand]]

    def most(what: Callable[[Demand], float]) -> Callable[[Cell], float]:
        return lambda cell: max(what(d) for d in cell[1])

    def busy(what: Callable[[Demand], float]) -> Callable[[Cell], str]:
        worst = most(what)
        return lambda cell: f"{worst(cell):.2f} ({_times(headroom(1.0, worst(cell)))})"

    samples = most(lambda d: d.samples_s)
    columns: list[tuple[str, Callable[[Cell], str]]] = [
        ("cell", lambda c: c[0]),
        ("samples/s", lambda c: f"{samples(c):,.0f}"),
        ("end to end here", lambda c: _times(headroom(ceiling.samples_s, samples(c)))),
        ("store busy (headroom)", busy(costs.store)),
        ("take ms (in process, real ledger)",
         lambda c: f"{1e3 * costs.take[c[1][0].engines, c[1][0].groups_per_take]:.1f}"),
        ("takes/s, reports/s, held takes/s",
         lambda c: f"{most(lambda d: d.takes_s)(c):,.1f}, {most(lambda d: d.reports_s)(c):,.0f}, "
                   f"{most(lambda d: d.held_takes_s)(c):,.1f}"),
        ("dispatcher busy (headroom)", busy(costs.dispatcher)),
        ("checks/s: a node's relay, all",
         lambda c: f"{most(lambda d: d.checks_per_relay_s)(c):,.0f}, "
                   f"{most(lambda d: d.checks_s)(c):,.0f}"),
        ("a node's relay busy (headroom)", busy(costs.relay)),
        ("one relay for all, busy (headroom)", busy(costs.one_relay)),
    ]  # fmt: skip
    return _table(columns, list(cells.items()))


def verdict(ceiling: Ceiling, demands: Sequence[Demand], costs: Costs) -> str:
    """The headroom of each controller at the largest size, against the largest demand of
    any model and policy there, and the ones below SAFE_HEADROOM."""
    top = [d for d in demands if d.accelerators == max(SIZES)]

    def worst(busy: Callable[[Demand], float]) -> float:
        return headroom(1.0, max(busy(d) for d in top))

    found = {
        "end to end on these 2 cores": headroom(ceiling.samples_s, max(d.samples_s for d in top)),
        "the store, projected": worst(costs.store),
        "the dispatcher (takes, reports, held takes)": worst(costs.dispatcher),
        "a node's relay (weights.relays: per_node)": worst(costs.relay),
    }
    text = (
        f"At {max(SIZES)} accelerators the headroom is: "
        + "; ".join(f"{name} {_times(h)}" for name, h in found.items())
        + f". The best level carried {ceiling.samples_s:,.0f} samples/s. "
    )
    text += (
        f"Saturation: {'; '.join(ceiling.saturated)}."
        if ceiling.saturated
        else "No level saturated."
    )
    short = [name for name, h in found.items() if h < SAFE_HEADROOM]
    if short:
        text += f" Below {SAFE_HEADROOM:g}x: {', '.join(short)}."
    return text


def setup() -> dict[str, Any]:
    """The fixed settings a measurement ran with that the section states: this module's
    constants and the real worker's timing."""
    return {
        "hosts": HOSTS, "slots": SLOTS, "group": GROUP, "weight_check_s": WEIGHT_CHECK_S,
        "real_weight_check_s": REAL_WEIGHT_CHECK_S, "report_every_s": REPORT_EVERY_S,
        "reports_per_s": REPORTS_PER_S, "prompt_tokens": PROMPT_TOKENS,
        "bytes_per_token": BYTES_PER_TOKEN, "step_every_s": STEP_EVERY_S,
        "node_accelerators": NODE_ACCELERATORS, "groups_per_step": GROUPS_PER_STEP,
    }  # fmt: skip


@dataclass(frozen=True)
class Measurement:
    """What one run measured, all its section is written from."""

    levels: list[LevelResult]
    ramp: list[LevelResult]
    probes: list[ProbeResult]
    demands: list[Demand]
    takes: dict[tuple[int, int], float]  # (engines, groups a take) -> a take's own work
    args: dict[str, Any]  # main's arguments, --levels as run, --write left out
    setup: dict[str, Any]  # ``setup()``
    elapsed_s: float
    load_average: tuple[float, float]  # 1-minute, before and after

    def to_dict(self) -> dict[str, Any]:
        """The record's data, JSON's types only: a take's cost as [engines, groups, s]."""
        return {
            "levels": [r.to_dict() for r in self.levels],
            "ramp": [r.to_dict() for r in self.ramp],
            "probes": [p.to_dict() for p in self.probes],
            "demands": [asdict(d) for d in self.demands],
            "takes": [[*shape, seconds] for shape, seconds in sorted(self.takes.items())],
            "args": self.args,
            "setup": self.setup,
            "elapsed_s": self.elapsed_s,
            "load_average": list(self.load_average),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """The measurement ``to_dict`` wrote."""
        return cls(
            levels=[LevelResult.from_dict(r) for r in data["levels"]],
            ramp=[LevelResult.from_dict(r) for r in data["ramp"]],
            probes=[ProbeResult.from_dict(p) for p in data["probes"]],
            demands=[Demand(**d) for d in data["demands"]],
            takes={(engines, groups): s for engines, groups, s in data["takes"]},
            args=data["args"],
            setup=data["setup"],
            elapsed_s=data["elapsed_s"],
            load_average=tuple(data["load_average"]),
        )


def _setup_text(m: Measurement) -> str:
    """The paragraph on how the levels were run."""
    s = m.setup
    running = Load(1, 1.0, group=s["group"], slots=s["slots"]).running
    return (
        f"Real rollout workers (their stream loop) on clock engines, in {s['hosts']} processes, "
        f"room for {s['slots'] * s['group']} samples each, taken in whole groups of "
        f"{s['group']} (so {running:.0f} running on average; a group lasts as long as its "
        f"longest sample), weight checks every {s['weight_check_s']:g} s (the real worker's "
        f"{s['real_weight_check_s']:g} s is the relay probe's demand), reports every "
        f"{s['report_every_s']:g} s or as the dispatcher paces them ({s['reports_per_s']:g} a "
        f"second for the fleet); rows of {s['prompt_tokens']} prompt tokens and the 7B "
        f"workload's responses ({s['bytes_per_token']} bytes a token). The trainer leases the "
        f"groups the offered rate makes in {s['step_every_s']:g} s, trains "
        f"{m.args['step_s']:g} s a step; k is the staleness bound, loose enough that admission "
        f"never holds a worker back. Each level is measured for {m.levels[0].window_s:.0f} s "
        "after a warm-up. Latencies are the caller's (a put's includes validating, encoding and "
        "its object-store put); CPU is seconds per wall second."
    )


def _ramp_lines(ramp: Sequence[LevelResult], top: Demand) -> list[str]:
    """What the ramp shows and its table; nothing when the run had no ramp."""
    if not ramp:
        return []
    columns = [("x demand", lambda r: f"{r.offered / top.samples_s:.0f}x"),
               ("seconds", lambda r: f"{r.window_s:.0f}"), *LEVEL_COLUMNS]  # fmt: skip
    return [ramp_text(top, ramp), "", _table(columns, ramp), ""]


def _profile_lines(levels: Sequence[LevelResult]) -> list[str]:
    """Each level's profiles: a controller's busiest functions of this repository."""
    lines = []
    for r in levels:
        for name, frames in r.profile.items():
            shown = "; ".join(f"{frame} {share:.0%}" for frame, share in frames)
            lines += [
                "",
                f"{name}, {r.workers} workers (py-spy, share of a thread's wall time): {shown}",
            ]
    return lines


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): per level (``levels.512``) and ramp
    step (``ramp.3x``) its offered and acked samples/s, reports/s and take p50 / p99 in
    seconds; over the ramp the CPU ranges of the machine, the workers, the store and the
    dispatcher, the most any step carried over the demand, and the share of the
    dispatcher's wall time in ``StoreClient.settle_records``; the projected headroom at the
    largest size; a take's own work at the largest cell."""
    m = Measurement.from_dict(record.data)
    top = largest_demand(m.demands)
    out: dict[str, str] = {}

    def level(key: str, r: LevelResult) -> None:
        take = r.latency["take"]
        out.update({
            f"{key}.offered": f"{r.offered:,.0f}",
            f"{key}.acked": f"{r.acked_s:,.0f}",
            f"{key}.reports": f"{r.rates['reports']:,.0f}",
            f"{key}.take-p50": f"{take.p50:.2f} s",
            f"{key}.take-p99": f"{take.p99:.1f} s",
        })  # fmt: skip

    for r in m.levels:
        level(f"levels.{r.workers}", r)
    for r in m.ramp:
        times = f"ramp.{r.offered / top.samples_s:.0f}x"
        level(times, r)
        out[f"{times}.share"] = f"{r.acked_s / r.offered:.0%}"
    if m.ramp:
        out |= {
            "ramp.workers": str(top.engines),
            "ramp.demand": f"{top.samples_s:,.0f}",
            "ramp.most": f"{max(r.acked_s for r in m.ramp) / top.samples_s:.1f}x",
            "ramp.cpu-machine": span([r.others_cpu["machine"] for r in m.ramp]),
            "ramp.cpu-workers": span([r.others_cpu["workers"] for r in m.ramp]),
            "ramp.cpu-store": span([r.cpu["store"] for r in m.ramp]),
            "ramp.cpu-dispatcher": span([r.cpu["dispatcher"] for r in m.ramp]),
        }
        settle = [
            share
            for r in m.ramp
            for frame, share in r.profile.get("dispatcher", [])
            if frame.startswith("StoreClient.settle_records")
        ]
        if settle:
            out["ramp.settle-share"] = span([100 * x for x in settle], "%", 0)
    costs = costs_of([*m.levels, *m.ramp], m.probes, m.takes)
    at_top = [d for d in m.demands if d.accelerators == max(SIZES)]
    for name, busy in (
        ("store", costs.store),
        ("dispatcher", costs.dispatcher),
        ("relay", costs.relay),
        ("one-relay", costs.one_relay),
    ):
        out[f"headroom.{name}"] = _times(headroom(1.0, max(busy(d) for d in at_top)))
    shape = (top.engines, top.groups_per_take)
    out["take-ms"] = f"{1e3 * m.takes[shape]:.1f} ms"
    smaller = [1e3 * seconds for cell, seconds in m.takes.items() if cell != shape]
    if smaller:
        out["take-ms-smaller"] = span(smaller, " ms", 1)
    return out


def render(record: Record) -> str:
    """The section, from ``record`` alone: the levels, the ramp, the call rates, the
    simulated demand, each controller's projected load at scale, the verdict and the
    profiles."""
    m = Measurement.from_dict(record.data)
    results, ramp, s = m.levels, m.ramp, m.setup
    costs = costs_of([*results, *ramp], m.probes, m.takes)
    ceiling = Ceiling(max(r.acked_s for r in [*results, *ramp]), find_ceiling(results).saturated)
    before, after = m.load_average
    lines = [
        f"{record.measured_on()}; load average {before:.1f} before, {after:.1f} after; "
        f"{m.elapsed_s:.0f} s in all.",
        f"Command: `{record.command}`.",
        "",
        _setup_text(m),
        "",
        _table(LEVEL_COLUMNS, results),
        "",
        *_ramp_lines(ramp, largest_demand(m.demands)),
        f"Call rates, {m.probes[0].callers} callers back to back (projected: over the "
        "controller's CPU share):",
        "",
        _table(PROBE_COLUMNS, m.probes),
        "",
        f"What the simulator says the control plane must serve "
        f"(`benchmarks/sim_scale.py`, {m.args['sim_steps']} steps a cell, steady state): "
        "samples/s are samples trained or dropped, each put into the store; "
        "takes/s are takes that bring work; held takes are takes admission answers empty "
        "(once a weight version an engine, at most: a held worker waits for the version the "
        "answer names); reports are paced to a fleet-wide budget; a node's relay answers the "
        f"engines on its node ({s['node_accelerators']} accelerators a node).",
        "",
        _table(DEMAND_COLUMNS, m.demands),
        "",
        "At scale: the cores each controller would be busy (demand times the CPU each unit "
        f"of work cost here: {costs.store_per_sample * 1e3:.2f} ms a sample in the store, "
        f"{costs.call * 1e3:.2f} ms a held take, {costs.report * 1e3:.2f} ms a report, "
        f"{costs.relay_per_check * 1e3:.2f} ms a relay check, plus a take's own work, "
        "measured in process at the cell's shape, its ledger events sent to a real store: "
        f"{s['groups_per_step']} groups a step, every engine reporting), and the headroom, 1 / "
        "busy; for each kind of work the larger demand of the two policies:",
        "",
        scale_table(m.demands, costs, ceiling),
        "",
        verdict(ceiling, m.demands, costs),
        *_profile_lines([*results, *ramp]),
    ]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[tuple[int, float]]:
    """``"64:1000 256:2000"`` -> [(64, 1000.0), (256, 2000.0)]: workers, offered samples/s."""
    out = []
    for item in text.split():
        workers, sep, rate = item.partition(":")
        try:
            level = (int(workers), float(rate))
        except ValueError:
            level = (0, 0.0)
        if not sep or level[0] < 1 or level[1] <= 0:
            raise argparse.ArgumentTypeError(
                f"level {item!r}: write workers:samples_per_s, both positive"
            )
        out.append(level)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--levels",
        type=parse_levels,
        default=None,
        help=f"workers:offered samples/s ... (default {FULL_LEVELS!r})",
    )
    parser.add_argument("--window", type=float, default=15.0, help="measured seconds a level")
    parser.add_argument("--step-s", type=float, default=0.0, help="trainer step time (0: none)")
    parser.add_argument("--probe-callers", type=int, default=64)
    parser.add_argument("--probe-s", type=float, default=2.5, help="seconds a call-rate probe")
    parser.add_argument("--sim-steps", type=int, default=12, help="steps a simulated cell")
    parser.add_argument(
        "--quick", action="store_true", help=f"levels {QUICK_LEVELS!r}, shorter windows, no profile"
    )
    parser.add_argument("--no-profile", action="store_true", help="no py-spy on the controllers")
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()  # fmt: skip
    if args.quick:
        args.window, args.probe_s, args.sim_steps, args.no_profile = 4.0, 2.0, 6, True
    levels = args.levels or parse_levels(QUICK_LEVELS if args.quick else FULL_LEVELS)
    load_before, started = os.getloadavg()[0], time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:3.0f} s] {text}", flush=True)

    demands = simulated_demand(args.sim_steps)
    say(f"the demand of {len(demands)} simulated cells")
    # The ramp needs the full run's windows: --quick and chosen --levels leave it out.
    top = largest_demand(demands)
    ramp_plan = [] if args.quick or args.levels else ramp_levels(top, args.window)

    folder = Path(tempfile.mkdtemp(prefix="sluice-bench-control-"))
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
        _node_ip_address="127.0.0.1",
        _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        hosts = [WorkerHost.remote(seed) for seed in range(HOSTS)]  # type: ignore[attr-defined]
        ray.get([h.pid.remote() for h in hosts])
        say(f"{HOSTS} worker hosts are up")
        results: list[LevelResult] = []
        ramp: list[LevelResult] = []
        plan = [(Load(w, rate), args.window) for w, rate in levels] + ramp_plan
        for i, (load, window) in enumerate(plan):
            r = run_level(load, hosts, folder / f"level-{i}", window, args.step_s,
                          not args.no_profile)  # fmt: skip
            (results if i < len(levels) else ramp).append(r)
            say(
                f"{load.workers} workers, {load.offered:,.0f} offered for {window:.0f} s: "
                f"{r.acked_s:,.0f} acked samples/s, "
                f"take {r.latency['take'].ms()} ms, put {r.latency['put'].ms()} ms; CPU "
                + ", ".join(f"{k} {v:.2f}" for k, v in {**r.cpu, **r.others_cpu}.items())
                + f"; fleet loaded {_loaded(r)}; {_ledger(r)}; stopped in {r.stop_s:.1f} s"
            )
        probes = run_probes(hosts, args.probe_callers, args.probe_s)
        for p in probes:
            say(f"{p.name}: {p.calls_s:,.0f} calls/s, controller CPU {p.cpu:.2f}")
        takes = take_costs({(d.engines, d.groups_per_take) for d in demands}, folder)
        say("a take's cost at each cell's shape, through a real store")
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    arguments = {k: v for k, v in vars(args).items() if k != "write"}
    measurement = Measurement(
        levels=results,
        ramp=ramp,
        probes=probes,
        demands=demands,
        takes=takes,
        args={**arguments, "levels": [list(level) for level in levels]},
        setup=setup(),
        elapsed_s=time.monotonic() - started,
        load_average=(load_before, os.getloadavg()[0]),
    )
    record = Record.measured(
        "control-plane", "Control plane under load", render, measurement.to_dict(),
        ["ray", "pyarrow"],
    )  # fmt: skip
    publish(record, args.write)


if __name__ == "__main__":
    main()
