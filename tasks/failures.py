"""Which failures a task's retry can help with, read from the exception a task ended in.

Driven by the flow's tasks (``tasks/job.py``: the ``retry_condition_fn`` of ``start-ray``,
``checkpoint`` and ``train-segment``). A retry starts fresh pools from the newest checkpoint:
that helps when a process died or a call timed out. An error that follows from the config,
the data or the code (trajectory files of another schema version, a value the code cannot
take) would fail again on every retry, minutes later; the run ends at once with it.

A Ray error carries the exception raised in an actor: ``RayTaskError.cause``, or, for an
actor whose constructor raised, the ``RayTaskError`` that ``ActorDiedError`` holds as its
argument.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from sluice.config.tree import ConfigError
from sluice.engines.agents.chat_template import TemplateError
from sluice.envs.dataset import DataError
from sluice.envs.prompts import PromptsTooLong
from sluice.storage.schema import SchemaError

log = logging.getLogger("sluice")

# Raised the same way on every try. TypeError: a value the code cannot take (an object
# Ray cannot serialise, a wrong argument) is a bug or a bad config, not bad luck.
DETERMINISTIC: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    PromptsTooLong,
    SchemaError,
    TemplateError,
    TypeError,
)


def carried(error: BaseException) -> Iterator[BaseException]:
    """``error``, then each exception it carries (Ray's ``cause``, an actor's creation
    error, ``raise ... from``), outermost first."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        inner = [getattr(current, "cause", None), current.__cause__, *current.args]
        todo += [e for e in inner if isinstance(e, BaseException)]


def deterministic(error: BaseException) -> BaseException | None:
    """The innermost exception in ``error`` that a retry would meet again, or None (Ray's
    ``RayTaskError(SchemaError)`` is a SchemaError too: its ``cause`` is the one named)."""
    found = [e for e in carried(error) if isinstance(e, DETERMINISTIC)]
    return found[-1] if found else None


def retry_may_help(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry unless the failure is deterministic."""
    error = state.data
    found = deterministic(error) if isinstance(error, BaseException) else None
    if found is None:
        return True
    first = (str(found).strip().splitlines() or [""])[0]
    log.error(
        "%s failed with %s, which a retry meets again: not retrying (%s)",
        task.name,
        type(found).__name__,
        first,
    )
    return False
