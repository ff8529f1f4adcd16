import pyarrow as pa
import pytest

from sluice.engines.protocols import Completion
from sluice.engines.rollout import in_flight
from sluice.engines.rollout.messages import Handoff, PartialGroup, PartialSample
from sluice.envs import Problem, RewardResult

PROBLEM = Problem("calc/train/0/7", "calculator", "2+3=", "5", "train", {"level": 2})


def _groups() -> list[Handoff]:
    """One group of each kind: a single-turn group half done, and an episode waiting on
    its environment beside one that ended with a verdict."""
    finished = PartialSample(
        "g1",
        0,
        12.0,
        100.5,
        [4, 5, 2],
        [-0.1, -0.2, -0.3],
        [(0, 3)],
        Completion([4, 5, 2], [-0.1, -0.2, -0.3], "45", True),
    )
    running = PartialSample("g1", 1, 12.0, 100.5, [4, 6], [-0.5, -0.25], [(0, 3), (1, 4)])
    waiting = PartialSample(
        "g2",
        0,
        30.0,
        101.0,
        [7, 8, 9, 10],
        [-1.0, 0.0, 0.0, -0.5],
        [(0, 4)],
        mask=[1, 0, 0, 1],
        turns=["call add", "5", "=5"],
        turn_start=3,
    )
    ended = PartialSample(
        "g2",
        1,
        30.0,
        101.0,
        [7, 11],
        [-1.0, -2.0],
        [(0, 4)],
        Completion([7, 11], [-1.0, -2.0], "x", True),
        mask=[1, 1],
        turns=["x"],
        result=RewardResult(0.0, False, error="bad tool", metrics={"calls": 1.0}),
    )
    return [
        Handoff("g1", PartialGroup(PROBLEM, [1, 2, 3], [finished, running], seed=11)),
        Handoff("g2", PartialGroup(PROBLEM, [1, 2, 3], [waiting, ended], seed=12)),
    ]


def test_groups_in_flight_read_back_as_they_were_written():
    groups = _groups()
    assert in_flight.decode(in_flight.encode(groups)) == groups


def test_a_file_of_another_format_or_not_arrow_is_refused_with_the_reason():
    data = in_flight.encode(_groups())
    table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    sink = pa.BufferOutputStream()
    other = table.schema.with_metadata({b"sluice.in_flight": b"99"})
    with pa.ipc.new_stream(sink, other) as writer:
        writer.write_table(table.replace_schema_metadata(other.metadata))
    with pytest.raises(in_flight.InFlightError, match="format version '99'"):
        in_flight.decode(sink.getvalue().to_pybytes())
    with pytest.raises(in_flight.InFlightError, match="not an Arrow stream"):
        in_flight.decode(b"PK\x03\x04 a zip")


def test_a_group_whose_problem_json_cannot_hold_is_left_out():
    odd = Problem("p", "e", "q", "a", "train", {"when": object()})
    groups = [*_groups(), Handoff("g3", PartialGroup(odd, [1], [PartialSample("g3", 0, 1.0)], 1))]
    assert [h.group_id for h in in_flight.decode(in_flight.encode(groups))] == ["g1", "g2"]


def test_kept_groups_the_staleness_bound_would_drop_start_over():
    g1, g2 = _groups()  # g1's tokens come from versions 3 and 4, g2's from version 4
    # Resumed at step 6 with max_staleness 2: a group dated by its first token (3) is too
    # stale, and so is one whose samples all finished at version 3 by their last token.
    by_first = in_flight.split_stale([g1, g2], 6, 2, "first_token")
    assert [h.group_id for h in by_first.stale] == ["g1"]
    assert [h.group_id for h in by_first.fresh] == ["g2"]
    by_last = in_flight.split_stale([g1, g2], 6, 2, "last_token")
    assert by_last.stale == [] and len(by_last.fresh) == 2  # unfinished tokens come at 6
    done = Handoff("g9", PartialGroup(PROBLEM, [1], [g1.group.samples[0]], 1))
    assert in_flight.split_stale([done], 6, 2, "last_token").stale == [done]
    reasons = by_first.reasons(2)
    assert reasons["g2/0"].endswith("continued from its tokens under a new id")
    assert "too stale to continue (max_staleness 2)" in reasons["g1/1"]
