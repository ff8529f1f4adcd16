"""engines/cluster/ray_cluster.py: the Ray addresses the CLI accepts (``--address``), the local
Ray's resources, and the client connection's retries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.engines.cluster.ray_cluster import CLIENT_CONNECT_ATTEMPTS, _join, check_address, summed
from sluice.flows.cli import app

ROOT = Path(__file__).parents[4]


@pytest.mark.parametrize(
    "address", ["ray://localhost:10001", "10.40.1.7:6379", "head.internal:6379", "auto"]
)
def test_addresses_ray_can_connect_to(address):
    assert check_address(address) == address


@pytest.mark.parametrize(
    "address",
    ["localhost", "ray://localhost", "http://10.0.0.1:6379", "10.0.0.1:0", "10.0.0.1:70000", ""],
    ids=["no-port", "client-no-port", "http", "port-zero", "port-too-big", "empty"],
)
def test_other_addresses_are_refused_with_the_forms_allowed(address):
    with pytest.raises(ValueError, match=r"ray://HOST:PORT .*HOST:PORT .*auto"):
        check_address(address)


def test_summed_resources_count_every_actor():
    # two rollout workers asking {rollout: 1} and a trainer asking {trainer: 1, fast: 0.5}
    assert summed((2, {"rollout": 1.0}), (1, {"trainer": 1.0, "fast": 0.5})) == {
        "rollout": 2.0,
        "trainer": 1.0,
        "fast": 0.5,
    }
    assert summed((3, {}), (1, {})) == {}


class FlakyInit:
    """Stands in for ray.init: fails ``failures`` times as Ray's client proxy does when
    the server it forked for the driver dies at start, then connects."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self, **kwargs: object) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionAbortedError("Starting Ray client server failed.")


@pytest.mark.parametrize(
    ("address", "failures", "calls", "connects"),
    [
        ("ray://head:10001", 2, 3, True),  # two failures, the third attempt connects
        ("ray://head:10001", 3, 3, False),  # CLIENT_CONNECT_ATTEMPTS failures: raised
        ("head:6379", 1, 1, False),  # a GCS address is not a client connection: no retry
    ],
    ids=["client-recovers", "client-gives-up", "gcs-no-retry"],
)
def test_a_client_connection_is_tried_again(address, failures, calls, connects):
    init = FlakyInit(failures)
    if connects:
        _join(address, init)
    else:
        with pytest.raises(ConnectionAbortedError):
            _join(address, init)
    assert init.calls == calls
    assert CLIENT_CONNECT_ATTEMPTS == 3  # the cases above are written for three attempts


@pytest.mark.parametrize("command", ["run", "resume"])
def test_the_cli_refuses_a_bad_address_before_anything_starts(command, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "smoke"  # what `sluice run` leaves for `sluice resume`
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((ROOT / "configs" / "smoke.yaml").read_text())
    args = ["configs/smoke.yaml"] if command == "run" else [str(run_dir)]
    result = CliRunner().invoke(app, [command, *args, "--address", "http://head:6379"])
    assert result.exit_code == 2, result.output
    assert "--address: Ray address 'http://head:6379' is none of ray://HOST:PORT" in (result.output)
    assert "RAY_ADDRESS" not in os.environ
