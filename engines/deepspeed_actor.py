"""The DeepSpeed trainer as a Ray actor: one process, a world of one rank on 127.0.0.1.

Kept apart from ``engines.pools`` so that only a run with ``train.engine: deepspeed``
imports DeepSpeed; ``pools.launch_trainer`` picks it.
"""

from __future__ import annotations

import ray

from sluice.engines.deepspeed_trainer import DeepSpeedTrainer
from sluice.engines.pools import StoreTraining


@ray.remote
class DeepSpeedTrainerActor(StoreTraining, DeepSpeedTrainer):
    """The DeepSpeed trainer in its own process."""
