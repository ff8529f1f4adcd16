"""Benchmark records (benchmarks/records.py): kept as they were measured, and BENCHMARKS.md's
sections written from them and from nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from benchmarks import records
from benchmarks.datasets import render as datasets_render
from benchmarks.records import Record, command_line, keep, newest, read
from benchmarks.regenerate import NOT_YET_RECORDED
from benchmarks.report import BENCHMARKS, ROOT, read_section

MEASURED = {
    "rows": 1_000_000.0,
    "file_mb": 19.6,
    "start_s": 1.234,
    "start_rss_mb": 51.0,
    "stream_rows_per_s": 812_345.0,
    "stream_peak_rss_mb": 60.2,
    "stream_first_rss_mb": 55.0,
    "stream_last_rss_mb": 58.9,
    "read_whole_s": 0.31,
    "read_whole_rss_mb": 120.4,
}


def _record(**changes) -> Record:
    data = {"rows": 1_000_000, "take": 524_288, "measured": MEASURED}
    record = Record.measured(
        "datasets", "Data sets at start-up", datasets_render, data, ["pyarrow"]
    )
    return replace(record, **changes)


def test_every_recorded_section_is_what_its_newest_record_renders():
    for section in records.sections():
        record = newest(section)
        assert record is not None and record.section == section
        assert read_section(section) == record.text(), (
            f"BENCHMARKS.md's {section} section is not what its newest record renders: "
            "run .venv/bin/python -m benchmarks.regenerate"
        )


def test_every_section_has_a_record_or_waits_for_its_next_measurement():
    marked = set(re.findall(r"<!-- ([a-z0-9-]+):begin -->", BENCHMARKS.read_text()))
    recorded = set(records.sections())
    assert marked >= NOT_YET_RECORDED, "NOT_YET_RECORDED names a section BENCHMARKS.md lacks"
    assert not (recorded & NOT_YET_RECORDED), (
        f"{sorted(recorded & NOT_YET_RECORDED)} have records now: take them out of "
        "benchmarks/regenerate.py's NOT_YET_RECORDED"
    )
    assert marked - NOT_YET_RECORDED <= recorded, "a section has neither record nor excuse"


def test_a_record_keeps_its_provenance_and_renders_the_same_after_reading_back(tmp_path):
    record = _record(commit="abc1234", date="2026-11-30 17:40 UTC")
    path = keep(record, tmp_path)
    assert path == tmp_path / "datasets" / "20261130T1740-abc1234.json"
    assert json.loads(path.read_text())["render"] == "benchmarks.datasets:render"
    again = read(path)
    assert again == record and again.text() == record.text()
    assert set(record.machine) == {"cpu", "arch", "cores", "python"}
    assert record.versions["pyarrow"]
    assert newest("datasets", tmp_path) == record
    keep(_record(commit="def5678", date="2026-12-01 09:05 UTC"), tmp_path)
    assert newest("datasets", tmp_path).commit == "def5678"


def test_a_section_is_rendered_from_the_record_alone():
    text = _record(commit="abc1234", date="2026-11-30 17:40 UTC").text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert "pyarrow " in first and "A Parquet file of 1,000,000 rows (20 MB)" in first
    assert "| stream 524,288 training prompts | 812,345 rows/s |" in text
    assert "+60 MB at the peak" in text


def test_a_file_that_is_not_a_record_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"section": "x"}))
    with pytest.raises(ValueError, match=r"x\.json is not a benchmark record"):
        read(bad)


def test_the_command_is_written_as_a_reader_types_it():
    argv = ["/repo/benchmarks/datasets.py", "--rows", "1000", "--write"]
    assert command_line(argv) == ".venv/bin/python -m benchmarks.datasets --rows 1000 --write"


def test_a_renderer_run_as_a_script_is_named_by_its_module(tmp_path):
    """``python -m benchmarks.<name>`` runs the module as ``__main__``: the record must still
    name the module, or nothing could render it again."""
    (tmp_path / "bench_here.py").write_text(
        "from benchmarks.records import Record\n"
        "def render(record):\n"
        "    return ''\n"
        "if __name__ == '__main__':\n"
        "    print(Record.measured('s', 't', render, {}).render)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "bench_here"], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "bench_here:render"


def test_the_benchmarks_scratch_folder_is_made_in_a_fresh_clone(tmp_path, monkeypatch):
    """A fresh clone has no runs/: the benchmarks that run in a temporary folder under it
    make it first (bench-kill-resume and bench-peer failed there before)."""
    from benchmarks import report

    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert report.scratch() == tmp_path / "runs"
    assert (tmp_path / "runs").is_dir()
    assert report.scratch() == tmp_path / "runs"  # and is kept when it is there
