"""Spot interruption watcher: drain this Ray node as soon as EC2 announces its end.

A spot worker runs it as a systemd service (infra/terraform's worker user data installs
``sluice-preemption.service``)::

    python -m sluice.engines.cluster.preemption --gcs-address 10.0.1.5:6379

Components, driven from ``watch()``:

- ``ImdsClient`` reads the EC2 instance metadata service with IMDSv2: a session token from
  ``PUT /latest/api/token``, then ``GET /latest/meta-data/spot/instance-action`` (404 means
  no notice; a notice is JSON ``{"action": "terminate", "time": "...Z"}``, about two
  minutes ahead).
- ``parse_instance_action`` turns that body into an ``InterruptionNotice``.
- ``RayDrainer`` asks Ray's GCS to drain this node (``GcsClient.drain_node`` with reason
  ``DRAIN_NODE_REASON_PREEMPTION``, the call behind Ray's hidden ``ray drain-node`` CLI) with
  the notice's time as the deadline.

What the drain buys: from the notice on, Ray places no new tasks or actors on the node, the
node shows up in ``GcsClient.get_draining_nodes()`` with its deadline (so Sluice's pools can
re-queue the leases of the actors there before they die: docs/operating.md), and once the
node is idle its raylet exits and the node is recorded dead with reason
``AUTOSCALER_DRAIN_PREEMPTED`` rather than as a crash. Ray 2.60 also drains a node when
``ray start --block`` gets SIGTERM, but that happens only at OS shutdown, when the two
minutes are nearly gone; this watcher starts the drain at the notice.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

# The link-local address every EC2 instance reaches its metadata service on.
IMDS_URL = "http://169.254.169.254"
# AWS advises polling the interruption notice every 5 seconds; the notice comes ~120 s ahead.
POLL_INTERVAL_S = 5.0
# IMDSv2 session tokens may live up to 6 hours; we renew a minute before expiry.
TOKEN_TTL_S = 21600
TOKEN_RENEW_MARGIN_S = 60.0
# A metadata request that takes longer than this is treated as failed and retried next poll.
IMDS_TIMEOUT_S = 2.0
# The GCS answers a drain in milliseconds; bound the call so a lost head cannot hang us.
DRAIN_RPC_TIMEOUT_S = 10.0
# The actions EC2 announces for spot interruptions (instance-interruption behaviour).
SPOT_ACTIONS = frozenset({"terminate", "stop", "hibernate"})


class ImdsError(RuntimeError):
    """The metadata service answered with something other than data or 404."""


class DrainError(RuntimeError):
    """Ray did not accept the drain, or the node to drain could not be identified."""


@dataclass(frozen=True)
class InterruptionNotice:
    """A spot interruption notice: what EC2 will do to the instance, and when (UTC)."""

    action: str
    time: datetime

    @property
    def deadline_ms(self) -> int:
        """The notice's time as Unix milliseconds, the unit Ray's drain deadline uses."""
        return int(self.time.timestamp() * 1000)


def parse_instance_action(body: bytes | str) -> InterruptionNotice:
    """Parse ``/latest/meta-data/spot/instance-action``; errors name the field at fault."""
    try:
        doc = json.loads(body)
    except ValueError as error:
        raise ValueError(f"spot instance-action is not JSON: {body!r:.200}") from error
    if not isinstance(doc, dict):
        raise ValueError(f"spot instance-action must be a JSON object, got {doc!r:.200}")
    action = doc.get("action")
    if action not in SPOT_ACTIONS:
        raise ValueError(
            f"spot instance-action 'action' must be one of {sorted(SPOT_ACTIONS)}, got {action!r}"
        )
    raw_time = doc.get("time")
    if not isinstance(raw_time, str):
        raise ValueError(f"spot instance-action 'time' must be a string, got {raw_time!r}")
    try:
        when = datetime.fromisoformat(raw_time.replace("Z", "+00:00"))
    except ValueError as error:
        raise ValueError(
            f"spot instance-action 'time' is not an ISO 8601 time: {raw_time!r}"
        ) from error
    if when.tzinfo is None:
        raise ValueError(f"spot instance-action 'time' has no time zone: {raw_time!r}")
    return InterruptionNotice(action=action, time=when.astimezone(UTC))


class ImdsClient:
    """IMDSv2 reads: one session token, renewed before it expires or when refused."""

    def __init__(self, base_url: str = IMDS_URL, timeout_s: float = IMDS_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        request = urllib.request.Request(
            f"{self.base_url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            token = response.read().decode().strip()
        if not token:
            raise ImdsError(f"{self.base_url}/latest/api/token returned an empty token")
        self._token = token
        self._token_expires = time.monotonic() + TOKEN_TTL_S - TOKEN_RENEW_MARGIN_S
        return token

    def _current_token(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires:
            return self._fetch_token()
        return self._token

    def get(self, path: str) -> bytes | None:
        """GET a metadata path; None when the service answers 404 (nothing there)."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        try:
            return self._get(url)
        except urllib.error.HTTPError as error:
            if error.code != 401:
                raise
        # The token expired early or the service restarted: take a new one, once.
        self._token = None
        try:
            return self._get(url)
        except urllib.error.HTTPError as error:
            raise ImdsError(f"GET {url} refused a fresh token (HTTP {error.code})") from error

    def _get(self, url: str) -> bytes | None:
        """One GET with the current token; 404 is None, 401 propagates, others ImdsError."""
        request = urllib.request.Request(
            url, headers={"X-aws-ec2-metadata-token": self._current_token()}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data: bytes = response.read()
                return data
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            if error.code == 401:
                raise
            raise ImdsError(f"GET {url} answered HTTP {error.code}") from error

    def spot_notice(self) -> InterruptionNotice | None:
        """The spot interruption notice, or None while there is none."""
        body = self.get("latest/meta-data/spot/instance-action")
        return None if body is None else parse_instance_action(body)

    def instance_id(self) -> str:
        body = self.get("latest/meta-data/instance-id")
        if not body:
            raise ImdsError("the metadata service has no instance-id")
        return body.decode().strip()


class RayDrainer:
    """Drains one Ray node, named as ``ray start --node-name`` named it, through the GCS."""

    def __init__(self, gcs_address: str, node_name: str) -> None:
        self.gcs_address = gcs_address
        self.node_name = node_name

    def _client(self) -> Any:
        # Ray's Cython and protobuf modules ship no type stubs for these names.
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        return GcsClient(address=self.gcs_address)

    def node_id(self, gcs: Any) -> str:
        """Hex id of the one alive node called ``node_name``; DrainError if not exactly one."""
        from ray.core.generated import gcs_pb2

        alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")  # type: ignore[attr-defined]
        nodes = gcs.get_all_node_info(timeout=DRAIN_RPC_TIMEOUT_S)
        matches = [
            node_id.hex()
            for node_id, info in nodes.items()
            if info.node_name == self.node_name and info.state == alive
        ]
        if len(matches) != 1:
            raise DrainError(
                f"expected one alive Ray node named {self.node_name!r} at {self.gcs_address}, "
                f"found {len(matches)}"
            )
        return matches[0]

    def __call__(self, notice: InterruptionNotice) -> None:
        from ray.core.generated import autoscaler_pb2

        gcs = self._client()
        node_id = self.node_id(gcs)
        # A deadline already past (clock skew, a late poll) still drains, ending now.
        deadline_ms = max(notice.deadline_ms, int(time.time() * 1000))
        accepted, message = gcs.drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
                "DRAIN_NODE_REASON_PREEMPTION"
            ),
            f"spot interruption notice: {notice.action} at {notice.time.isoformat()}",
            deadline_ms,
            timeout=DRAIN_RPC_TIMEOUT_S,
        )
        if not accepted:
            raise DrainError(f"Ray refused to drain node {node_id}: {message}")
        log.warning(
            "draining Ray node %s (%s): EC2 will %s it at %s",
            node_id,
            self.node_name,
            notice.action,
            notice.time.isoformat(),
        )


