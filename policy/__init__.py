"""The starting policy: Sluice's own tiny model built and warm-started offline, or a local
model folder checked (``starting``), and the pretrained models ``sluice model get`` fetches
without a model hub (``pretrained``)."""
