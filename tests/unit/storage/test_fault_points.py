"""Fault points fire as armed: per process, or a fixed number of times in the whole run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.storage import faults


def test_a_point_fires_the_times_it_is_armed_per_process(monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "checkpoint.write=2")
    monkeypatch.delenv(faults.DIR_ENV, raising=False)
    monkeypatch.setattr(faults, "_fired", {})
    for _ in range(2):
        with pytest.raises(faults.InjectedFault, match=r"checkpoint\.write"):
            faults.fault_point("checkpoint.write")
    faults.fault_point("checkpoint.write")  # the third call passes


def _processes(spec: str, folder: Path, calls: int) -> list[str]:
    """Three processes in turn, each calling the armed point ``calls`` times: "fired" or
    "passed" for each call, in order."""
    code = (
        "from sluice.storage.faults import fault_point, InjectedFault\n"
        f"for _ in range({calls}):\n"
        "    try:\n        fault_point('checkpoint.write')\n"
        "    except InjectedFault:\n        print('fired')\n"
        "    else:\n        print('passed')\n"
    )
    env = {faults.ENV: spec, faults.DIR_ENV: str(folder), "PATH": "/usr/bin"}
    out = []
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        out += run.stdout.split()
    return out


def test_with_a_folder_the_count_is_shared_by_every_process(tmp_path: Path) -> None:
    assert _processes("checkpoint.write=2", tmp_path, calls=1) == ["fired", "fired", "passed"]


def test_a_bad_entry_is_named(monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "nope=1")
    with pytest.raises(ValueError, match="bad entry 'nope=1'"):
        faults.armed()


def test_a_point_lets_its_first_calls_pass_then_fires(monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "checkpoint.write=1@3")
    monkeypatch.delenv(faults.DIR_ENV, raising=False)
    monkeypatch.setattr(faults, "_fired", {})
    monkeypatch.setattr(faults, "_calls", {})
    for _ in range(3):
        faults.fault_point("checkpoint.write")
    with pytest.raises(faults.InjectedFault):
        faults.fault_point("checkpoint.write")
    faults.fault_point("checkpoint.write")  # fired once: done


def test_with_a_folder_the_calls_that_pass_are_counted_over_every_process(tmp_path: Path) -> None:
    calls = _processes("checkpoint.write=1@3", tmp_path, calls=2)
    assert calls == ["passed"] * 3 + ["fired"] + ["passed"] * 2
