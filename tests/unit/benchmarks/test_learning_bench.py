"""The learning-curve table: the median and range over seeds at each mark, per variant."""

from functools import reduce
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from benchmarks.learning import VARIANTS, record_path, rl_seconds, slug, table
from sluice.config.tree import load_config


def _record(variant: str, seed: int, curve: dict[int, float], steps: int = 400) -> dict:
    return {
        "variant": variant,
        "seed": seed,
        "steps": steps,
        "heldout": {str(k): v for k, v in curve.items()},
        "commit": "abc1234" if steps == 400 else "def5678",
        "machine": "a CPU (AVX2), x86_64",
    }


def test_the_table_gives_the_median_and_range_of_the_seeds():
    records = [
        _record("one_step", 0, {0: 0.332, 200: 0.41, 400: 0.457}),
        _record("one_step", 1, {0: 0.164, 200: 0.25, 400: 0.30}),
        _record("one_step", 2, {0: 0.203, 200: 0.29, 400: 0.35}),
        _record("async, stale_by last_token", 0, {0: 0.332, 400: 0.473}),
        _record("one_step", 0, {0: 0.332, 1600: 0.55}, steps=1600),  # another table's
    ]
    lines = table(records, 400).splitlines()
    assert "commit abc1234;" in lines[0] and "a CPU (AVX2)" in lines[0]
    assert lines[1].startswith("Command: `.venv/bin/python -m benchmarks.learning")
    header, rows = lines[3], lines[5:]
    assert header.startswith("| variant | 0 | 50 | 100 |")
    last_token, one_step = rows
    # seeds 0-2 at step 0: 33.2, 16.4, 20.3 -> median 20.3, range 16.4-33.2
    assert one_step.startswith(
        "| one_step (3 seeds) | 20.3% (16.4-33.2) | - | - | - | 29.0% (25.0-41.0)"
    )
    assert one_step.endswith("| 35.0% (30.0-45.7) |")
    assert last_token.startswith("| async, stale_by last_token (1 seed) | 33.2% |")
    assert "async, stale_by first_token" not in "\n".join(rows)  # no records: no row


def test_run_names_are_folder_safe():
    assert slug("async, stale_by last_token", 2) == "async--stale-by-last-token-s2"
    assert record_path("one_step", 0, 1600).name == "one-step-s0-1600steps.json"


def test_other_prompt_draws_are_kept_apart_from_the_grid():
    draw = record_path("one_step", 0, 1600, train_seed=2)
    assert (draw.parent.name, draw.name) == ("draws", "one-step-s0-t2-1600steps.json")


def test_rl_seconds_leave_out_the_evaluations():
    logged = {0: 10_000.0, 10: 80_000.0, 20: 150_000.0}  # ms, when each accuracy was logged
    spent = {0: 9.0, 10: 10.0, 20: 10.0}  # each evaluation's own seconds
    # step 10: 70 s after step 0's, 10 of them its evaluation; step 20: 140 - 20
    assert rl_seconds(logged, spent) == {0: 0.0, 10: 60.0, 20: 120.0}


def test_another_configs_short_runs_get_every_evaluation_and_its_minutes():
    runs = [
        {
            **_record("as configured", seed, {0: 0.19, 10: 0.54, 20: 0.67}, steps=20),
            "config": "configs/smollm2.yaml",
            "rl_seconds": {"0": 0.0, "10": 600.0 + 60 * seed, "20": 1200.0},
        }
        for seed in range(3)
    ]
    lines = table(runs, 20, "configs/smollm2.yaml").splitlines()
    assert lines[0].startswith("Records: `benchmarks/results/smollm2/`")
    assert "--config configs/smollm2.yaml --steps 20" in lines[1]
    assert lines[3] == "| variant | 0 | 10 | 20 |"
    assert (
        lines[5]
        == "| as configured (3 seeds) | 19.0% (19.0-19.0) | 54.0% (54.0-54.0) | 67.0% (67.0-67.0) |"
    )
    assert lines[6] == "| as configured: minutes of RL | 0 (0-0) | 11 (10-12) | 20 (20-20) |"
    assert record_path("as configured", 1, 60, "configs/smollm2.yaml").parent.name == "smollm2"


def test_an_examples_runs_name_the_pythonpath_its_code_needs():
    runs = [
        {
            **_record("as configured", seed, {0: 0.2, 25: 0.3}, steps=200),
            "config": "examples/my_project/agent.yaml",
            "pythonpath": "examples/my_project",
        }
        for seed in range(3)
    ]
    command = table(runs, 200, "examples/my_project/agent.yaml").splitlines()[1]
    assert command.startswith(
        "Command: `PYTHONPATH=examples/my_project .venv/bin/python -m benchmarks.learning "
        "--config examples/my_project/agent.yaml --steps 200"
    )
    assert record_path("as configured", 0, 200, "examples/my_project/agent.yaml").parent.name == (
        "agent"
    )


@pytest.mark.parametrize("label", list(VARIANTS), ids=[slug(v, 0) for v in VARIANTS])
def test_every_variant_is_a_valid_run_of_the_default_config(label):
    """Each variant's settings load (a typo or a refused combination raises) and take."""
    cfg = load_config(Path("configs/default.yaml"), VARIANTS[label])
    for setting in VARIANTS[label]:
        key, value = setting.split("=", 1)
        got, want = reduce(getattr, key.split("."), cfg), yaml.safe_load(value)
        if isinstance(got, BaseModel):  # a section (the critic's): set, with the keys given
            got = {name: getattr(got, name) for name in want}
        assert got == want, setting
