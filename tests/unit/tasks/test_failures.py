"""Which failures a task retries (``tasks/failures.py``): an error that would be met again
ends the run at once, found inside the wrappers Ray puts around an actor's exception."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from sluice.flows.cli import describe
from sluice.storage.schema import SchemaError
from sluice.tasks.failures import deterministic, retry_may_help


def _in_actor(error: BaseException, call: str) -> RayTaskError:
    """Ray's error for ``call`` raising ``error``: its text starts as Ray's does."""
    text = f"ray::{call}() (pid=1, ip=127.0.0.1)\nTraceback...\n{error!r}"
    return RayTaskError(call, text, error, proctitle=f"ray::{call}")


def _retried(error: BaseException) -> bool:
    return retry_may_help(SimpleNamespace(name="train-segment"), None, SimpleNamespace(data=error))


def test_a_schema_error_in_an_actors_constructor_is_not_retried(caplog) -> None:
    schema = SchemaError("trajectory data was written with schema version 9")
    died = ActorDiedError.from_task_error(_in_actor(schema, "TrajectoryStore.__init__"))
    assert deterministic(died) is schema
    with caplog.at_level(logging.ERROR, logger="sluice"):
        assert not _retried(died)
    assert "train-segment failed with SchemaError" in caplog.text
    assert "schema version 9" in caplog.text
    assert describe(died) == (
        "SchemaError in ray::TrajectoryStore.__init__(): "
        "trajectory data was written with schema version 9"
    )


@pytest.mark.parametrize(
    "error",
    [
        # what ray.get raises: Ray's error is an instance of its cause's class too
        _in_actor(
            TypeError("cannot pickle '_thread.lock' object"), "Worker.f"
        ).as_instanceof_cause(),
        RuntimeError("segment failed"),  # raised from a deterministic one
    ],
)
def test_deterministic_errors_are_found_where_they_are_carried(error) -> None:
    if isinstance(error, RayTaskError):
        assert isinstance(error, TypeError) and type(deterministic(error)) is TypeError
    if isinstance(error, RuntimeError):
        try:
            raise error from TypeError("unsupported operand")
        except RuntimeError as raised:
            error = raised
    assert deterministic(error) is not None and not _retried(error)


@pytest.mark.parametrize(
    "error",
    [
        _in_actor(OSError("injected fault at checkpoint.write"), "Trainer.save_checkpoint"),
        ActorDiedError(),  # a process that died: fresh pools may well succeed
        TimeoutError("weight pull timed out"),
    ],
)
def test_transient_errors_are_retried(error) -> None:
    assert deterministic(error) is None and _retried(error)
