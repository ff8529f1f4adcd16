"""The event loop: one scheduling policy on one scenario, rollout engines and a trainer.

Components and who drives them: ``simulate`` builds a ``_Run``; its loop pops events off
one heap (time, sequence) and hands each to the part it concerns:

- rollout engines (``_Engine``): continuous batching as a fluid. Between events an
  engine's running set is fixed, so it advances one *decode step* per ``a + b * n`` seconds
  (n running requests) and every running request gains one token per step. A request
  admitted at step p with length L finishes at step p + L, so an engine needs one event
  per finishing request, not one per token: this is what lets 1024 accelerators and
  millions of samples run in seconds. Prefill, weight loads and repack migrations *stall*
  an engine (no decode) for their cost.
- the trainer: one data-parallel step per batch, ``train_step_s + tokens * per_token / T``.
- the policy, mirroring Sluice's flow (``flows/rl_job.py``, ``driver/modes.py``):
  ``sync`` submits a batch, trains on it, loads weights everywhere, repeats; ``one_step``
  submits the next batch before training and each engine loads the new weights once its
  share of that batch is done (Ray runs an actor's calls in order); ``async`` is the
  dispatcher of ``engines/rollout/dispatcher.py`` (AReaL admission: an engine at version v may start
  group g only while g < (v + k + 1) * B; the trainer leases B ready groups, oldest
  first, after dropping groups staler than k by the rule of ``rl/staleness.py``, as
  ``storage/trajectory_index.py`` does)
  with the worker of ``engines/rollout/worker.py`` (refill, weight polling, partial
  rollout).
- skew-aware dispatch (``rl/dispatch.plan``: longest predicted first, least predicted
  load) and repack (``rl/dispatch.stragglers``), with a length predictor whose error is
  a setting.
- failures: an engine fails at a rate; its requests go back to a queue that other
  engines drain first, and it returns after a repair time with the newest weights.

Exactness: with equal lengths every request of an engine finishes on the same event, and
the fluid and the real step-by-step engine agree to the last decode step.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from sluice.rl.staleness import group_version, too_stale
from sluice.sim.lengths import draw_lengths
from sluice.sim.results import SimResult
from sluice.sim.scenario import Scenario

# Event kinds. An engine event carries the engine's epoch; a newer epoch makes it stale.
_DONE, _LOADED, _DELIVERED, _NOTICE, _PUT, _TRAINED, _FAIL, _REPAIR, _DISPATCH = range(9)
# Groups drawn at a time: a fixed chunk keeps the draw sequence, and so the lengths of
# group g, the same for every policy run on one seed.
_CHUNK_GROUPS = 4096
# A request counts as finished when within this many decode steps of its end (float error).
_EPS_STEPS = 1e-6


class SimulationStalled(RuntimeError):
    """No event is left but the trainer has not reached its last step."""


class _Engine:
    """One rollout engine (``accelerators_per_instance`` accelerators serving one model)."""

    __slots__ = (
        "a",
        "alive",
        "b",
        "batch_left",
        "busy_s",
        "cap",
        "deliveries",
        "down_s",
        "epoch",
        "idle_s",
        "idx",
        "load_id",
        "loading",
        "pred_left",
        "progress",
        "put_id",
        "queue",
        "running",
        "stall_until",
        "start_sum",
        "t",
        "unsent",
        "version",
        "want_version",
    )

    def __init__(self, idx: int, cap: int, a: float, b: float) -> None:
        self.idx, self.cap, self.a, self.b = idx, cap, a, b
        self.alive = True
        self.t = 0.0  # time up to which progress and accounting are current
        self.stall_until = 0.0
        self.progress = 0.0  # decode steps done since the start
        self.running: list[tuple[float, int]] = []  # heap of (finish progress, sample)
        self.queue: deque[int] = deque()  # batch modes: samples waiting for room
        self.unsent: list[int] = []  # async: finished groups in the put buffer
        self.put_id = 0  # tags the PUT event of the buffer's oldest group
        self.version = 0
        self.want_version = 0  # a version this engine must load before more batch work
        self.loading = False
        self.load_id = 0  # tags the LOADED event of the load in progress
        self.deliveries: set[int] = set()  # batch modes: batches whose generate call returns
        self.batch_left: dict[int, int] = {}  # batch modes: batch -> samples still here
        self.epoch = 0
        self.busy_s = self.idle_s = self.down_s = 0.0
        self.pred_left = 0.0  # predicted tokens of running requests
        self.start_sum = 0.0  # sum of the running requests' start progress

    def load(self) -> float:
        """Predicted tokens still to generate on this engine (the dispatcher's view)."""
        done = len(self.running) * self.progress - self.start_sum
        return max(self.pred_left - done, 0.0)


@dataclass
class _Trainer:
    version: int = 0
    busy: bool = False
    busy_s: float = 0.0


class _Run:
    """The state of one simulation; ``run`` is its event loop."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        w, c, p, k = sc.workload, sc.cluster, sc.policy, sc.costs
        self.B, self.G, self.steps = w.groups_per_step, w.samples_per_group, w.steps
        self.mode = p.mode
        self.streaming = p.mode == "async"
        self.partial = p.partial_rollout
        self.repack = p.repack
        self.ready_delay = k.group_ready_s
        self.put_groups = p.put_groups
        self.group_overhead = k.group_overhead_s
        self.refill_at = p.refill_at
        self.k = {"sync": 0, "one_step": 1, "async": p.max_staleness}[p.mode]
        a = k.stream_decode_step_s if self.streaming else None
        b = k.stream_per_request_s if self.streaming else None
        a = k.decode_step_s if a is None else a
        b = k.decode_per_request_s if b is None else b
        self.engines = [_Engine(i, c.max_concurrency, a, b) for i in range(c.instances)]
        self.pull_s = k.pull_s
        self.prefill_token_s = k.prefill_per_token_s
        self.prompt = w.prompt_tokens
        self.train_fixed = (
            k.train_step_s
            + k.publish_s
            + (k.colocated_switch_s if c.placement == "colocated" else 0.0)
        )
        self.train_token_s = k.train_per_token_s / c.train_accelerators
        if p.mode != "sync":  # generation runs while the trainer steps
            self.train_fixed *= k.train_overlap_factor
            self.train_token_s *= k.train_overlap_factor
        # Sample arrays, grown a chunk of groups at a time; sample s is in group s // G.
        self.length: list[int] = []
        self.pred: list[float] = []
        self.startver: list[int] = []  # the version of a sample's first token
        self.endver: list[int] = []  # and of its last (partial rollout: newer weights)
        self.started_at: list[float] = []
        self.done_in_group: list[int] = []
        self._len_rng = np.random.default_rng([sc.seed, 0])
        self._pred_rng = np.random.default_rng([sc.seed, 1])
        self._fail_rng = np.random.default_rng([sc.seed, 2])
        poll_rng = np.random.default_rng([sc.seed, 3])
        self.poll_phase = (poll_rng.random(len(self.engines)) * p.weight_check_s).tolist()
        # Event heap.
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.trainer = _Trainer()
        self.step_end: list[float] = []
        self.retry: deque[int] = deque()  # samples to generate again (their engine failed)
        # Counters.
        self.trained = self.trained_tokens = self.generated = self.dropped = 0
        self.requeued = self.failures = self.repacked = self.issued_samples = 0
        self.staleness: Counter[int] = Counter()  # by the rule (policy.stale_by)
        self.first_token_lag: Counter[int] = Counter()
        # Async dispatcher state.
        self.issued = 0  # groups handed out (the admission count)
        self.credit = 0  # dropped groups given back (policy.credit_drops)
        self.next_group = 0  # next group to enter the look-ahead pool
        self.pool_heap: list[tuple[float, int]] = []  # (-predicted tokens, group)
        self.pool_fifo: deque[int] = deque()
        self.flagged: set[int] = set()
        self.dispatch_pending = False
        self.ready: dict[int, None] = {}  # ready groups in ready order
        self.ready_by_version: list[tuple[int, int]] = []
        self.latest = 0  # newest published version
        # Batch-mode state.
        self.batch_left: dict[int, int] = {}  # batch -> samples not finished
        self.batch_open: dict[int, set[int]] = {}  # batch -> engines still holding its work
        self.batch_ready: set[int] = set()
        self.stragglers: set[int] = set()
        self.behind: set[int] = set()  # batch modes: live engines still loading the newest

    # -- groups and samples ------------------------------------------------------------

    def _ensure_groups(self, groups: int) -> None:
        while len(self.done_in_group) < groups:
            lengths = draw_lengths(
                self.sc.workload.lengths,
                _CHUNK_GROUPS,
                self.G,
                self._len_rng,
                first=len(self.done_in_group),
            ).astype(np.float64)
            noise = np.exp(
                self.sc.policy.predictor_sigma * self._pred_rng.standard_normal(_CHUNK_GROUPS)
            )
            predicted = lengths.mean(axis=1) * noise
            self.length.extend(lengths.astype(np.int64).ravel().tolist())
            self.pred.extend(np.repeat(predicted, self.G).tolist())
            n = _CHUNK_GROUPS * self.G
            self.startver.extend([0] * n)
            self.endver.extend([0] * n)
            self.started_at.extend([0.0] * n)
            self.done_in_group.extend([0] * _CHUNK_GROUPS)

    # -- events ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, who: int, tag: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, who, tag))

    def run(self) -> SimResult:
        self._start()
        handlers = {
            _DONE: self._on_done,
            _LOADED: self._on_loaded,
            _DELIVERED: self._on_delivered,
            _NOTICE: self._on_notice,
            _PUT: self._on_put,
            _TRAINED: self._on_trained,
            _FAIL: self._on_fail,
            _REPAIR: self._on_repair,
            _DISPATCH: self._on_dispatch,
        }
        heap, pop, engines, step_end, steps = (
            self.heap,
            heapq.heappop,
            self.engines,
            self.step_end,
            self.steps,
        )
        events = 0
        while len(step_end) < steps:
            if not heap:
                raise SimulationStalled(self._stall_message())
            t, _, kind, who, tag = pop(heap)
            events += 1
            if kind == _DONE and tag != engines[who].epoch:
                continue  # superseded by a later schedule of the same engine
            self.now = t
            handlers[kind](who, tag)
        self.events = events
        return self._result()

    def _stall_message(self) -> str:
        in_flight = sum(len(e.running) + len(e.queue) for e in self.engines)
        limit = (self.trainer.version + self.k + 1) * self.B + self.credit
        return (
            f"simulation stalled at t={self.now:.1f}s: trainer at version "
            f"{self.trainer.version} of {self.steps} waits for {self.B} ready groups, has "
            f"{len(self.ready)}; {in_flight} samples in flight; dispatcher issued "
            f"{self.issued} groups, admission allows {limit}; {self.dropped // self.G} groups "
            "were dropped as stale and never re-admitted (policy.credit_drops is off; "
            "Sluice's dispatcher gives their slots back: leave policy.credit_drops on)"
        )

    def _start(self) -> None:
        rate = self.sc.cluster.failure_rate_per_hour
        if rate > 0:
            for e in self.engines:
                self._push(self._fail_rng.exponential(3600.0 / rate), _FAIL, e.idx, e.epoch)
        if self.mode == "async":
            for e in self.engines:
                self.flagged.add(e.idx)
            self._request_dispatch()
        else:
            self._submit(0)

    # -- engine mechanics ----------------------------------------------------------------

    def _bring(self, e: _Engine) -> None:
        """Advance ``e``'s decode progress and time accounting to now."""
        now = self.now
        if now <= e.t:
            return
        if not e.alive:
            e.down_s += now - e.t
            e.t = now
            return
        start = e.t
        if e.stall_until > start:
            stalled_to = min(now, e.stall_until)
            e.busy_s += stalled_to - start
            start = stalled_to
        rest = now - start
        if rest > 0:
            if e.running:
                e.progress += rest / (e.a + e.b * len(e.running))
                e.busy_s += rest
            else:
                e.idle_s += rest
        e.t = now

    def _schedule(self, e: _Engine) -> None:
        """(Re)schedule ``e``'s next request completion; older events become stale."""
        e.epoch += 1
        running = e.running
        if running and e.alive:
            left = running[0][0] - e.progress
            start = e.t if e.t > e.stall_until else e.stall_until
            if left > 0:
                start += left * (e.a + e.b * len(running))
            self.seq += 1
            heapq.heappush(self.heap, (start, self.seq, _DONE, e.idx, e.epoch))

    def _stall(self, e: _Engine, seconds: float) -> None:
        if seconds > 0:
            e.stall_until = max(e.stall_until, self.now) + seconds

    def _start_sample(
        self, e: _Engine, s: int, prefill_tokens: float, done: float = 0.0, fresh: bool = True
    ) -> None:
        """Run sample ``s`` on ``e``; ``done`` tokens of it were generated elsewhere."""
        p0 = e.progress - done
        heapq.heappush(e.running, (p0 + self.length[s], s))
        e.start_sum += p0
        e.pred_left += self.pred[s]
        if fresh:
            self.startver[s] = e.version
            self.started_at[s] = self.now
        if prefill_tokens:
            self._stall(e, prefill_tokens * self.prefill_token_s)

    def _on_done(self, idx: int, epoch: int) -> None:
        e = self.engines[idx]
        if epoch != e.epoch or not e.alive:
            return
        self._bring(e)
        limit = e.progress + _EPS_STEPS
        running, length, pred = e.running, self.length, self.pred
        finished = []
        while running and running[0][0] <= limit:
            finish, s = heapq.heappop(running)
            e.start_sum -= finish - length[s]
            e.pred_left -= pred[s]
            finished.append(s)
        if not running:
            e.start_sum = e.pred_left = 0.0  # drop accumulated float error
        for s in finished:
            self._sample_done(e, s)
        self._after_change(e)

    def _sample_done(self, e: _Engine, s: int) -> None:
        self.generated += 1
        self.endver[s] = e.version
        g = s // self.G
        self.done_in_group[g] += 1
        if self.streaming:
            if self.done_in_group[g] == self.G:
                self._stall(e, self.group_overhead)
                self._buffer(e, g)
            return
        b = g // self.B
        self.batch_left[b] -= 1
        e.batch_left[b] -= 1
        if e.batch_left[b] == 0:
            del e.batch_left[b]
            self._deliver(e, b)

    def _after_change(self, e: _Engine) -> None:
        """Whatever ``e`` does next: load weights, start queued work, ask for more."""
        if not e.alive:
            return
        if not e.loading and e.want_version > e.version:
            idle = not e.running and not e.queue and not e.deliveries
            if idle or (self.streaming and self.partial):
                self._begin_load(e)
        if self.streaming:
            if e.idx in self.flagged:
                return  # the pending dispatch schedules it
            if self._room(e):
                self.flagged.add(e.idx)
                self._request_dispatch()
                return
        elif not e.loading:
            # A batch-mode load waits behind the engine's generate call (Ray runs an actor's
            # calls in order), so queued work of the current call goes on meanwhile.
            self._fill_from_queue(e)
        if self.repack:
            self._track_straggler(e)
        self._schedule(e)

    # -- weights -------------------------------------------------------------------------

    def _begin_load(self, e: _Engine) -> None:
        """Load ``e.want_version``: the engine stalls for the pull, then holds it."""
        self._bring(e)
        e.loading = True
        e.load_id += 1
        self._stall(e, self.pull_s)
        self._push(max(e.stall_until, self.now), _LOADED, e.idx, e.load_id)

    def _on_loaded(self, idx: int, load_id: int) -> None:
        e = self.engines[idx]
        if not e.alive or not e.loading or load_id != e.load_id:
            return
        self._bring(e)
        e.loading = False
        e.version = max(e.version, e.want_version)
        if e.version >= self.latest:
            self.behind.discard(e.idx)
        if self.mode == "async" and self.latest > e.version:
            self._notice_at_next_poll(e)
        self._after_change(e)
        if self.mode != "async":
            self._maybe_advance()

    def _notice_at_next_poll(self, e: _Engine) -> None:
        period = self.sc.policy.weight_check_s
        if period <= 0:
            self._on_notice(e.idx, e.epoch)
            return
        phase = self.poll_phase[e.idx]
        ticks = max(math.ceil((self.now - phase) / period), 0)
        self._push(phase + ticks * period, _NOTICE, e.idx, 0)

    def _on_notice(self, idx: int, epoch: int) -> None:
        e = self.engines[idx]
        if not e.alive or self.latest <= e.version:
            return
        self._bring(e)
        e.want_version = max(e.want_version, self.latest)
        self._after_change(e)

    # -- failures ------------------------------------------------------------------------

    def _on_fail(self, idx: int, epoch: int) -> None:
        e = self.engines[idx]
        if not e.alive:
            return
        self._bring(e)
        self.failures += 1
        if e.unsent:  # simplification: its finished groups made it to the store
            self._put(e)
        lost = [s for _, s in e.running] + list(e.queue)
        for holders in self.batch_open.values():
            holders.discard(e.idx)  # its share (and any generate call returning) is lost
        e.running, e.queue, e.batch_left = [], deque(), {}
        e.start_sum = e.pred_left = 0.0
        e.alive, e.loading = False, False
        e.deliveries = set()
        e.stall_until = self.now
        e.epoch += 1
        self.stragglers.discard(e.idx)
        self.behind.discard(e.idx)
        self.requeued += len(lost)
        self.retry.extend(sorted(lost))
        self._push(self.now + self.sc.cluster.repair_s, _REPAIR, e.idx, 0)
        for other in self.engines:
            if other.alive:
                self._bring(other)
                self._after_change(other)
        if self.mode != "async":
            for b in list(self.batch_open):
                self._check_batch(b)
            self._maybe_advance()

    def _on_repair(self, idx: int, _: int) -> None:
        e = self.engines[idx]
        self._bring(e)
        e.alive = True
        e.progress = 0.0
        e.version = e.want_version = self.latest  # it starts with the newest weights
        e.loading = True
        e.load_id += 1
        self.behind.add(e.idx)
        self._stall(e, self.pull_s)
        self._push(e.stall_until, _LOADED, e.idx, e.load_id)
        rate = self.sc.cluster.failure_rate_per_hour
        self._push(self.now + self._fail_rng.exponential(3600.0 / rate), _FAIL, e.idx, 0)

    # -- async: dispatcher, store, trainer -----------------------------------------------

    def _room(self, e: _Engine) -> int:
        """Samples ``e`` asks for now (0: it does not ask), as Sluice's worker refills."""
        if not e.alive or e.loading or e.want_version > e.version:
            return 0
        n = len(e.running)
        room = e.cap - n
        # Admission holds a worker back until it loads a newer version (or a drop is
        # credited): it is asked again then, not on every finished request.
        if not self.retry and (room < self.G or self._allowance(e) <= 0):
            return 0
        if n and room < self.refill_at * e.cap:
            return 0
        return room

    def _request_dispatch(self) -> None:
        if not self.dispatch_pending:
            self.dispatch_pending = True
            self._push(self.now, _DISPATCH, 0, 0)

    def _fill_pool(self, want: int) -> None:
        p = self.sc.policy
        size = max(want, p.lookahead_steps * self.B)
        while len(self.pool_heap) + len(self.pool_fifo) < size:
            g = self.next_group
            self.next_group += 1
            self._ensure_groups(g + 1)
            if p.long_first:
                heapq.heappush(self.pool_heap, (-self.pred[g * self.G], g))
            else:
                self.pool_fifo.append(g)

    def _pop_pool(self) -> int:
        if self.sc.policy.long_first:
            return heapq.heappop(self.pool_heap)[1]
        return self.pool_fifo.popleft()

    def _unpop_pool(self, g: int) -> None:
        if self.sc.policy.long_first:
            heapq.heappush(self.pool_heap, (-self.pred[g * self.G], g))
        else:
            self.pool_fifo.appendleft(g)

    def _allowance(self, e: _Engine) -> int:
        return (e.version + self.k + 1) * self.B + self.credit - self.issued

    def _on_dispatch(self, _: int, __: int) -> None:
        self.dispatch_pending = False
        flagged = sorted(self.flagged)
        self.flagged.clear()
        asking = [i for i in flagged if self._room(self.engines[i]) > 0]
        for i in asking:  # failed engines' samples first, wherever there is room
            e = self.engines[i]
            while self.retry and len(e.running) < e.cap:
                self._bring(e)
                s = self.retry.popleft()
                self._start_sample(e, s, self.prompt)
        # Groups: longest predicted first (pool order), to the least-loaded engine (balance)
        # or each engine in turn, within each engine's admission allowance.
        open_ = [
            i
            for i in asking
            if self.engines[i].cap - len(self.engines[i].running) >= self.G
            and self._allowance(self.engines[i]) > 0
        ]
        if open_:
            self._fill_pool(len(open_) * self.engines[0].cap // self.G)
        if self.sc.policy.balance:
            order = [(self.engines[i].load(), i) for i in open_]
            heapq.heapify(order)
            while order:
                load, i = heapq.heappop(order)
                e = self.engines[i]
                g = self._pop_pool()
                self._give_group(e, g)
                if e.cap - len(e.running) >= self.G and self._allowance(e) > 0:
                    heapq.heappush(order, (load + self.pred[g * self.G] * self.G, i))
        else:
            for i in open_:
                e = self.engines[i]
                while e.cap - len(e.running) >= self.G and self._allowance(e) > 0:
                    self._give_group(e, self._pop_pool())
        for i in flagged:
            e = self.engines[i]
            if self.repack:
                self._track_straggler(e)
            self._schedule(e)

    def _give_group(self, e: _Engine, g: int) -> None:
        """Start all samples of group ``g`` on ``e``; its prompt is prefilled once (prefix
        caching shares it across the group)."""
        self._bring(e)
        self.issued += 1
        self.issued_samples += self.G
        p0, version, now = e.progress, e.version, self.now
        running, length, startver, started_at = (
            e.running,
            self.length,
            self.startver,
            self.started_at,
        )
        base = g * self.G
        for s in range(base, base + self.G):
            heapq.heappush(running, (p0 + length[s], s))
            startver[s] = version
            started_at[s] = now
        e.start_sum += p0 * self.G
        e.pred_left += self.pred[base] * self.G
        self._stall(e, self.prompt * self.prefill_token_s)

    def _buffer(self, e: _Engine, g: int) -> None:
        """Group ``g`` joins ``e``'s put buffer: put at once when it is full, else once its
        oldest group has waited ``group_ready_s`` (the worker's PUT_GROUPS / PUT_EVERY_S)."""
        e.unsent.append(g)
        if len(e.unsent) >= self.put_groups or self.ready_delay <= 0:
            self._put(e)
        elif len(e.unsent) == 1:
            self._push(self.now + self.ready_delay, _PUT, e.idx, e.put_id)

    def _put(self, e: _Engine) -> None:
        groups, e.unsent = e.unsent, []
        e.put_id += 1
        for g in groups:
            self._on_ready(g)

    def _on_put(self, idx: int, put_id: int) -> None:
        e = self.engines[idx]
        if put_id == e.put_id and e.unsent:
            self._put(e)

    def _on_ready(self, g: int) -> None:
        version = self._group_version(g)
        self.ready[g] = None
        heapq.heappush(self.ready_by_version, (version, g))
        self._try_train()

    def _try_train(self) -> None:
        tr = self.trainer
        if tr.busy or tr.version >= self.steps:
            return
        while self.ready_by_version and too_stale(tr.version, self.ready_by_version[0][0], self.k):
            _, g = heapq.heappop(self.ready_by_version)
            if g in self.ready:
                del self.ready[g]
                self.dropped += self.G
                if self.sc.policy.credit_drops:
                    self.credit += 1
                    for e in self.engines:
                        if self._room(e):
                            self.flagged.add(e.idx)
                    self._request_dispatch()
        if len(self.ready) < self.B:
            return
        groups = []
        for g in self.ready:
            groups.append(g)
            if len(groups) == self.B:
                break
        for g in groups:
            del self.ready[g]
        self._train([s for g in groups for s in range(g * self.G, (g + 1) * self.G)])

    def _group_version(self, g: int) -> int:
        first, last = g * self.G, (g + 1) * self.G
        spans = zip(self.startver[first:last], self.endver[first:last], strict=True)
        return group_version(spans, self.sc.policy.stale_by)

    def _train(self, samples: list[int]) -> None:
        tr = self.trainer
        tokens = 0
        for s in samples:
            tokens += self.length[s]
            self.first_token_lag[tr.version - self.startver[s]] += 1
        for g in dict.fromkeys(s // self.G for s in samples):  # whole groups, in order
            self.staleness[tr.version - self._group_version(g)] += self.G
        self.trained += len(samples)
        self.trained_tokens += tokens
        seconds = self.train_fixed + self.train_token_s * (tokens + self.prompt * len(samples))
        tr.busy = True
        tr.busy_s += seconds
        self._push(self.now + seconds, _TRAINED, 0, 0)

    def _on_trained(self, _: int, __: int) -> None:
        tr = self.trainer
        tr.busy = False
        tr.version += 1
        self.latest = tr.version
        if self.mode == "async":
            self.step_end.append(self.now)
            if tr.version < self.steps:
                for e in self.engines:
                    if e.alive:
                        self._notice_at_next_poll(e)
                self._try_train()
            return
        for e in self.engines:  # sync_weights(step) on every worker, queued behind its work
            if e.alive:
                self.behind.add(e.idx)
                self._bring(e)
                e.want_version = tr.version
                self._after_change(e)
        self._maybe_advance()

    # -- batch modes: sync and one_step --------------------------------------------------

    def _submit(self, b: int) -> None:
        """Hand batch ``b``'s groups to the live engines and start generating."""
        groups = list(range(b * self.B, (b + 1) * self.B))
        self._ensure_groups((b + 1) * self.B)
        live = [e for e in self.engines if e.alive]  # none: the batch waits in the retry queue
        p = self.sc.policy
        if p.long_first:
            groups.sort(key=lambda g: -self.pred[g * self.G])
        shares: dict[int, list[int]] = {e.idx: [] for e in live}
        if live and p.balance:
            order = [(0.0, e.idx) for e in live]
            for g in groups:
                load, i = heapq.heappop(order)
                shares[i].append(g)
                heapq.heappush(order, (load + self.pred[g * self.G] * self.G, i))
        elif live:  # Sluice's submit: problems[i::workers]
            for n, g in enumerate(groups):
                shares[live[n % len(live)].idx].append(g)
        self.batch_left[b] = self.B * self.G
        self.batch_open[b] = set()
        self.issued_samples += self.B * self.G
        for e in live:
            if not shares[e.idx]:
                continue
            self._bring(e)
            samples = [s for g in shares[e.idx] for s in range(g * self.G, (g + 1) * self.G)]
            e.queue.extend(samples)
            e.batch_left[b] = len(samples)
            self.batch_open[b].add(e.idx)
            self._after_change(e)
        if not live:
            self.retry.extend(s for g in groups for s in range(g * self.G, (g + 1) * self.G))

    def _fill_from_queue(self, e: _Engine) -> None:
        if not e.queue and self.retry and not e.deliveries and e.want_version <= e.version:
            self._take_retries(e)
        while e.queue and len(e.running) < e.cap:
            self._bring(e)
            s = e.queue.popleft()
            self._start_sample(e, s, self.prompt / self.G)

    def _take_retries(self, e: _Engine) -> None:
        """A batch-mode engine with nothing queued takes failed engines' samples."""
        while self.retry and len(e.queue) + len(e.running) < e.cap:
            s = self.retry.popleft()
            b = s // self.G // self.B
            e.queue.append(s)
            e.batch_left[b] = e.batch_left.get(b, 0) + 1
            self.batch_open[b].add(e.idx)

    def _deliver(self, e: _Engine, b: int) -> None:
        """``e`` finished its share of batch ``b``: its generate call returns after scoring."""
        e.deliveries.add(b)
        self._stall(e, self.sc.costs.batch_overhead_s)
        self._push(max(e.stall_until, self.now), _DELIVERED, e.idx, b)

    def _on_delivered(self, idx: int, b: int) -> None:
        e = self.engines[idx]
        if not e.alive or b not in e.deliveries:
            return
        self._bring(e)
        e.deliveries.discard(b)
        if b not in e.batch_left and b in self.batch_open:
            self.batch_open[b].discard(e.idx)
        self._check_batch(b)
        self._after_change(e)
        self._maybe_advance()

    def _check_batch(self, b: int) -> None:
        """Batch ``b`` is ready once every sample finished and every generate call returned."""
        if b in self.batch_open and self.batch_left[b] == 0 and not self.batch_open[b]:
            self.batch_ready.add(b)
            del self.batch_open[b]

    def _maybe_advance(self) -> None:
        """The flow's loop: start training, or start the next step, when it may."""
        tr = self.trainer
        if tr.busy or len(self.step_end) >= self.steps:
            return
        s = tr.version  # steps trained so far; the next batch to train is batch s
        if s > len(self.step_end):  # step s trained: it ends once every engine loaded it
            if self.behind:
                return
            self.step_end.append(self.now)
            if s >= self.steps:
                return
            if self.mode == "sync":
                self._submit(s)
        if s not in self.batch_ready:
            return
        if self.mode == "one_step" and s + 1 < self.steps and (s + 1) not in self.batch_left:
            self._submit(s + 1)  # generates with the previous weights while batch s trains
        self.batch_ready.discard(s)
        self._train(list(range(s * self.B * self.G, (s + 1) * self.B * self.G)))

    # -- repack ----------------------------------------------------------------------------

    def _track_straggler(self, e: _Engine) -> None:
        m = self.sc.policy.repack_max_stragglers
        if e.alive and not e.queue and not e.loading and 0 < len(e.running) <= m:
            self.stragglers.add(e.idx)
        else:
            self.stragglers.discard(e.idx)
            return
        if len(self.stragglers) >= 2:
            self._repack()

    def _repack(self) -> None:
        """Laminar's repack, as ``rl.dispatch.stragglers`` decides it."""
        min_age = self.sc.policy.repack_min_age_s
        eligible = [
            self.engines[i]
            for i in sorted(self.stragglers)
            if all(self.now - self.started_at[s] >= min_age for _, s in self.engines[i].running)
        ]
        if len(eligible) < 2:
            return
        for e in eligible:
            self._bring(e)

        def remaining(e: _Engine) -> float:
            done = [(s, e.progress - (f - self.length[s])) for f, s in e.running]
            return sum(max(self.pred[s] - d, 0.0) for s, d in done)

        target = min(eligible, key=lambda e: (-len(e.running), -remaining(e), e.idx))
        for src in eligible:
            if src is target:
                continue
            if len(target.running) + len(src.running) > target.cap:
                continue
            for finish, s in src.running:
                done = src.progress - (finish - self.length[s])
                self._start_sample(target, s, self.prompt + done, done, fresh=False)
                self.repacked += 1
            src.running = []
            src.start_sum = src.pred_left = 0.0
            self.stragglers.discard(src.idx)
            if self.mode != "async":  # its share of the batch now lives on the target
                for b, n in src.batch_left.items():
                    target.batch_left[b] = target.batch_left.get(b, 0) + n
                    self.batch_open[b].add(target.idx)
                for b in list(src.batch_left):
                    del src.batch_left[b]
                    self._deliver(src, b)
            self._after_change(src)
        self.stragglers.discard(target.idx)
        self._schedule(target)

    # -- result --------------------------------------------------------------------------

    def _result(self) -> SimResult:
        end = self.step_end[-1]
        self.now = end
        busy = idle = 0.0
        in_flight = len(self.retry)
        for e in self.engines:
            self._bring(e)
            busy += e.busy_s
            idle += e.idle_s
            in_flight += len(e.running) + len(e.queue)
        return SimResult(
            label=self.sc.policy.label
            if self.sc.cluster.placement == "disaggregated"
            else f"{self.sc.policy.label} (colocated)",
            steps=self.steps,
            wall_s=end,
            step_end_s=list(self.step_end),
            trained_samples=self.trained,
            trained_tokens=self.trained_tokens,
            generated_samples=self.generated,
            issued_samples=self.issued_samples,
            in_flight_samples=in_flight,
            dropped_samples=self.dropped,
            requeued_samples=self.requeued,
            failures=self.failures,
            repacked_requests=self.repacked,
            rollout_idle=idle / (busy + idle) if busy + idle > 0 else 0.0,
            trainer_idle=max(0.0, 1.0 - self.trainer.busy_s / end) if end > 0 else 0.0,
            staleness=dict(sorted(self.staleness.items())),
            first_token_lag=dict(sorted(self.first_token_lag.items())),
            warmup_steps=self.sc.workload.warmup_steps,
            events=self.events,
        )


def simulate(scenario: Scenario) -> SimResult:
    """Run ``scenario``'s policy for ``workload.steps`` training steps."""
    return _Run(scenario).run()
