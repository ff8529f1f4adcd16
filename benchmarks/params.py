"""Parameter service: how long ``publish`` holds the trainer against a full pull, by size.

In one Ray session, for each model size a publisher actor holds a state dict of float32
tensors in 4 MB chunks and publishes versions. Per version it times:

- publish: the ``publish`` call itself, what the trainer's call costs. It only records the
  tensors; the copy into a staging buffer (the snapshot), the puts into the object store
  and the offer to relay 0 all run in the service's threads after it returns.
- snapshot: from the start of ``publish`` until the snapshot is copied, measured by calling
  ``wait_snapshot`` right after ``publish``. That is the worst case for the trainer: the
  longest its next ``optimizer.step()`` can wait, if no forward and backward pass ran
  between the publish and the step (in a run they do, and the wait is usually zero).

Once relay 0 holds a version, a puller actor times a full pull of it (``pull_blobs`` plus
``from_buckets``). The first ``warmup`` versions of each size are not in the medians: the
first snapshot into each of the two staging buffers takes a page fault per page it writes
on top of its one copy (the first snapshot, reported on its own, shows it). A run
publishes every step, so the medians are what the trainer sees for all but its first few
versions. Prints a markdown table and returns its rows (for a script that writes
BENCHMARKS.md).

    .venv/bin/python -m benchmarks.params --sizes 4 16 64 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
import torch

from benchmarks.tables import markdown_table
from sluice.storage.params import ParameterService, from_buckets

CHUNK_MB = 4
# How long the driver waits for relay 0 to take a published version.
HANDOVER_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0)
class _Publisher:
    def __init__(self, service: ParameterService, size_mb: int) -> None:
        torch.manual_seed(0)
        chunk = (CHUNK_MB << 20) // 4
        count = max(1, size_mb // CHUNK_MB)
        self._state = {f"layer{i:04d}.weight": torch.randn(chunk) for i in range(count)}
        self._service = service

    def publish(self, version: int) -> tuple[float, float]:
        """Seconds in ``publish``, and from its start until the snapshot is copied."""
        start = time.perf_counter()
        publish_s = self._service.publish(version, self._state)
        self._service.wait_snapshot()
        return publish_s, time.perf_counter() - start


@ray.remote(num_cpus=0)
class _Puller:
    def __init__(self, service: ParameterService) -> None:
        self._service = service

    def pull(self, after: int) -> tuple[int, float]:
        start = time.perf_counter()
        found = self._service.pull_blobs(after)
        if found is None:
            raise RuntimeError(f"nothing newer than version {after} to pull")
        version, blobs = found
        from_buckets(blobs)
        return version, time.perf_counter() - start


def _wait_for(service: ParameterService, version: int) -> None:
    deadline = time.monotonic() + HANDOVER_TIMEOUT_S
    while service.latest_version() < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"relay 0 did not take version {version} in {HANDOVER_TIMEOUT_S} s")
        time.sleep(0.005)


def measure(sizes_mb: list[int], repeats: int, warmup: int = 5) -> list[dict[str, Any]]:
    """Median publish, snapshot and full-pull seconds per size; needs a running Ray session."""
    rows = []
    for size_mb in sizes_mb:
        service = ParameterService.create()
        publisher = _Publisher.remote(service, size_mb)  # type: ignore[attr-defined]
        puller = _Puller.remote(service)  # type: ignore[attr-defined]
        publish_s, snapshot_s, pull_s = [], [], []
        for version in range(warmup + repeats):
            published, snapshotted = ray.get(
                publisher.publish.remote(version), timeout=HANDOVER_TIMEOUT_S
            )
            publish_s.append(published)
            snapshot_s.append(snapshotted)
            _wait_for(service, version)
            pulled, seconds = ray.get(puller.pull.remote(version - 1), timeout=HANDOVER_TIMEOUT_S)
            if pulled != version:
                raise RuntimeError(f"pulled version {pulled}, expected {version}")
            pull_s.append(seconds)
        for actor in (publisher, puller):
            ray.kill(actor)
        service.shutdown()
        publish, snapshot, pull = (
            statistics.median(seconds[warmup:]) for seconds in (publish_s, snapshot_s, pull_s)
        )
        rows.append(
            {
                "size_mb": size_mb,
                "publish_s": publish,
                "snapshot_s": snapshot,
                "pull_s": pull,
                "ratio": publish / pull,
                "first_snapshot_s": snapshot_s[0],
            }
        )
        print(
            f"{size_mb} MB: publish {publish * 1e3:.2f} ms, snapshot {snapshot * 1e3:.1f} ms, "
            f"pull {pull * 1e3:.1f} ms",
            flush=True,
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "size MB",
        "publish ms",
        "snapshot ms (worst case)",
        "pull ms",
        "publish / pull",
        "first snapshot ms",
    ]
    cells = [
        [
            str(r["size_mb"]),
            f"{r['publish_s'] * 1e3:.2f}",
            f"{r['snapshot_s'] * 1e3:.1f}",
            f"{r['pull_s'] * 1e3:.1f}",
            f"{r['ratio']:.3f}",
            f"{r['first_snapshot_s'] * 1e3:.1f}",
        ]
        for r in rows
    ]
    return "\n".join(markdown_table(header, cells, rule="---:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5, help="measured versions per size")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured versions first")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print(table(measure(args.sizes, args.repeats, args.warmup)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