def watch(
    imds: ImdsClient,
    drain: Callable[[InterruptionNotice], None],
    poll_interval_s: float = POLL_INTERVAL_S,
    stop: threading.Event | None = None,
) -> InterruptionNotice | None:
    """Poll until a notice arrives, drain once, return the notice (None if ``stop`` is set).

    A failed metadata read is logged and retried at the next poll: a spot worker must keep
    watching through a metadata hiccup. A notice that does not parse is an error: it means
    the service changed its format, which the operator must hear about. A failed drain
    (``DrainError``, an unreachable GCS) propagates too; the systemd unit restarts the
    watcher, which finds the notice still posted and tries again.
    """
    stop = stop or threading.Event()
    failing = False
    while not stop.is_set():
        try:
            notice = imds.spot_notice()
        except (OSError, ImdsError) as error:
            if not failing:
                log.warning(
                    "spot notice poll failed, retrying every %ss: %s", poll_interval_s, error
                )
            failing = True
        else:
            if failing:
                log.info("spot notice poll works again")
            failing = False
            if notice is not None:
                drain(notice)
                return notice
        stop.wait(poll_interval_s)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.engines.cluster.preemption",
        description="Drain this Ray node when EC2 posts a spot interruption notice.",
    )
    parser.add_argument(
        "--gcs-address",
        default=os.environ.get("RAY_ADDRESS"),
        help="The head's GCS, host:port (default: $RAY_ADDRESS).",
    )
    parser.add_argument(
        "--node-name",
        default=None,
        help="This node's Ray --node-name (default: the EC2 instance id, as the "
        "Terraform user data names workers).",
    )
    parser.add_argument("--imds-url", default=IMDS_URL, help="Metadata service base URL.")
    parser.add_argument(
        "--poll-interval", type=float, default=POLL_INTERVAL_S, help="Seconds between polls."
    )
    args = parser.parse_args(argv)
    if not args.gcs_address:
        parser.error("--gcs-address is required (or set RAY_ADDRESS to the head's host:port)")
    if args.poll_interval <= 0:
        parser.error(f"--poll-interval must be > 0, got {args.poll_interval}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    imds = ImdsClient(args.imds_url)
    node_name = args.node_name or imds.instance_id()
    log.info("watching for spot interruption notices; Ray node %r", node_name)
    watch(imds, RayDrainer(args.gcs_address, node_name), args.poll_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
