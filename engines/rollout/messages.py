"""The messages between rollout workers, the dispatcher and the flow, in one place.

A streaming rollout worker (``engines/rollout/worker.py``) asks the dispatcher
(``engines/rollout/dispatcher.py``) for work and gets a ``Work``: fresh ``Assignment``s, groups
repacked onto it (``Handoff``, holding ``PartialGroup``s of ``PartialSample``s), and maybe an
order to hand its own over. It reports finished groups as ``GroupDone``; the flow reads the
dispatcher's ``RolloutTotals``. A batch-mode ``rollout`` call answers ``RolloutStats``.
``StreamSettings`` is what one worker's stream is told when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engines.protocols import Completion
from sluice.envs import Problem, RewardResult
from sluice.rl.advantages import Credit

# Reasons of failed rewards carried to the flow per batch or drain (it shows the first few).
MESSAGES_KEPT = 3


@dataclass(frozen=True)
class RolloutStats:
    """What one ``rollout`` call produced, in counts (the samples went to the store)."""

    samples: int
    groups: int
    tokens: int
    reward_sum: float
    correct: int
    truncated: int
    reward_errors: int
    behaviour_version: int
    # Sums of the user reward functions' metrics over the samples that scored, by name, and
    # the first failed samples' reasons (for the console).
    reward_metrics: dict[str, float] = field(default_factory=dict)
    reward_messages: tuple[str, ...] = ()
    # Multi-turn: what the worker counted of the episodes
    # (``driver.rollout_metrics.EPISODE_COUNTERS``).
    episode_counts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupDone:
    """A finished group as a streaming worker reports it to its source."""

    group_id: str
    prompt_id: str
    prompt_len: int
    lengths: list[int]
    reward_sum: float
    correct: int
    truncated: int
    reward_errors: int
    reward_metrics: dict[str, float] = field(default_factory=dict)
    reward_messages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Served:
    """The weight version a rollout worker's engine holds and the digest of what it loaded
    of it (``storage.params.Weights.loaded``; "" for none pulled: the starting policy, or a
    load the engine skipped or cut short)."""

    version: int
    digest: str


@dataclass(frozen=True)
class BatchShard:
    """How a batch-mode ``rollout`` call generates its share of a batch."""

    n: int  # samples per prompt
    max_new_tokens: int
    temperature: float
    seed: int
    tag: str  # sample ids are <prompt id>@<tag>.<place in the shard>/<j>
    credit: Credit  # how its groups' rewards become advantages
    # The policy version the batch is generated with: a worker holding an older one (Ray
    # restarted it) loads it first, waiting up to pull_timeout_s for the relay.
    version: int = 0
    pull_timeout_s: float = 120.0


@dataclass(frozen=True)
class StreamSettings:
    """What one worker's ``stream`` is told when it starts (``async``)."""

    worker: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    credit: Credit  # how its groups' rewards become advantages
    concurrency: int  # samples in flight at most: vLLM's running batch
    partial_rollout: bool = True
    weight_check_s: float = 0.1
    report_every_s: float = 0.5  # at least this long between reports; the dispatcher paces
    pull_timeout_s: float = 120.0
    # Repack: send the running samples with each ask once at most this many are left
    # (0: never).
    repack_max_stragglers: int = 0


@dataclass
class PartialSample:
    """One sample of a group as far as a streaming worker has generated it."""

    group: str
    index: int
    predicted: float
    started_at: float = 0.0  # time.time() when it first started, on whichever worker
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (first token, version)
    done: Completion | None = None
    offset: int = 0  # tokens it had when its running engine request started
    # Multi-turn episodes: 0 on the tokens an environment added (None: a single turn), the
    # turns so far (model and environment, alternating), where the model's current turn
    # began in ``token_ids``, and the verdict once the episode ended.
    mask: list[int] | None = None
    turns: list[str] = field(default_factory=list)
    turn_start: int = 0
    result: RewardResult | None = None
    prompt_ids: list[int] | None = None  # an agent's own prompt (None: its group's)


@dataclass
class PartialGroup:
    """A group on a streaming worker: its problem, tokenized prompt and samples."""

    problem: Problem
    prompt_ids: list[int]
    samples: list[PartialSample]
    seed: int


@dataclass(frozen=True)
class Handoff:
    """An unfinished group moved to another worker by repack: its samples as they stood
    (finished ones with their completion, the others with the tokens generated so far)."""

    group_id: str
    group: PartialGroup


@dataclass(frozen=True)
class Assignment:
    """One prompt group for a worker: n samples of ``problem``, seeds from ``seed``."""

    problem: Problem
    group_id: str
    seed: int
    predicted: float


@dataclass(frozen=True)
class Work:
    """A ``take``'s answer: fresh groups, groups repacked onto this worker, and whether it
    should hand its own unfinished groups to another worker (``give_to``).

    ``held_until``: with nothing to hand out, the weight version from which admission lets
    this worker start a group. The worker does not ask again before it holds that version,
    unless a report's answer (``ReportReply.ask``) says so: held workers do not poll.
    ``incarnation``: which process of the dispatcher answered; a worker that sees a new one
    tells it which groups it holds (``GroupDispatcher.reclaim``).
    """

    assignments: list[Assignment]
    handoffs: list[Handoff] = field(default_factory=list)
    give_to: int | None = None
    held_until: int | None = None
    incarnation: int = 0


@dataclass(frozen=True)
class ReportReply:
    """The dispatcher's answer to a worker's report: ``ask``, take now (admission opened at
    the worker's version, groups were repacked onto it, the repack plan moves it, or the
    dispatcher stopped); ``report_every_s``, when to report next (the dispatcher paces
    reports to a budget for the whole fleet); ``incarnation``, as in ``Work``; ``keep``,
    the number of the checkpoint's snapshot of groups in flight the worker has not sent
    yet (0: none asked; ``GroupDispatcher.snapshot``)."""

    ask: bool
    report_every_s: float
    incarnation: int = 0
    keep: int = 0


@dataclass
class RolloutTotals:
    groups: int = 0
    samples: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    correct: int = 0
    truncated: int = 0
    reward_errors: int = 0
    repacked: int = 0  # groups moved between workers by repack
    lengths: list[int] = field(default_factory=list)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    reward_messages: list[str] = field(default_factory=list)

    def add_reward_metrics(self, sums: dict[str, float], messages: tuple[str, ...]) -> None:
        for name, value in sums.items():
            self.reward_metrics[name] = self.reward_metrics.get(name, 0.0) + value
        self.reward_messages.extend(messages[: max(0, MESSAGES_KEPT - len(self.reward_messages))])
