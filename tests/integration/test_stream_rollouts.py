"""``StreamRollouts`` on a real Ray instance: a worker that dies while the run stops its
streams is counted as one death, whichever of ``check`` and ``stop`` sees it first.

The worker and dispatcher are small actors standing in for vLLM and the group queue: the
logic under test is the flow's bookkeeping of deaths, not generation.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from sluice.config.tree import build_config
from sluice.driver.stream import StreamRollouts
from sluice.driver.weight_sync import ServedWeights
from sluice.engines.rollout.dispatcher import DispatcherClient
from sluice.engines.rollout.worker import RolloutWorkerClient

pytestmark = pytest.mark.integration


def test_a_worker_dying_while_the_streams_stop_is_counted_once(ray_local) -> None:
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Queue:
        def __init__(self) -> None:
            self.requeued: list[int] = []

        def resume(self) -> None: ...

        def stop(self) -> None: ...

        def requeue(self, worker: int) -> int:
            self.requeued.append(worker)
            return 0

        def settle(self) -> int:
            return 0

        def calls(self) -> list[int]:
            return self.requeued

    @ray.remote(num_cpus=0, max_restarts=1)
    class Worker:
        def stream(self, dispatcher: Any, settings: Any) -> None:
            time.sleep(0.5)
            os._exit(1)  # the process dies mid-stream

        def pid(self) -> int:
            return os.getpid()

    queue, worker = Queue.remote(), Worker.remote()

    def wait(ref: Any, what: str) -> Any:
        """As the session's waiter can: its periodic check runs after the stream ended."""
        ray.wait([ref], timeout=60)
        rollouts.check()
        return ray.get(ref)

    cfg = build_config({"mode": "async", "rollout": {"max_restarts": 1}})
    unchecked = ServedWeights(lambda version: None, stale_after_s=60.0)
    rollouts = StreamRollouts(
        cfg, [RolloutWorkerClient(worker)], DispatcherClient(queue), wait, unchecked
    )

    try:
        rollouts.start()
        rollouts.stop()  # one death: within max_restarts=1, so no RolloutFailure
        assert rollouts.restarts.counts == [1]
        assert rollouts.restarting == {0}
        assert ray.get(queue.calls.remote()) == [0]
    finally:
        ray.kill(worker)
        ray.kill(queue)
