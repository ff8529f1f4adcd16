"""benchmarks/suite.py (`make bench`): no run from a checkout whose code differs from its
commit; the commit sections name is the newest that changed code; a target already measured
at it is not run again, and one that would end after --stop-by is not started; the run's
section keeps the earlier sittings' rows."""

import subprocess
from dataclasses import astuple, replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from benchmarks import quotes, records, report, suite


def git(root, *args):
    out = subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def commit_all(root, message):
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return git(root, "rev-parse", "--short", "HEAD")


@pytest.fixture
def bench_md(tmp_path, monkeypatch):
    """A BENCHMARKS.md and a records folder of the test's own."""
    path = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(report, "BENCHMARKS", path)
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(quotes, "files", list)  # the checkout's pages are not the test's
    return path


def _run_record(targets: list[str], rows: dict[str, suite.Row], commit: str = "abc1234"):
    data = {"targets": targets, "rows": {t: astuple(r) for t, r in rows.items()}}
    record = records.Record.measured("bench-run", "This run", suite.render, data, ["torch"])
    command = f".venv/bin/python -m benchmarks.suite {' '.join(targets)}"
    return replace(record, commit=commit, command=command)


def test_a_checkout_with_uncommitted_code_is_refused(monkeypatch):
    monkeypatch.setattr(suite, "uncommitted", lambda: ["benchmarks/modes.py"])
    monkeypatch.setattr(suite, "run_targets", pytest.fail)  # nothing may run
    monkeypatch.setattr("sys.argv", ["suite", "bench-data"])
    with pytest.raises(SystemExit, match=r"differs from its commit \(benchmarks/modes.py\)"):
        suite.main()


def test_uncommitted_lists_tracked_code_changes_only(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    for name in ("a.txt", "BENCHMARKS.md", "docs/x.md"):
        (tmp_path / name).write_text("1")
    git(tmp_path, "init", "-q")
    commit_all(tmp_path, "a")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "new.txt").write_text("untracked")  # outputs a run may leave: not counted
    (tmp_path / "BENCHMARKS.md").write_text("2")  # an earlier sitting's sections
    (tmp_path / "docs/x.md").write_text("2")
    assert report.uncommitted() == []
    (tmp_path / "a.txt").write_text("2")
    assert report.uncommitted() == ["a.txt"]


