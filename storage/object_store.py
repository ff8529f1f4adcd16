"""How much of Ray's shared-memory object store is in use, for leak tests and benchmarks."""

from __future__ import annotations

import ray
from ray._private.internal_api import get_memory_info_reply, get_state_from_address


def usage() -> tuple[int, int]:
    """``(bytes, objects)`` held in the object store of every node of the connected cluster."""
    address = ray.get_runtime_context().gcs_address
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)
