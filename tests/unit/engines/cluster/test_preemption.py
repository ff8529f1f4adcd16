"""The logic of engines/cluster/preemption.py: the spot-notice poll and parse against a small IMDSv2
stand-in on 127.0.0.1 (the real service exists only on EC2), and the choice of node and
deadline against a fixed node table. The drain itself is tested on a real Ray cluster in
tests/integration/test_preemption_drain.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from sluice.engines.cluster.preemption import (
    DrainError,
    ImdsClient,
    ImdsError,
    InterruptionNotice,
    RayDrainer,
    main,
    parse_instance_action,
    watch,
)
from tests.support.fake_imds import FakeImds, running_imds


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    with running_imds() as server:
        yield server


NOTICE = {"action": "terminate", "time": "2026-11-22T08:22:00Z"}


def test_parse_notice_gives_action_and_utc_deadline() -> None:
    notice = parse_instance_action(json.dumps(NOTICE))
    assert notice == InterruptionNotice("terminate", datetime(2026, 11, 22, 8, 22, tzinfo=UTC))
    # 2026-11-22T08:22:00Z in Unix milliseconds.
    assert notice.deadline_ms == 1_795_335_720_000


def test_parse_converts_offsets_to_utc() -> None:
    notice = parse_instance_action('{"action": "stop", "time": "2026-11-22T10:22:00+02:00"}')
    assert notice.time == datetime(2026, 11, 22, 8, 22, tzinfo=UTC)
    assert notice.action == "stop"


@pytest.mark.parametrize(
    ("body", "names"),
    [
        pytest.param("not json", "not JSON", id="not-json"),
        pytest.param("[1, 2]", "JSON object", id="not-object"),
        pytest.param(
            '{"action": "reboot", "time": "2026-11-22T08:22:00Z"}', "'action'", id="action"
        ),
        pytest.param('{"action": "terminate"}', "'time'", id="no-time"),
        pytest.param('{"action": "terminate", "time": "soon"}', "ISO 8601", id="bad-time"),
        pytest.param(
            '{"action": "terminate", "time": "2026-11-22T08:22:00"}', "time zone", id="naive"
        ),
    ],
)
def test_parse_rejects_bad_notices_naming_the_fault(body: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse_instance_action(body)


def test_no_notice_is_none_and_one_token_serves_many_reads(imds: FakeImds) -> None:
    client = ImdsClient(imds.url)
    assert [client.spot_notice() for _ in range(3)] == [None, None, None]
    assert client.instance_id() == "i-0123456789abcdef0"
    assert imds.token_puts == 1
    assert imds.spot_gets == 3


def test_posted_notice_is_read(imds: FakeImds) -> None:
    client = ImdsClient(imds.url)
    imds.notice = json.dumps(NOTICE).encode()
    assert client.spot_notice() == parse_instance_action(json.dumps(NOTICE))


def test_refused_token_is_renewed_once(imds: FakeImds) -> None:
    client = ImdsClient(imds.url)
    assert client.spot_notice() is None
    imds.rotate_token()
    assert client.spot_notice() is None
    assert imds.token_puts == 2


def test_token_refused_twice_is_an_imds_error(imds: FakeImds) -> None:
    imds.reject_tokens = True
    with pytest.raises(ImdsError, match="refused a fresh token"):
        ImdsClient(imds.url).spot_notice()
    assert imds.token_puts == 2


def test_server_error_is_an_imds_error(imds: FakeImds) -> None:
    client = ImdsClient(imds.url)
    imds.fail_next = 1
    with pytest.raises(ImdsError, match="HTTP 500"):
        client.spot_notice()


def test_watch_polls_through_failures_and_drains_once(imds: FakeImds) -> None:
    client = ImdsClient(imds.url)
    drained: list[InterruptionNotice] = []

    def drain(notice: InterruptionNotice) -> None:
        drained.append(notice)

    # Post the notice only after a few empty polls and two failed ones.
    imds.fail_next = 2

    def post_later() -> None:
        while imds.spot_gets < 3:
            threading.Event().wait(0.005)
        imds.notice = json.dumps(NOTICE).encode()

    poster = threading.Thread(target=post_later)
    poster.start()
    notice = watch(client, drain, poll_interval_s=0.01)
    poster.join()
    assert notice == parse_instance_action(json.dumps(NOTICE))
    assert drained == [notice]
    assert imds.spot_gets >= 4


def test_watch_stops_without_draining_when_asked(imds: FakeImds) -> None:
    stop = threading.Event()
    drained: list[InterruptionNotice] = []
    timer = threading.Timer(0.1, stop.set)
    timer.start()
    assert watch(ImdsClient(imds.url), drained.append, poll_interval_s=0.01, stop=stop) is None
    timer.join()
    assert drained == []
    assert imds.spot_gets >= 2


def test_watch_surfaces_a_notice_it_cannot_parse(imds: FakeImds) -> None:
    imds.notice = b'{"action": "explode", "time": "2026-11-22T08:22:00Z"}'
    with pytest.raises(ValueError, match="'action'"):
        watch(ImdsClient(imds.url), lambda notice: None, poll_interval_s=0.01)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "--gcs-address is required", id="no-address"),
        pytest.param(["--gcs-address", "h:6379", "--poll-interval", "0"], "> 0", id="interval"),
    ],
)
def test_main_rejects_bad_arguments(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@dataclass
class _NodeInfo:
    node_name: str
    state: int


class FakeGcs:
    """The two GcsClient calls RayDrainer makes, answering from a fixed node table."""

    def __init__(self, nodes: dict[str, _NodeInfo], accept: bool = True) -> None:
        # Ray keys the table by NodeID objects; bytes have the same .hex().
        self.nodes = {bytes.fromhex(k): v for k, v in nodes.items()}
        self.accept = accept
        self.drains: list[tuple[Any, ...]] = []

    def get_all_node_info(self, timeout: float) -> dict[bytes, _NodeInfo]:
        return self.nodes

    def drain_node(self, *args: Any, timeout: float) -> tuple[bool, str]:
        self.drains.append(args)
        return (True, "") if self.accept else (False, "node is not idle")


def _drainer(gcs: FakeGcs, name: str = "i-0abc") -> RayDrainer:
    drainer = RayDrainer("10.0.0.1:6379", name)
    drainer._client = lambda: gcs  # type: ignore[method-assign]
    return drainer


ALIVE, DEAD = 0, 1


def test_drainer_drains_the_alive_node_of_that_name_with_the_notice_deadline() -> None:
    from ray.core.generated import autoscaler_pb2

    gcs = FakeGcs({"aa": _NodeInfo("i-0abc", DEAD), "bb": _NodeInfo("i-0abc", ALIVE)})
    gcs.nodes[bytes.fromhex("cc")] = _NodeInfo("i-0other", ALIVE)
    notice = parse_instance_action(json.dumps(NOTICE))
    _drainer(gcs)(notice)
    (node_id, reason, message, deadline_ms), *rest = gcs.drains
    assert rest == []
    assert node_id == "bb"
    assert reason == autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    # The notice lies in the past here, so the deadline is "now", never earlier.
    assert deadline_ms >= notice.deadline_ms
    assert "terminate at 2026-11-22T08:22:00+00:00" in message


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param({"aa": _NodeInfo("i-0abc", DEAD)}, id="none-alive"),
        pytest.param(
            {"aa": _NodeInfo("i-0abc", ALIVE), "bb": _NodeInfo("i-0abc", ALIVE)}, id="two-alive"
        ),
    ],
)
def test_drainer_refuses_to_guess_the_node(nodes: dict[str, _NodeInfo]) -> None:
    gcs = FakeGcs(nodes)
    with pytest.raises(DrainError, match="expected one alive Ray node named 'i-0abc'"):
        _drainer(gcs)(parse_instance_action(json.dumps(NOTICE)))
    assert gcs.drains == []


def test_drainer_reports_a_refused_drain() -> None:
    gcs = FakeGcs({"aa": _NodeInfo("i-0abc", ALIVE)}, accept=False)
    with pytest.raises(DrainError, match="Ray refused to drain node aa: node is not idle"):
        _drainer(gcs)(parse_instance_action(json.dumps(NOTICE)))
