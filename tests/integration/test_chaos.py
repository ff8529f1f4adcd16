"""Chaos: rollout workers and the trainer killed at moments drawn from a seed, start-up
included, and the whole job killed and resumed once; and two deaths drawn from five
moments a kill from outside cannot aim at, armed as fault points (``storage/faults.py``)
that end the process at a call drawn from the seed: a rollout worker half way through
loading a weight version, the trainer between its backward pass and its optimiser step,
relay 0 half way through taking a version, the trajectory store taking a put, the
dispatcher handing out groups. Afterwards the ledger must prove that every dispatched
sample was trained exactly once or dropped with a reason, and that the trained versions
have no gap.

Marked slow (``make test-slow``): one seed is a few minutes. ``SLUICE_CHAOS_SEEDS=7,8``
picks the seeds; a failing test's id names its seed, and the plan it drew is printed, so
``SLUICE_CHAOS_SEEDS=<seed> make test-slow`` replays it.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
from pathlib import Path

import pytest

from tests.integration.test_faults import assert_ledger_whole, smoke_args
from tests.support.cli_job import Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEEDS = [int(s) for s in os.environ.get("SLUICE_CHAOS_SEEDS", "1,2,3,4,5").split(",")]
STEPS, WORKERS = 30, 2
# Fault points and the calls each lets pass before it fires, drawn from these ranges so it
# fires mid-run. A 30-step run here makes about one weight load, one optimiser step and
# one version a step, some 25 puts in all (blocks of up to 8 groups) and well over 60 takes.
MOMENTS = {
    "worker.weight_load": (3, 20),
    "trainer.optimizer_step": (3, 20),
    "relay.handover": (3, 20),
    "store.put": (3, 15),
    "dispatcher.take": (10, 60),
}


def plan(seed: int) -> list[tuple[int, str]]:
    """(step, what) in step order; step 0 is start-up (before the step-0 checkpoint)."""
    rng = random.Random(seed)
    events = [(0, f"worker {rng.randrange(WORKERS)}")] if rng.random() < 0.5 else []
    steps = rng.sample(range(2, STEPS - 2), 4)
    kinds = ["job", *(rng.choice(["trainer", "worker 0", "worker 1"]) for _ in range(3))]
    events += zip(steps, kinds, strict=True)
    return sorted(events)


def faults(seed: int) -> str:
    """Two fault points, each armed to end its process once after a number of calls drawn
    from the seed (``SLUICE_FAULTS``); any five seeds in a row arm each point twice."""
    rng = random.Random(seed * 7919)
    points = sorted(MOMENTS)
    chosen = [points[seed % len(points)], points[(seed + 2) % len(points)]]
    return ",".join(f"{point}=1@{rng.randint(*MOMENTS[point])}" for point in chosen)


def _pids(out: str) -> tuple[dict[int, int], int]:
    """The latest pid of each rollout worker and of the trainer, from the job's output.

    ``async`` starts without a worker that is still starting or that Ray has not placed yet
    (a loaded machine is slow to start its process): the start-up line lists the others'
    pids, and the late one's pid comes with "rollout worker N is up"."""
    workers: dict[int, int] = {}
    waiting: set[int] = set()
    trainer = 0
    for line in out.splitlines():
        for late in (": still starting", ": not placed yet"):
            if late in line:
                names = line.split(late)[0]
                waiting |= {int(n) for n in re.findall(r"rollout worker (\d+)", names)}
        started = re.search(r"\(pids ([\d, ]+)\) and the trainer \(pid (\d+)\)", line)
        if started:
            placed = [i for i in range(WORKERS) if i not in waiting]
            pids = [int(p) for p in started[1].split(", ")]
            workers.update(zip(placed, pids, strict=True))
            trainer, waiting = int(started[2]), set()
        back = re.search(r"rollout worker (\d+) (?:is up \(pid|streams in process) (\d+)", line)
        if back:
            workers[int(back[1])] = int(back[2])
    return workers, trainer


def _worker_pid(job: Job, worker: int) -> int:
    """Worker ``worker``'s pid; one not placed yet is waited for."""
    workers, _ = _pids(job.output())
    if worker in workers:
        return workers[worker]
    up = job.expect(rf"rollout worker {worker} (?:is up \(pid|streams in process) (\d+)")
    return int(up[1])


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it died already: what chaos is for
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
def test_the_ledger_holds_whatever_dies_when(tmp_path: Path, shared_cache: Path, seed: int):
    events, armed = plan(seed), faults(seed)
    print(f"chaos seed {seed}: {events}; {armed}")
    (tmp_path / "faults").mkdir()
    env = {"SLUICE_FAULTS": armed, "SLUICE_FAULTS_DIR": str(tmp_path / "faults")}
    settings = [
        "mode=async",
        f"train.steps={STEPS}",
        f"rollout.workers={WORKERS}",
        "rollout.max_restarts=8",
        "checkpoint.every=10",
        "checkpoint.segment_retries=6",
        "eval.every=100",
    ]
    log = tmp_path / "job.log"
    job = Job(smoke_args(tmp_path, shared_cache, *settings), log, env)
    try:
        for step, what in events:
            if step == 0:
                job.expect(r"rollout worker\(s\) \(pids")
            else:
                job.expect(rf"step\s+{step}/{STEPS}")
            if what == "job":
                job.kill_everything()
                job.stop()
                job = Job(["resume", "smoke", "--root", str(tmp_path / "runs")], log, env)
            elif what == "trainer":
                _kill(_pids(job.output())[1])
            else:
                _kill(_worker_pid(job, int(what.split()[1])))
        assert job.finish(timeout=900) == 0, f"seed {seed}: " + job.output()[-4000:]
    finally:
        job.stop()
    assert f"step   {STEPS}/{STEPS}" in job.output(), f"seed {seed}"
    assert_ledger_whole(tmp_path / "runs" / "smoke", STEPS)
    fired = sorted(p.name for p in (tmp_path / "faults").iterdir() if ".call." not in p.name)
    assert fired == sorted(f"{entry.split('=')[0]}.0" for entry in armed.split(",")), fired
