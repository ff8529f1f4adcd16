"""``sluice simulate``: a table for good input, one line of error for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.flows.cli import app

ROOT = Path(__file__).parents[3]
SMALL = [
    "--steps",
    "6",
    "--rollout",
    "2",
    "--train",
    "1",
    "--set",
    "workload.groups_per_step=4",
    "--set",
    "workload.samples_per_group=4",
    "--set",
    "workload.lengths.max_tokens=300",
    "--set",
    "cluster.max_concurrency=16",
]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_simulate_prints_a_table_of_the_policies(runner):
    result = runner.invoke(
        app, ["simulate", *SMALL, "--policy", "sync", "--policy", "async,k=2,dispatch"]
    )
    assert result.exit_code == 0, result.output
    assert "| sync |" in result.output
    assert "| async k=2 +dispatch |" in result.output
    assert "x sync" in result.output
    assert "staleness of trained samples" in result.output


def test_simulate_reads_a_scenario_file(runner, tmp_path):
    file = tmp_path / "s.yaml"
    file.write_text(
        "workload:\n  steps: 4\n  groups_per_step: 2\n  samples_per_group: 2\n"
        "  lengths: {kind: constant, median: 10}\n"
        "cluster: {rollout_accelerators: 1, train_accelerators: 1, max_concurrency: 8}\n"
    )
    result = runner.invoke(app, ["simulate", str(file), "-p", "one_step"])
    assert result.exit_code == 0, result.output
    assert "| one_step |" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "turbo"], "unknown policy 'turbo'"),
        (["--steps", "-3"], "workload.steps"),
        (["--rollout", "0"], "cluster.rollout_accelerators"),
        (["--set", "cluster.gpus=3"], "cluster.gpus: unknown key"),
        (["--lengths-from", "/nonexistent/run"], "no trajectory Parquet files"),
        (["--profile", "nope"], "not found"),
    ],
    ids=["policy", "negative-steps", "zero-rollout", "unknown-key", "replay", "profile"],
)
def test_bad_input_gets_one_line_of_error(runner, args, message):
    result = runner.invoke(app, ["simulate", *SMALL, *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    assert message in lines[0]


def test_check_calibration_prints_predicted_and_measured(runner):
    result = runner.invoke(app, ["simulate", "--check-calibration"])
    assert result.exit_code == 0, result.output
    assert "async k=2" in result.output and "measured" in result.output


def test_the_command_line_imports_the_simulator_only_when_asked():
    code = (
        "import sys, flows.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sim'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
