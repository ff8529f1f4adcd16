"""Data planes and records: the run folder layout, the trajectory store, the parameter
service, checkpoints and the ledger. Never imports ``engines``, ``tasks`` or ``flows``."""
