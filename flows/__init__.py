"""Entry points: Prefect flows (the RL job) and the ``sluice`` command line."""
