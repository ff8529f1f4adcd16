"""Skew-aware dispatch: predict response lengths, order and balance groups, repack stragglers.

RL response lengths have a long tail, so a rollout worker that receives the long groups last
straggles while the others idle. Three pure pieces, driven by the dispatcher in the flow:

- ``LengthPredictor`` learns, online, how many tokens a prompt's samples will take
  (StreamRL's output-length ranker, arXiv 2504.15930, Sec. 5, here a table, not a model).
- ``plan`` hands prompt groups to workers longest-predicted first, each to the least-loaded
  worker with room (StreamRL's skewness-aware dispatching; greedy LPT, Graham 1969).
- ``stragglers`` finds workers whose batch has drained to a few old requests and moves them
  all onto one worker, freeing the rest for fresh work (Laminar's repack, arXiv 2510.12633).

Nothing here holds a clock or a worker handle: callers pass ``now`` and the loads they see.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class LengthPredictor:
    """Online estimate of response tokens per sample, from the lengths this run has seen.

    A prompt seen before is predicted by an exponential moving average of its groups' mean
    lengths (prompts come round again each epoch, and the policy's lengths drift between).
    An unseen prompt is predicted from its environment: the mean response length of prompts
    in the same power-of-two prompt-length bucket, else the environment's mean, else
    ``prior``. Each call is O(1); memory is one float per prompt plus a few per environment.

    Args:
        alpha: weight of the newest group in a prompt's EMA, in (0, 1]. 0.5 because a prompt
            recurs only once per epoch: the latest length (the current policy) and the history
            get equal say.
        prior: tokens per sample assumed for an environment nothing is known about. A guess,
            not a measurement: it only orders groups until that environment's first group
            returns.
        window: groups after which an environment's running means turn into EMAs with weight
            1/window, so they follow the policy as its lengths drift during training.
    """

    def __init__(self, alpha: float = 0.5, prior: float = 1024.0, window: int = 256) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if prior <= 0.0:
            raise ValueError(f"prior must be positive, got {prior}")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.alpha = alpha
        self.prior = prior
        self.window = window
        self._prompt: dict[tuple[str, str], float] = {}
        # (count, mean) per environment, and per (environment, prompt-length bucket).
        self._env: dict[str, tuple[int, float]] = {}
        self._bucket: dict[tuple[str, int], tuple[int, float]] = {}

    def observe(self, prompt_id: str, env: str, prompt_len: int, lengths: list[int]) -> None:
        """Record the response lengths (tokens) of one finished group of ``prompt_id``."""
        if not lengths:
            raise ValueError(f"group of prompt {prompt_id!r} has no response lengths")
        if min(lengths) < 0:
            raise ValueError(f"prompt {prompt_id!r} has a negative response length: {lengths}")
        bucket = (env, _bucket(prompt_len))  # validates prompt_len before any state changes
        mean = sum(lengths) / len(lengths)
        key = (env, prompt_id)
        old = self._prompt.get(key)
        self._prompt[key] = mean if old is None else old + self.alpha * (mean - old)
        self._env[env] = self._update(self._env.get(env), mean)
        self._bucket[bucket] = self._update(self._bucket.get(bucket), mean)

    def predict(self, prompt_id: str, env: str, prompt_len: int) -> float:
        """Expected response tokens per sample for one sample of ``prompt_id``."""
        seen = self._prompt.get((env, prompt_id))
        if seen is not None:
            return seen
        for stats in (self._bucket.get((env, _bucket(prompt_len))), self._env.get(env)):
            if stats is not None:
                return stats[1]
        return self.prior

    def _update(self, stats: tuple[int, float] | None, x: float) -> tuple[int, float]:
        count, mean = stats if stats is not None else (0, 0.0)
        count = min(count + 1, self.window)
        return count, mean + (x - mean) / count


def _bucket(prompt_len: int) -> int:
    # Power-of-two buckets: response length tracks the order of magnitude of the prompt, and
    # ~20 buckets cover any context length, so the table stays small and fills up fast.
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be non-negative, got {prompt_len}")
    return prompt_len.bit_length()


@dataclass(frozen=True)
class GroupRequest:
    """One prompt group to generate: ``samples`` completions of one prompt.

    ``predicted`` is the expected response tokens per sample (``LengthPredictor.predict``).
    """

    group_id: str
    prompt_id: str
    env: str
    prompt_len: int
    samples: int
    predicted: float

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"group {self.group_id!r}: samples must be >= 1, got {self.samples}")
        if self.predicted < 0.0:
            raise ValueError(f"group {self.group_id!r}: predicted must be >= 0")

    @property
    def tokens(self) -> float:
        """Predicted response tokens of the whole group."""
        return self.predicted * self.samples


@dataclass(frozen=True)
class WorkerLoad:
    """What a rollout worker has now: predicted tokens in flight, and room for more groups."""

    worker: int
    queued_tokens: float
    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"worker {self.worker}: capacity must be >= 0, got {self.capacity}")


@dataclass(frozen=True)
class Plan:
    """Groups per worker, in submission order, and the groups no worker had room for.

    ``assignments`` has a (possibly empty) list for every worker passed to ``plan``; ``left``
    keeps dispatch order, so the caller can put it back at the head of its queue.
    """

    assignments: dict[int, list[GroupRequest]]
    left: list[GroupRequest]


def plan(
    groups: list[GroupRequest],
    workers: list[WorkerLoad],
    long_first: bool = True,
    balance: bool = True,
) -> Plan:
    """Assign prompt groups to rollout workers, skew-aware.

    With ``long_first`` groups go out by predicted total tokens (``predicted * samples``),
    longest first, ties in input order: the long tail starts early instead of straggling at
    the end (StreamRL, arXiv 2504.15930, skewness-aware dispatching). With ``balance`` each
    group goes to the worker with the smallest predicted load (queued plus assigned tokens)
    that still has capacity, ties to the earlier worker in ``workers``: longest-processing-
    time-first, whose makespan is within 4/3 - 1/(3m) of optimal on m workers (Graham 1969).
    Without it, groups go round-robin over the workers with capacity. O(groups * log workers).
    """
    ids = [w.worker for w in workers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids must be unique, got {ids}")
    order = sorted(groups, key=lambda g: -g.tokens) if long_first else list(groups)
    room = [w.capacity for w in workers]
    assignments: dict[int, list[GroupRequest]] = {w: [] for w in ids}
    left: list[GroupRequest] = []
    # Balance: the open workers in a heap by (load, position), the least loaded on top.
    # Round-robin: the open positions in order, a cursor going round them.
    heap = [(w.queued_tokens, i) for i, w in enumerate(workers) if w.capacity > 0]
    heapq.heapify(heap)
    cycle = deque(i for i in range(len(workers)) if room[i] > 0)
    for group in order:
        if not (heap if balance else cycle):
            left.append(group)
            continue
        if balance:
            load, pick = heapq.heappop(heap)
        else:
            pick = cycle.popleft()
        assignments[ids[pick]].append(group)
        room[pick] -= 1
        if room[pick] > 0:
            if balance:
                heapq.heappush(heap, (load + group.tokens, pick))
            else:
                cycle.append(pick)
    return Plan(assignments, left)


@dataclass(frozen=True)
class InFlight:
    """One request (one sample) still generating on a worker.

    ``predicted`` is its expected total response tokens; ``tokens_so_far`` those generated.
    """

    request_id: str
    group_id: str
    started_at: float
    tokens_so_far: int
    predicted: float

    @property
    def remaining(self) -> float:
        """Predicted tokens still to generate (never negative: it may outrun its prediction)."""
        return max(self.predicted - self.tokens_so_far, 0.0)


@dataclass(frozen=True)
class RepackPlan:
    """Move ``moves[source]`` (request ids) from each source worker onto ``target``."""

    target: int
    moves: dict[int, list[str]]


def stragglers(
    in_flight: Mapping[int, Sequence[InFlight]],
    max_stragglers: int,
    min_age_s: float,
    now: float,
) -> RepackPlan | None:
    """Repack long-tail requests onto one worker (Laminar, arXiv 2510.12633, dynamic repack).

    Rules:
    - A worker *straggles* when its batch has drained to between 1 and ``max_stragglers``
      requests and every one of them started at least ``min_age_s`` before ``now`` (young
      requests may still finish soon; moving them costs more than it saves).
    - Nothing moves unless at least two workers straggle; busy and idle workers never send
      or receive.
    - The target is the straggling worker with the most requests (fewest moves), then the
      most predicted remaining tokens (its tail is longest), then the smallest id.
    - Every other straggling worker sends all its requests there, in their in-flight order,
      and is then free for fresh groups. The target ends with at most
      ``max_stragglers * straggling workers`` requests: choose ``max_stragglers`` so that fits.
    """
    if max_stragglers < 1:
        raise ValueError(f"max_stragglers must be >= 1, got {max_stragglers}")
    if min_age_s < 0.0:
        raise ValueError(f"min_age_s must be >= 0, got {min_age_s}")
    straggling = {
        worker: reqs
        for worker, reqs in in_flight.items()
        if 0 < len(reqs) <= max_stragglers and all(now - r.started_at >= min_age_s for r in reqs)
    }
    if len(straggling) < 2:
        return None
    target = min(
        straggling,
        key=lambda w: (-len(straggling[w]), -sum(r.remaining for r in straggling[w]), w),
    )
    moves = {
        worker: [r.request_id for r in reqs]
        for worker, reqs in sorted(straggling.items())
        if worker != target
    }
    return RepackPlan(target, moves)