def test_the_measured_commit_is_the_newest_that_changed_code(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("1")
    code = commit_all(tmp_path, "code")
    (tmp_path / "BENCHMARKS.md").write_text("results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/results.md").write_text("quoted")
    commit_all(tmp_path, "results only")
    assert report.measured_commit(tmp_path) == code
    (tmp_path / "a.py").write_text("2")
    assert report.measured_commit(tmp_path) == code  # uncommitted: the suite refuses it
    newer = commit_all(tmp_path, "more code")
    assert newer != code and report.measured_commit(tmp_path) == newer


def test_code_changes_name_what_a_measurement_runs_and_nothing_else(tmp_path):
    git(tmp_path, "init", "-q")
    for name in ("storage/store.py", "benchmarks/peer.py", "benchmarks/tables.py", "tests/t.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1")
    first = commit_all(tmp_path, "code")
    for name in ("benchmarks/tables.py", "tests/t.py", "BENCHMARKS.md"):
        (tmp_path / name).write_text("2")
    tables = commit_all(tmp_path, "a table, a test and results")
    assert report.code_changes(first, tables, root=tmp_path) == []
    assert report.code_changes(first, tables, ("benchmarks/tables.py",), tmp_path) == [
        "benchmarks/tables.py"
    ]
    (tmp_path / "benchmarks/peer.py").write_text("2")
    (tmp_path / "storage/store.py").write_text("2")
    code = commit_all(tmp_path, "code again")
    assert report.code_changes(tables, code, ("benchmarks/peer.py",), tmp_path) == [
        "benchmarks/peer.py",
        "storage/store.py",
    ]
    assert report.code_changes(code, first, root=tmp_path) == ["storage/store.py"]
    assert report.code_changes("0000000", code, root=tmp_path) == [
        f"0000000 or {code} (not a commit of this checkout)"
    ]


def test_targets_measured_at_the_commit_are_not_run_again(bench_md, monkeypatch):
    earlier = _run_record(
        ["bench-data", "bench-micro-batch"],
        {"bench-data": suite.Row("2026-11-27 11:50", 8.04, "ok")},
    )
    records.keep(earlier)
    bench_md.write_text(
        "# Benchmarks\n\n## This run\n\n<!-- bench-run:begin -->\n"
        + earlier.text()
        + "\n<!-- bench-run:end -->\n\n## Data planes\n\n<!-- data-planes:begin -->\n"
        "Measured 2026-11-27 at commit abc1234 on x86_64\n<!-- data-planes:end -->\n\n"
        "## Trainer micro-batches\n\n<!-- micro-batch:begin -->\n"
        "Measured 2026-11-20 at commit 0000000 on x86_64\n<!-- micro-batch:end -->\n"
    )
    ran = []

    def run(cmd, cwd):
        ran.append(cmd[-1])
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(suite, "uncommitted", list)
    monkeypatch.setattr(suite, "measured_commit", lambda: "abc1234")
    monkeypatch.setattr(records, "measured_commit", lambda: "abc1234")
    monkeypatch.setattr(suite.subprocess, "run", run)
    monkeypatch.setattr("sys.argv", ["suite", "bench-data", "bench-micro-batch"])
    suite.main()
    assert ran == ["bench-micro-batch"]
    text = report.read_section("bench-run")
    assert "| `make bench-data` | 2026-11-27 11:50 | 8.0 | ok |" in text  # kept
    assert "| `make bench-micro-batch` |" in text and "2 of 2 targets" in text
    assert "Not measured" not in text
    assert text == records.newest("bench-run").text()  # the section is its record's


def test_a_target_that_would_end_after_stop_by_is_not_started(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(
        suite.subprocess,
        "run",
        lambda cmd, cwd: ran.append(cmd[-1]) or SimpleNamespace(returncode=2),
    )
    stop_by = datetime.now(UTC) + timedelta(minutes=5)
    rows = suite.run_targets(["bench-modes", "bench-datasets"], stop_by)
    assert ran == ["bench-datasets"]
    assert rows["bench-datasets"].result == "failed (2)"
    assert "not starting make bench-modes: it usually takes 40 min" in capsys.readouterr().out


def test_the_section_gives_the_commit_each_targets_row_and_what_is_left():
    text = _run_record(
        ["bench-data", "bench-modes", "bench-peer"],
        {
            "bench-data": suite.Row("2026-11-26 21:00", 8.04, "ok"),
            "bench-modes": suite.Row("2026-11-27 09:10", 31.5, "failed (2)"),
        },
    ).text()
    assert "Every section below that names commit abc1234 was measured at it" in text
    assert "2 of 3 targets, started from 2026-11-26 21:00 to 2026-11-27 09:10 UTC" in text
    assert "40 minutes in all" in text
    assert "`.venv/bin/python -m benchmarks.suite bench-data bench-modes bench-peer`" in text
    assert "| `make bench-data` | 2026-11-26 21:00 | 8.0 | ok |" in text
    assert "| `make bench-modes` | 2026-11-27 09:10 | 31.5 | failed (2) |" in text
    assert "Not measured at this commit yet: `make bench-peer`." in text


def test_every_bench_target_in_the_makefile_has_its_sections_and_usual_minutes():
    makefile = (suite.ROOT / "Makefile").read_text()
    targets = makefile.split("BENCH_TARGETS :=", 1)[1].split("\nbench:", 1)[0]
    names = targets.replace("\\", " ").split()
    assert sorted(names) == sorted(suite.SECTIONS) == sorted(suite.USUAL_MINUTES)
