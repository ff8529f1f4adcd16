"""Named fault points, for the tests of the failure model (``tests/integration/test_faults.py``).

Production code calls ``fault_point("name")`` where a real failure can strike (half way
through a checkpoint write, for one). Nothing happens unless the ``SLUICE_FAULTS``
environment variable arms that point: ``SLUICE_FAULTS="checkpoint.write=1"`` makes the
first call in each process raise ``InjectedFault``; ``=2`` the first two. With
``SLUICE_FAULTS_DIR`` set to a folder, the count is kept there and shared by every process
(a fault that must fire N times in the whole run, whichever actors restart). Both variables
are passed on to the run's Ray actors, so a fault armed for a run fires where the work
happens.
"""

from __future__ import annotations

import os
import threading

ENV = "SLUICE_FAULTS"
DIR_ENV = "SLUICE_FAULTS_DIR"
POINTS = ("checkpoint.write", "worker.evaluate")
# Points where the process dies outright (as from SIGKILL or a lost node), not raises.
EXITS = ("worker.evaluate",)

_lock = threading.Lock()
_fired: dict[str, int] = {}


class InjectedFault(OSError):
    """The failure a fault point raises (an OSError: what a real storage failure raises)."""


def armed() -> dict[str, int]:
    """``{point: times}`` from ``SLUICE_FAULTS``; raises ValueError naming a bad entry."""
    spec = os.environ.get(ENV, "").strip()
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, times = item.partition("=")
        if name not in POINTS or not times.isdigit():
            raise ValueError(
                f"{ENV}: bad entry {item!r}; expected POINT=TIMES with POINT one of {POINTS}"
            )
        out[name] = int(times)
    return out


def fault_point(name: str) -> None:
    """Raise ``InjectedFault`` if ``name`` is armed and has fired fewer times than asked;
    at a point of ``EXITS``, end the process at once instead (no cleanup, like a kill)."""
    times = armed().get(name, 0)
    if times and _fires(name, times):
        if name in EXITS:
            os._exit(70)
        raise InjectedFault(f"injected fault at {name} ({ENV}={os.environ[ENV]})")


def _fires(name: str, times: int) -> bool:
    """Count one more call of ``name``; True while it has fired fewer than ``times`` times."""
    folder = os.environ.get(DIR_ENV)
    if folder:  # one marker file per firing, created atomically: shared by every process
        for i in range(times):
            try:
                with open(os.path.join(folder, f"{name}.{i}"), "x"):
                    return True
            except FileExistsError:
                continue
        return False
    with _lock:
        if _fired.get(name, 0) >= times:
            return False
        _fired[name] = _fired.get(name, 0) + 1
        return True
