"""Whether a run's pools can fit the embedded single-machine Ray cluster, checked before
anything starts (``tasks/job.py: check_start``).

The embedded cluster is sized to the pools' asks, so Ray places every actor; what it
cannot give is memory: past the machine's, the actors are placed and never start (vLLM's
start-up is killed or swaps), and the run would wait out ``rollout.placement_timeout_s``.
The estimate per actor is its measured unique memory (USS) on the 2-core CPU machine with
the tiny policy (2026-11-30, `ps`-style reading with psutil during
`python -m benchmarks.misbehaving_reward`): a CPU rollout worker 0.64 GiB besides its KV
cache, a trainer rank 0.40 GiB, the driver and the control plane (store, dispatcher,
relays, Ray's agents) 2.0 GiB together; plus the policy's weights, once in a rollout
worker and four times in a trainer rank (weights, gradients, two Adam moments). It is a
floor, not a prediction: a run it lets through can still need more.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
ROLLOUT_GIB = 0.64  # a CPU vLLM rollout worker, its KV cache aside
TRAINER_GIB = 0.40  # a trainer rank, the policy's state aside
FIXED_GIB = 2.0  # the driver, the store, the dispatcher, the relays and Ray's own agents
TRAINER_COPIES = 4  # weights, gradients and Adam's two moments


@dataclass(frozen=True)
class Ask:
    """What a run asks of the embedded cluster's memory."""

    rollout_workers: int
    kv_cache_gib: float
    train_ranks: int
    weights_bytes: int

    def worker_gib(self) -> float:
        return ROLLOUT_GIB + self.kv_cache_gib + self.weights_bytes / GIB

    def rank_gib(self) -> float:
        return TRAINER_GIB + TRAINER_COPIES * self.weights_bytes / GIB

    def total_gib(self) -> float:
        return (
            FIXED_GIB
            + self.rollout_workers * self.worker_gib()
            + self.train_ranks * self.rank_gib()
        )


def misfit(ask: Ask, machine_bytes: int) -> str | None:
    """Why ``ask`` cannot fit a machine of ``machine_bytes`` of memory, or None."""
    machine = machine_bytes / GIB
    if ask.total_gib() <= machine:
        return None
    room = machine - FIXED_GIB - ask.train_ranks * ask.rank_gib()
    most = max(0, int(room // ask.worker_gib()))
    return (
        f"the pools need about {ask.total_gib():.0f} GiB of memory and this machine has "
        f"{machine:.0f} GiB: rollout.workers={ask.rollout_workers} x ~{ask.worker_gib():.1f} "
        f"GiB (vLLM on the CPU with a {ask.kv_cache_gib:g} GiB KV cache, rollout.kv_cache_gib), "
        f"train.ranks={ask.train_ranks} x ~{ask.rank_gib():.1f} GiB and ~{FIXED_GIB:g} GiB "
        f"for the driver and the control plane. Lower rollout.workers (at most {most} fit "
        "here), or run on a cluster with --address"
    )
