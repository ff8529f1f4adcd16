"""Named fault points, for the tests of the failure model (``tests/integration/test_faults.py``,
``tests/integration/test_chaos.py``).

Production code calls ``fault_point("name")`` where a real failure can strike (half way
through a checkpoint write, for one). Nothing happens unless the ``SLUICE_FAULTS``
environment variable arms that point: ``SLUICE_FAULTS="checkpoint.write=1"`` makes the
first call in each process raise ``InjectedFault``; ``=2`` the first two; ``=1@30`` lets 30
calls pass first, then fires once (a moment in the middle of a run). With
``SLUICE_FAULTS_DIR`` set to a folder, the counts are kept there and shared by every process
(a fault that must fire N times in the whole run, whichever actors restart). Both variables
are passed on to the run's Ray actors, so a fault armed for a run fires where the work
happens.
"""

from __future__ import annotations

import os
import threading

ENV = "SLUICE_FAULTS"
DIR_ENV = "SLUICE_FAULTS_DIR"
# Points where the process dies outright (as from SIGKILL or a lost node), not raises: a
# rollout worker during a held-out evaluation or half way through loading a weight version,
# the trainer between its backward pass and its optimiser step, relay 0 half way through
# taking a version, the trajectory store taking a put, the dispatcher handing out groups.
EXITS = (
    "worker.evaluate",
    "worker.weight_load",
    "trainer.optimizer_step",
    "relay.handover",
    "store.put",
    "dispatcher.take",
)
POINTS = ("checkpoint.write", *EXITS)

_lock = threading.Lock()
_fired: dict[str, int] = {}
_calls: dict[str, int] = {}  # calls seen by this process (without a folder)
_next_call: dict[str, int] = {}  # the next call marker to try (with a folder)


class InjectedFault(OSError):
    """The failure a fault point raises (an OSError: what a real storage failure raises)."""


def armed() -> dict[str, tuple[int, int]]:
    """``{point: (times, calls to let pass first)}`` from ``SLUICE_FAULTS``; raises
    ValueError naming a bad entry."""
    spec = os.environ.get(ENV, "").strip()
    out: dict[str, tuple[int, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        times, _, skip = count.partition("@")
        if name not in POINTS or not times.isdigit() or not (skip.isdigit() or skip == ""):
            raise ValueError(
                f"{ENV}: bad entry {item!r}; expected POINT=TIMES or POINT=TIMES@SKIP with POINT "
                f"one of {POINTS}"
            )
        out[name] = (int(times), int(skip or 0))
    return out


def fault_point(name: str) -> None:
    """Raise ``InjectedFault`` if ``name`` is armed, its first calls have passed, and it has
    fired fewer times than asked; at a point of ``EXITS``, end the process at once instead
    (no cleanup, like a kill)."""
    times, skip = armed().get(name, (0, 0))
    if times and _fires(name, times, skip):
        if name in EXITS:
            os._exit(70)
        raise InjectedFault(f"injected fault at {name} ({ENV}={os.environ[ENV]})")


def _fires(name: str, times: int, skip: int) -> bool:
    """Count one more call of ``name``; True once ``skip`` calls have passed, while it has
    fired fewer than ``times`` times."""
    folder = os.environ.get(DIR_ENV)
    if folder:  # one marker file per call and per firing, made atomically: shared by all
        if os.path.exists(os.path.join(folder, f"{name}.{times - 1}")):
            return False  # fired every time already: nothing more to count
        if skip and not _passed(folder, name, skip):
            return False
        for i in range(times):
            try:
                with open(os.path.join(folder, f"{name}.{i}"), "x"):
                    return True
            except FileExistsError:
                continue
        return False
    with _lock:
        _calls[name] = _calls.get(name, 0) + 1
        if _calls[name] <= skip or _fired.get(name, 0) >= times:
            return False
        _fired[name] = _fired.get(name, 0) + 1
        return True


def _passed(folder: str, name: str, skip: int) -> bool:
    """Record one call of ``name`` in ``folder``; True once ``skip`` calls were recorded
    before it (in any process)."""
    with _lock:
        i = _next_call.get(name, 0)
        while i < skip:
            try:
                with open(os.path.join(folder, f"{name}.call.{i}"), "x"):
                    _next_call[name] = i + 1
                    return False
            except FileExistsError:
                i += 1
        _next_call[name] = skip
        return True
