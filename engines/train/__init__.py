"""Training: the training pool's actors (``pool``), the trainer they hold (``trainer``), its
parallelism strategies (``ddp``, ``fsdp``, ``zero``), the ranks' collectives and LoRA."""
