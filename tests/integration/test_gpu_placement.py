"""Actors that ask Ray for GPUs, on a Ray node that declares logical ones.

``ray start --num-gpus 3`` needs no device: Ray hands the logical GPUs out to actors that
ask for them and sets each one's ``CUDA_VISIBLE_DEVICES``. A run joins that node
(``--address``) with two rollout workers in ``one_step``, a batch mode, which starts only
once Ray has placed every worker (``async`` may start before the last one is placed, so its
start-up devices line could name one worker; a late worker names its devices in its "is
up" line instead); ``rollout.gpus_per_worker`` and
``train.gpus_per_rank`` are unset, so each actor asks for one GPU because the cluster has
them, and each gets its own. vLLM and torch are CPU builds here, so both still run on the
CPU; the rollout and training dtypes resolve to bfloat16 (the actors hold GPUs), which
exercises the bf16 path too. A run asking for more GPUs than the node has fails with the
placement message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

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
