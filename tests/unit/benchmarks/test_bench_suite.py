"""benchmarks/suite.py (`make bench`): no run from a checkout that differs from its commit,
and the run's section names the commit and each target's minutes and outcome."""

import subprocess
from datetime import UTC, datetime

import pytest

from sluice.benchmarks import suite


def test_a_checkout_with_uncommitted_changes_is_refused(monkeypatch):
    monkeypatch.setattr(suite, "uncommitted", lambda: ["benchmarks/modes.py"])
    monkeypatch.setattr(suite, "run_targets", pytest.fail)  # nothing may run
    monkeypatch.setattr("sys.argv", ["suite", "bench-data"])
    with pytest.raises(SystemExit, match=r"differs from its commit \(benchmarks/modes.py\)"):
        suite.main()


def test_the_section_gives_the_commit_and_each_targets_minutes_and_outcome():
    started = datetime(2026, 11, 26, 21, 0, tzinfo=UTC)
    text = suite.section("abc1234", started, [("bench-data", 8.04, 0), ("bench-modes", 31.5, 2)])
    assert "every section below that names commit abc1234 came from it" in text
    assert "from 2026-11-26 21:00 to" in text and "40 minutes" in text
    assert "`.venv/bin/python -m sluice.benchmarks.suite bench-data bench-modes`" in text
    assert "| `make bench-data` | 8.0 | ok |" in text
    assert "| `make bench-modes` | 31.5 | failed (2) |" in text


def test_uncommitted_lists_tracked_changes_only(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    monkeypatch.setattr(suite, "ROOT", tmp_path)
    (tmp_path / "new.txt").write_text("untracked")  # outputs a run may leave: not counted
    assert suite.uncommitted() == []
    (tmp_path / "a.txt").write_text("2")
    assert suite.uncommitted() == ["a.txt"]
