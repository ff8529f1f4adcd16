"""The training pool's ranks: which rows of a batch each rank trains on, the process group
they form, and the small collectives a step needs.

A pool of ``train.ranks`` trainer actors (``engines/train/pool.py``) forms one
``torch.distributed`` group (gloo on CPU, NCCL on GPU) through ``join``, with rank 0's
address; every collective then times out after ``train.collective_timeout_s`` instead of
waiting for a dead rank forever. Each rank trains on its ``shares`` of a leased batch:
rows dealt longest first to the rank with the fewest tokens so far, so a long-tail batch
leaves no rank idle while another pads through the long answers. A pool of one forms no
group (FSDP2, which needs one, forms a world of one), and the collectives here are then the
identity.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 listens for the group, and this rank's place in it."""

    address: str
    port: int
    rank: int
    world: int


def backend() -> str:
    """NCCL between GPUs, gloo (torch's CPU backend) without them."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (another process could take it before the group
    binds it, rarely)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def join(place: Rendezvous, timeout_s: float) -> None:
    """Join the group ``place`` names (a no-op in a process already in one). The
    environment variables are the ones ``torchrun`` sets, so DeepSpeed finds the group as
    it is."""
    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=place.address,
        MASTER_PORT=str(place.port),
        RANK=str(place.rank),
        WORLD_SIZE=str(place.world),
        LOCAL_RANK="0",  # each actor sees only its own devices
    )
    dist.init_process_group(
        backend(),
        init_method=f"tcp://{place.address}:{place.port}",
        rank=place.rank,
        world_size=place.world,
        timeout=timedelta(seconds=timeout_s),
    )


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the group's size; (0, 1) outside a group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shares(lengths: list[int], world: int) -> list[list[int]]:
    """Row indices per rank, balanced by tokens: rows longest first, each to the rank with
    the fewest tokens so far (ties to the lower rank). Each rank's rows are in batch order;
    every row lands on exactly one rank, and with at least ``world`` rows none is empty."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[rank].append(row)
        load[rank] += lengths[row]
    return [sorted(rows) for rows in out]


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """``values`` added up over the group, element by element (on ``device``: NCCL reduces
    only CUDA tensors)."""
    if rank_and_world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of each of ``values`` over the group."""
    if rank_and_world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
