"""Consumed batches and old weight versions leave Ray's object store: no slow leak.

Marked ``serial``: what it reads is how much the store holds once Ray has freed, which a
test loading the cores beside it would delay.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from ray._private.internal_api import get_memory_info_reply, get_state_from_address

from sluice.storage.batches import TRAIN_FIELDS, to_train_batch
from sluice.storage.params import ParameterService
from sluice.storage.schema import batch_from_rows
from sluice.storage.trajectory_store import StoreClient, create_store

pytestmark = [pytest.mark.integration, pytest.mark.serial]

STEPS = 300
GROUPS, GROUP = 4, 8
TOKENS = 200  # ~2 KB of token ids and log-probs per row


def block(step: int):
    return batch_from_rows(
        {
            "sample_id": f"s{step}/g{g}/{j}",
            "prompt_id": f"p{g}",
            "group_id": f"s{step}/g{g}",
            "env": "addition",
            "prompt_ids": [1, 2, 3],
            "response_ids": [5] * TOKENS,
            "behaviour_logprobs": [-0.5] * TOKENS,
            "token_versions": [step] * TOKENS,
            "reward": 1.0,
            "advantage": 0.5,
            "prompt_len": 3,
            "response_len": TOKENS,
            "status": "scored",
        }
        for g in range(GROUPS)
        for j in range(GROUP)
    )


def usage() -> tuple[int, int]:
    """``(bytes, objects)`` held in the object store of every node of the connected cluster."""
    address = ray.get_runtime_context().gcs_address
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def settled(
    expected: tuple[int, int] | None = None, slack: int = 0, timeout_s: float = 20.0
) -> tuple[int, int]:
    """Usage once freeing (asynchronous in Ray) has caught up: ``expected`` (same object
    count, bytes within ``slack``), or without one, two reads half a second apart that agree."""
    deadline = time.monotonic() + timeout_s
    last = usage()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = usage()
        if expected is None and now == last:
            return now
        if expected and now[1] == expected[1] and abs(now[0] - expected[0]) <= slack:
            return now
        last = now
    return last


def test_memory_returns_to_baseline(ray_local):
    baseline = settled()
    store = StoreClient(create_store(None, capacity=4 * GROUPS * GROUP))
    params = ParameterService.create(relays=1, bucket_bytes=256 << 10)
    weights = {f"layer{i}.weight": torch.randn(256, 256) for i in range(4)}  # 4 x 256 KiB
    one_version = (baseline[0] + 4 * (256 << 10), baseline[1] + 4)
    for step in range(STEPS):
        store.put(block(step))
        lease = store.lease(GROUPS * GROUP, current_version=step, max_staleness=0)
        to_train_batch(lease.table.select(list(TRAIN_FIELDS)), pad_id=0)
        params.publish(step + 1, weights)
        store.ack(lease, step + 1)
        del lease
        if step in (50, 150, STEPS - 1):
            params.flush(timeout=30)  # the newest version has reached the relay
            # Every consumed block is gone; of the weights, only the newest version stays.
            got = settled(one_version, slack=64 << 10)
            assert got[1] == one_version[1], (step, got, one_version)
            assert abs(got[0] - one_version[0]) < 64 << 10, (step, got, one_version)
    assert store.stats()["blocks"] == 0 and store.stats()["held"] == 0
    params.shutdown()  # the newest version goes with its relay
    assert settled(baseline) == baseline
