"""What the console shows: one line per record, the traceback only in the run's log file."""

from __future__ import annotations

import logging

from sluice.flows.cli import CONSOLE_CHARS, OneLine, describe, first_line


def _record(message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error else None
    return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, (), exc_info)


def _raised() -> BaseException:
    try:
        raise RuntimeError("boom\n  remote traceback line")
    except RuntimeError as error:
        return error


def test_a_failure_is_one_console_line_and_keeps_its_traceback_for_the_file() -> None:
    error = _raised()
    record = _record("Task run failed with exception: \x1b[36mboom\x1b[39m\nmore", error)
    line = OneLine("%(message)s").format(record)
    assert line == "Task run failed with exception: boom"
    # The record is as it was: the file handler, after the console's, formats the traceback.
    full = logging.Formatter("%(message)s").format(record)
    assert "Traceback (most recent call last)" in full and "RuntimeError: boom" in full
    assert record.exc_info is not None and record.exc_info[1] is error


def test_long_lines_are_cut() -> None:
    line = OneLine("%(message)s").format(_record("x" * 5000))
    assert len(line) == CONSOLE_CHARS and line.endswith("...")


def test_the_closing_message_takes_the_errors_first_line() -> None:
    assert first_line(_raised()) == "boom"
    assert first_line(ValueError("")) == ""


def test_an_error_raised_in_an_actor_is_named_by_its_own_exception() -> None:
    from ray.exceptions import RayTaskError

    cause = OSError("injected fault at checkpoint.write")
    error = RayTaskError(
        "Trainer.save_checkpoint", "Traceback...\nOSError: injected", cause, proctitle="x"
    )
    described = describe(error)
    assert described.startswith("OSError in ")
    assert described.endswith(": injected fault at checkpoint.write")
    assert describe(ValueError("bad\nsecond")) == "ValueError: bad"


def test_eval_evaluates_the_configs_policy_folder_or_says_what_to_give(tmp_path) -> None:
    from typer.testing import CliRunner

    from sluice.flows.cli import app

    root = f"root={tmp_path}"
    both = CliRunner().invoke(app, ["eval", "--model", "m@champion", "--policy", "p"])
    assert both.exit_code == 2 and "not both" in both.output
    # The default config builds its own policy: there is no folder to fall back on.
    neither = CliRunner().invoke(app, ["eval", "--set", root])
    assert neither.exit_code == 2
    assert "the config names no policy.path" in neither.output
