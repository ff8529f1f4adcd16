"""A discrete-event, cluster-scale simulator of Sluice's scheduling policies.

Pure Python and numpy (no Ray, no vLLM), so it runs anywhere in seconds:

- ``sim.scenario``: the typed scenario (workload, cluster, costs, policy), loaded from YAML;
- ``sim.lengths``: response-length models (long-tail draws, or lengths replayed from a run);
- ``sim.engine``: the event loop that runs one policy on one scenario;
- ``sim.results``: what a simulation returns, and the table the CLI prints;
- ``sim.calibrate``: per-token costs derived from measurements of a real run (a profile,
  ``sim/profiles/*.json``, written by ``benchmarks/sim_profile.py``);
- ``sim.hardware``: costs of a model on H100s from public specifications;
- ``sim.command``: what ``sluice simulate`` (``flows/cli.py``) runs and prints.

The calibration check and the predictions at published scale are written into BENCHMARKS.md
from a checkout, by ``benchmarks/sim_calibration.py`` and ``benchmarks/sim_scale.py``
(measurement, which the wheel does not ship).
"""
