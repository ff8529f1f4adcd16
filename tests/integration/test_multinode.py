"""A real job on a Ray cluster of several nodes that grows, loses a node and regrows
(the failure model in docs/operating.md).

The cluster runs on this machine (``tests/support/ray_nodes.py``), as infra/terraform's boot
scripts start one: a head with no custom resources, rollout nodes advertising the Ray
resource ``rollout`` and a trainer node advertising ``trainer``, each with its own CPU count,
temp dir and ports, with token authentication. ``sluice run --address HOST:PORT`` joins it
(the driver's own Ray node is the head, as on the cluster, where the Prefect worker runs
there): rollout workers ask for ``rollout``, the trainer for ``trainer``. Each node up at
the start gets a parameter relay (``weights.relays: per_node``); rollout-a's dies with it,
and the nodes that join later ask the head's.

The job asks for two rollout workers but starts when only one rollout node (rollout-a) is
up: no node has room for worker 1, so the async run starts with worker 0 alone
(``engines/cluster/placement.py``), and gives worker 1 a stream once rollout-b joins and Ray places
it there. Then the raylet of the node holding worker 0 is SIGKILLed: a lost machine. Its worker
dies with it, its groups go back to the queue, and Ray cannot restart it (no other node
offers a free ``rollout``): the pool shrinks to one worker and training goes on. A
replacement node (rollout-c) then joins; Ray restarts worker 0 there, the flow sees it
answer and gives it a stream again: the pool regrows (the trainer is held while a node
boots and while Ray notices a lost one, so that the tiny run does not end first). The run
finishes, and the ledger shows every sample trained exactly once or dropped with a reason,
with no version skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from sluice.storage.ledger import Ledger, check_exactly_once, check_versions, summarize
from tests.support.cli_job import Job
from tests.support.ray_nodes import RayNodes, wait_gone

# ~3 min on a quiet 2-core machine (5 Ray nodes, 3 vLLM starts): `make test-multinode`, run by CI.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 60
SAMPLES_PER_STEP = 16  # smoke: 4 prompts x 4 samples
# Steps the run must take with one rollout worker left before the replacement node starts:
# proof that the shrunk pool trains on.
SHRUNK_STEPS = 3
# Ray declares a node whose raylet is gone dead after its health checks fail (~15-30 s).
NODE_DEATH_TIMEOUT_S = 120.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayNodes]:
    nodes = RayNodes(tmp_path)
    try:
        nodes.start("head", cpus=1)  # the driver and the control-plane actors (0 CPUs each)
        nodes.start("rollout-a", cpus=1, resources={"rollout": 1})
        nodes.start("trainer", cpus=1, resources={"trainer": 1})
        nodes.wait_state(["head", "rollout-a", "trainer"], state=0)
        yield nodes
    finally:
        nodes.close()


def _titles(cluster: RayNodes) -> dict[str, str]:
    """node name -> the process titles of its Ray workers, joined (``ray::ClassName...``)."""
    return {name: " ".join(node.workers().values()) for name, node in cluster.nodes.items()}


def _node_of(cluster: RayNodes, pid: int) -> str:
    found = [name for name, node in cluster.nodes.items() if pid in node.workers()]
    assert len(found) == 1, f"pid {pid} is on nodes {found}"
    return found[0]


@contextmanager
def _held(trainer: int) -> Iterator[None]:
    """Hold the trainer while a node boots: this tiny model trains a step in a fraction of a
    second, far faster than a node joins and loads vLLM, so the run would end first."""
    held = psutil.Process(trainer)
    held.suspend()
    try:
        yield
    finally:
        held.resume()


def test_a_lost_rollout_node_shrinks_the_pool_and_a_new_node_regrows_it(
    cluster: RayNodes, tmp_path: Path, shared_cache: Path
) -> None:
    args = ["run", "configs/smoke.yaml", "--address", cluster.gcs_address]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={shared_cache}",
        "mode=async",
        f"train.steps={STEPS}",
        "eval.every=5",
        "rollout.workers=2",
        "rollout.resources.rollout=1",
        "train.resources.trainer=1",
    ):
        args += ["--set", setting]
    job = Job(args, tmp_path / "job.log", env=cluster.env)
    try:
        joined = job.expect(r"joined the Ray cluster at (\S+): (\d+) node\(s\)")
        assert joined[1] == cluster.gcs_address and joined[2] == "3"
        # Both workers ask for the same resources: Ray places either one first.
        late = int(job.expect(r"rollout worker (\d): not placed yet")[1])
        first = 1 - late
        started = job.expect(r"1 rollout worker\(s\) \(pids (\d+)\) and the trainer \(pid (\d+)\)")
        workers, trainer = [int(started[1])], int(started[2])

        # Placement: rollout worker 0 on the rollout node, the trainer on its node, the
        # store, dispatcher and parameter relay on the head beside the driver.
        assert _node_of(cluster, workers[0]) == "rollout-a"
        assert _node_of(cluster, trainer) == "trainer"
        head = _titles(cluster)["head"]
        for actor in ("TrajectoryStore", "GroupDispatcher", "_Relay"):
            assert f"ray::{actor}" in head, head
        # weights.relays=per_node: a relay on each node up at the start, fed by the head's.
        for node in ("rollout-a", "trainer"):
            assert "ray::_Relay" in _titles(cluster)[node], _titles(cluster)[node]

        # The pool grows when a node with room for worker 1 joins.
        job.expect(r"step    2/")
        with _held(trainer):
            cluster.start("rollout-b", cpus=1, resources={"rollout": 1})
            up = job.expect(rf"rollout worker {late} is up \(pid (\d+)\)", timeout=300)
            workers.append(int(up[1]))
        assert _node_of(cluster, workers[1]) == "rollout-b"
        job.expect(rf"rollout worker {late} streams in process {workers[1]}\b", timeout=120)

        # Held again at once: with two workers the rest of the run takes seconds, and it
        # could end before the kill lands or before the flow hears of the death. The flow
        # checks its workers while it waits for the trainer, so it sees the death meanwhile.
        with _held(trainer):
            lost = _node_of(cluster, workers[0])
            raylet = cluster.nodes[lost].raylet()
            assert raylet is not None
            raylet.kill()  # SIGKILL: the node is gone, its worker with it
            assert wait_gone(workers[0], timeout_s=60), "the lost node's rollout worker lives on"
            job.expect(rf"rollout worker {first} died", timeout=NODE_DEATH_TIMEOUT_S)

        # The pool is down to one worker: training goes on, and so does held-out evaluation.
        shrunk = len(job.lines)
        job.expect(r"step +\d+/\d+ \| .*held-out")
        for _ in range(SHRUNK_STEPS):
            job.expect(r"step +\d+/")
        assert not any(f"rollout worker {first} is up" in line for line in job.lines[shrunk:])

        with _held(trainer):
            cluster.wait_state([lost], state=1, timeout_s=NODE_DEATH_TIMEOUT_S)
            cluster.start("rollout-c", cpus=1, resources={"rollout": 1})
            back = int(job.expect(rf"rollout worker {first} is up \(pid (\d+)\)", timeout=300)[1])
        assert _node_of(cluster, back) == "rollout-c"
        job.expect(rf"rollout worker {first} streams in process {back}\b", timeout=120)
        assert job.finish() == 0, job.output()[-4000:]
    finally:
        job.stop()

    out = job.output()
    assert f"step   {STEPS}/{STEPS}" in out
    steps_after = [
        int(m)
        for m in re.findall(r"step +(\d+)/", out[out.index(f"rollout worker {first} is up") :])
    ]
    assert steps_after, "no step was trained after the pool regrew"
    run_dir = tmp_path / "runs" / "smoke"
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table, finished=True) == []
    assert check_versions(table) == []
    summary = summarize(table)
    assert summary["final"]["trained"] == STEPS * SAMPLES_PER_STEP
    assert set(summary["final"]) <= {"trained", "dropped"}
    dropped = table.filter(table.column("event").to_numpy(zero_copy_only=False) == "dropped")
    assert all(dropped.column("reason").to_pylist())
