"""Data planes and records: the run folder layout, and (next) the trajectory store,
parameter service, checkpoints and ledger. Never imports ``engines``, ``tasks`` or ``flows``."""
