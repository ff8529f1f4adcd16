"""Groups in flight at a checkpoint, as an Arrow file saved with it.

In ``async`` the rollout workers are mid-sample whenever the trainer checkpoints. The
session (``driver/session.py: Session.checkpoint``) collects every worker's unfinished
groups through the dispatcher (``GroupDispatcher.snapshot``) and saves them beside the
trainer's state as ``in_flight.arrow``: one row per sample, with its tokens so far, their
log-probs and weight versions, and an episode's turns. A run resumed from that checkpoint
continues them from their tokens under new group ids, before any fresh group and within
the same admission window (``GroupDispatcher.carry_on``), instead of starting over from
their prompts; a group that the staleness bound would drop anyway is not continued and its
prompt is drawn again (``split_stale``).

The snapshot is taken before the ledger's watermark, and workers go on generating: a
group may finish and be stored in between. The resume continues only the kept groups of
which no row was stored by the watermark (the trajectory store's restore names them,
``TrajectoryStore.carried``); the others are re-offered from their rows, never both.

Arrow, not pickle: nothing is unpickled from storage. A file of another format version, or
one that does not parse, is reported and its groups start over; the run goes on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import pyarrow as pa

from sluice.engines.protocols import Completion
from sluice.engines.rollout.messages import Handoff, PartialGroup, PartialSample
from sluice.envs import Problem, RewardResult
from sluice.rl.staleness import StaleBy, group_version, too_stale

log = logging.getLogger(__name__)

FILE = "in_flight.arrow"
FORMAT_VERSION = "1"
_FORMAT_KEY = b"sluice.in_flight"

SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("problem", pa.string()),  # JSON
        ("group_prompt_ids", pa.list_(pa.int32())),
        ("seed", pa.int64()),
        ("index", pa.int32()),
        ("predicted", pa.float64()),
        ("started_at", pa.float64()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float64())),
        ("mark_first", pa.list_(pa.int32())),
        ("mark_version", pa.list_(pa.int64())),
        ("done_text", pa.string()),  # null: not done
        ("done_finished", pa.bool_()),
        ("mask", pa.list_(pa.int8())),  # null: a single turn
        ("turns", pa.list_(pa.string())),
        ("turn_start", pa.int32()),
        ("result", pa.string()),  # JSON; null: no verdict yet
        ("prompt_ids", pa.list_(pa.int32())),  # an agent's own prompt; null: the group's
    ],
    metadata={_FORMAT_KEY: FORMAT_VERSION.encode()},
)


def problem_json(problem: Problem) -> str | None:
    """``problem`` as JSON; None (with a warning) when its fields hold data JSON cannot
    write (a data set's column of dates, say)."""
    try:
        return json.dumps(asdict(problem) | {"fields": dict(problem.fields)})
    except (TypeError, ValueError) as error:
        log.warning("prompt %s is not kept with the checkpoint: %s", problem.prompt_id, error)
        return None


def problem_from_json(text: str) -> Problem:
    return Problem(**json.loads(text))


class InFlightError(ValueError):
    """A saved file of groups in flight cannot be read; the message says why."""


def encode(groups: list[Handoff]) -> bytes:
    """``groups`` as one Arrow IPC stream (``SCHEMA``). A group whose problem JSON cannot
    write is left out (``problem_json``): it starts over after a resume."""
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for handoff in groups:
        group = handoff.group
        problem = problem_json(group.problem)
        if problem is None:
            continue
        for s in group.samples:
            rows["group_id"].append(handoff.group_id)
            rows["problem"].append(problem)
            rows["group_prompt_ids"].append(group.prompt_ids)
            rows["seed"].append(group.seed)
            rows["index"].append(s.index)
            rows["predicted"].append(s.predicted)
            rows["started_at"].append(s.started_at)
            rows["token_ids"].append(s.token_ids)
            rows["logprobs"].append(s.logprobs)
            rows["mark_first"].append([first for first, _ in s.marks])
            rows["mark_version"].append([version for _, version in s.marks])
            rows["done_text"].append(s.done.text if s.done else None)
            rows["done_finished"].append(s.done.finished if s.done else None)
            rows["mask"].append(s.mask)
            rows["turns"].append(s.turns)
            rows["turn_start"].append(s.turn_start)
            rows["result"].append(json.dumps(asdict(s.result)) if s.result else None)
            rows["prompt_ids"].append(s.prompt_ids)
    table = pa.Table.from_pydict(rows, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode(data: bytes) -> list[Handoff]:
    """The groups ``encode`` wrote, in their order; ``InFlightError`` naming what is wrong."""
    try:
        table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    except pa.ArrowException as error:
        raise InFlightError(f"not an Arrow stream ({error})") from error
    found = (table.schema.metadata or {}).get(_FORMAT_KEY, b"").decode()
    if found != FORMAT_VERSION:
        raise InFlightError(
            f"format version {found or 'none'!r}, this Sluice reads {FORMAT_VERSION}"
        )
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise InFlightError(f"columns {table.schema.names}, expected {SCHEMA.names}")
    groups: dict[str, PartialGroup] = {}
    for row in table.to_pylist():
        group = groups.get(row["group_id"])
        if group is None:
            problem = problem_from_json(row["problem"])
            group = PartialGroup(problem, row["group_prompt_ids"], [], row["seed"])
            groups[row["group_id"]] = group
        done = None
        if row["done_text"] is not None:
            done = Completion(
                row["token_ids"], row["logprobs"], row["done_text"], row["done_finished"]
            )
        group.samples.append(
            PartialSample(
                group=row["group_id"],
                index=row["index"],
                predicted=row["predicted"],
                started_at=row["started_at"],
                token_ids=row["token_ids"],
                logprobs=row["logprobs"],
                marks=list(zip(row["mark_first"], row["mark_version"], strict=True)),
                done=done,
                mask=row["mask"],
                turns=row["turns"],
                turn_start=row["turn_start"],
                result=RewardResult(**json.loads(row["result"])) if row["result"] else None,
                prompt_ids=row["prompt_ids"],
            )
        )
    return [Handoff(group_id, group) for group_id, group in groups.items()]


@dataclass(frozen=True)
class Carried:
    """What a resume does with the groups a checkpoint kept: ``fresh`` go on, ``stale``
    (the staleness bound would drop them) start over from their prompts."""

    fresh: list[Handoff]
    stale: list[Handoff]

    def reasons(self, max_staleness: int) -> dict[str, str]:
        """The ledger's reason for each kept sample's old id, by sample id."""
        carried = "in flight at the checkpoint; continued from its tokens under a new id"
        stale = (
            f"in flight at the checkpoint; too stale to continue (max_staleness "
            f"{max_staleness}); its prompt is drawn again"
        )
        return {
            f"{h.group_id}/{s.index}": reason
            for handoffs, reason in ((self.fresh, carried), (self.stale, stale))
            for h in handoffs
            for s in h.group.samples
        }


def split_stale(groups: list[Handoff], step: int, max_staleness: int, by: StaleBy) -> Carried:
    """Which kept groups a run resumed at ``step`` may continue: a group's version counts as
    the staleness rule dates it (``rl/staleness.py``), with the tokens still to come of
    its unfinished samples at version ``step``."""
    fresh: list[Handoff] = []
    stale: list[Handoff] = []
    for handoff in groups:
        spans = []
        for s in handoff.group.samples:
            versions = [version for _, version in s.marks] or [step]
            spans.append((versions[0], versions[-1] if s.done is not None else step))
        version = group_version(spans, by)
        (stale if too_stale(step, version, max_staleness) else fresh).append(handoff)
    return Carried(fresh, stale)
