"""Scenario files, overrides, length models and replay: bad input names what is wrong."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.config.tree import RolloutConfig, RunConfig
from sluice.sim.command import parse_policy
from sluice.sim.engine import simulate
from sluice.sim.lengths import LengthError, draw_lengths, replay_groups
from sluice.sim.scenario import (
    LengthSpec,
    PolicySpec,
    ScenarioError,
    build_scenario,
    load_scenario,
)
from sluice.storage.schema import batch_from_rows


@pytest.mark.parametrize(
    ("tree", "named"),
    [
        ({"policy": {"mode": "streaming"}}, "policy.mode"),
        ({"workload": {"steps": -5}}, "workload.steps"),
        ({"workload": {"groups_per_step": 0}}, "workload.groups_per_step"),
        ({"cluster": {"rollout_accelerators": -1}}, "cluster.rollout_accelerators"),
        ({"costs": {"decode_step_s": -0.1}}, "costs.decode_step_s"),
        ({"workload": {"lengths": {"kind": "zipf"}}}, "workload.lengths.kind"),
        ({"cluster": {"gpus": 8}}, "cluster.gpus: unknown key"),
        ({"workload": {"lengths": {"kind": "replay"}}}, "lengths.replay"),
        (
            {"cluster": {"rollout_accelerators": 6, "accelerators_per_instance": 4}},
            "accelerators_per_instance",
        ),
        (
            {
                "cluster": {"placement": "colocated", "rollout_accelerators": 8},
                "policy": {"mode": "async"},
            },
            "colocated placement runs only",
        ),
        (
            {"cluster": {"max_concurrency": 4}, "workload": {"samples_per_group": 8}},
            "max_concurrency",
        ),
        (
            {
                "workload": {
                    "samples_per_group": 4,
                    "lengths": {"kind": "groups", "groups": [[1, 2]]},
                }
            },
            "samples_per_group",
        ),
    ],
    ids=[
        "unknown-mode",
        "negative-steps",
        "zero-groups",
        "negative-accelerators",
        "negative-cost",
        "unknown-lengths",
        "unknown-key",
        "replay-without-source",
        "tp-does-not-divide",
        "colocated-async",
        "concurrency-below-group",
        "groups-of-wrong-size",
    ],
)
def test_bad_scenarios_name_the_field(tree, named):
    with pytest.raises(ScenarioError) as error:
        build_scenario(tree)
    assert named in str(error.value)
    assert "\n" not in str(error.value)  # one line for the command line


def test_load_scenario_applies_overrides(tmp_path):
    file = tmp_path / "s.yaml"
    file.write_text("workload:\n  steps: 7\npolicy:\n  mode: sync\n")
    sc = load_scenario(file, ["policy.mode=async", "policy.max_staleness=3", "cluster.repair_s=1"])
    assert (sc.workload.steps, sc.policy.mode, sc.policy.max_staleness) == (7, "async", 3)
    assert sc.cluster.repair_s == 1.0


def test_load_scenario_reports_missing_and_broken_files(tmp_path):
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(tmp_path / "nope.yaml")
    broken = tmp_path / "b.yaml"
    broken.write_text("workload: [1, 2\n")
    with pytest.raises(ScenarioError, match="not valid"):
        load_scenario(broken)
    with pytest.raises(ScenarioError, match="not of the form"):
        load_scenario(None, ["workload.steps"])


def test_profile_costs_fill_in_and_explicit_costs_win():
    sc = load_scenario(None, ["costs.train_step_s=9"], profile="cpu2core")
    assert sc.costs.train_step_s == 9.0
    assert sc.costs.train_overlap_factor > 1.0  # from the profile
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(None, [], profile="no-such-profile")


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("sync", {"mode": "sync", "long_first": False, "balance": False, "repack": False}),
        (
            "one_step,dispatch",
            {"mode": "one_step", "long_first": True, "balance": True, "repack": False},
        ),
        (
            "async,k=2,repack",
            {
                "mode": "async",
                "max_staleness": 2,
                "long_first": False,
                "balance": False,
                "repack": True,
            },
        ),
        (
            "async,k=4,dispatch,repack,no-partial,first-token,no-credit",
            {
                "mode": "async",
                "max_staleness": 4,
                "long_first": True,
                "balance": True,
                "repack": True,
                "partial_rollout": False,
                "stale_by": "first_token",
                "credit_drops": False,
            },
        ),
    ],
)
def test_parse_policy(text, fields):
    assert parse_policy(text) == fields


def test_policy_settings_a_run_has_are_the_run_configs_own_fields():
    # Declared once, in sluice/config/tree.py: the same type, default, bounds and description, so a
    # default changed there changes the simulator's too.
    shared = set()
    for name, field in PolicySpec.model_fields.items():
        for section in (RunConfig, RolloutConfig):
            real = section.model_fields.get(name)
            if real is None:
                continue
            shared.add(name)
            mine = (field.annotation, field.default, field.metadata, field.description)
            assert mine == (real.annotation, real.default, real.metadata, real.description), name
    assert shared == {
        "mode",
        "max_staleness",
        "stale_by",
        "partial_rollout",
        "long_first",
        "balance",
        "repack",
        "repack_max_stragglers",
        "repack_min_age_s",
    }


def test_a_scenario_without_a_policy_runs_sluices_default_policy():
    policy, run = build_scenario({}).policy, RunConfig()
    assert (policy.mode, policy.max_staleness) == (run.mode, run.max_staleness)
    for name in ("partial_rollout", "long_first", "balance", "repack", "repack_min_age_s"):
        assert getattr(policy, name) == getattr(run.rollout, name), name
    with pytest.raises(ScenarioError, match=r"policy\.repack_max_stragglers"):
        build_scenario({"policy": {"repack_max_stragglers": 0}})  # the run's bound, ge=1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("streaming", "unknown policy 'streaming'"),
        ("async,k=two", "k must be a whole number"),
        ("async,k=-1", "k must be a whole number"),
        ("async,fast", "unknown option 'fast'"),
        ("sync,k=2", "async only"),
    ],
)
def test_parse_policy_rejects(text, message):
    with pytest.raises(ScenarioError, match=message):
        parse_policy(text)


def test_long_tail_draws_are_capped_and_skewed():
    spec = LengthSpec(
        kind="mixture", median=200, tail_fraction=0.1, tail_median=5000, max_tokens=4096
    )
    lengths = draw_lengths(spec, 2000, 8, np.random.default_rng(0))
    assert lengths.shape == (2000, 8)
    assert lengths.min() >= 1 and lengths.max() == 4096
    assert np.percentile(lengths, 99) > 10 * np.median(lengths)


def test_groups_lengths_cycle_from_the_first_index():
    spec = LengthSpec(kind="groups", groups=[[1, 2], [3, 4], [5, 6]])
    drawn = draw_lengths(spec, 4, 2, np.random.default_rng(0), first=2)
    assert drawn.tolist() == [[5, 6], [1, 2], [3, 4], [5, 6]]


def _write_run(folder: Path, groups: dict[str, list[int]]) -> None:
    now = datetime.now(UTC)
    rows = []
    for group, lengths in groups.items():
        for j, n in enumerate(lengths):
            rows.append(
                {
                    "sample_id": f"{group}/{j}",
                    "prompt_id": group.split("@")[0],
                    "group_id": group,
                    "env": "addition",
                    "prompt_ids": [1, 2, 3],
                    "response_ids": [7] * n,
                    "behaviour_logprobs": [-0.5] * n,
                    "token_versions": [0] * n,
                    "reward": 1.0,
                    "advantage": 0.0,
                    "prompt_len": 3,
                    "response_len": n,
                    "status": "scored",
                    "reason": None,
                    "generated_at": now,
                    "scored_at": now,
                }
            )
    trajectories = folder / "trajectories"
    trajectories.mkdir(parents=True)
    table = pa.Table.from_batches([batch_from_rows(rows)])
    pq.write_table(table.slice(0, 16), trajectories / "0001-a.parquet")
    pq.write_table(table.slice(16), trajectories / "0002-b.parquet")


def test_replay_reads_whole_groups_from_a_runs_trajectories(tmp_path):
    groups = {f"p{i}@r{i}": [10 * i + j for j in range(1, 5)] for i in range(1, 11)}
    _write_run(tmp_path / "run", groups)
    table = replay_groups(str(tmp_path / "run"), 4)
    assert sorted(map(tuple, table.astype(int).tolist())) == sorted(
        tuple(v) for v in groups.values()
    )
    # a storage URL works as well as a folder, and the trajectories/ folder itself
    assert replay_groups((tmp_path / "run").as_uri(), 4).shape == (10, 4)
    assert replay_groups(str(tmp_path / "run" / "trajectories"), 4).shape == (10, 4)
    # a group size the run did not have: each group is filled from its own lengths
    wide = replay_groups(str(tmp_path / "run"), 6)
    for row in wide.astype(int).tolist():
        assert set(row) <= set(groups[f"p{row[0] // 10}@r{row[0] // 10}"])


def test_replayed_lengths_drive_a_simulation(tmp_path):
    groups = {f"p{i}@r{i}": [5, 5, 5, 50] for i in range(1, 11)}
    _write_run(tmp_path / "run", groups)
    sc = build_scenario(
        {
            "workload": {
                "steps": 3,
                "groups_per_step": 2,
                "samples_per_group": 4,
                "prompt_tokens": 0,
                "lengths": {"kind": "replay", "replay": str(tmp_path / "run")},
            },
            "cluster": {"rollout_accelerators": 1, "train_accelerators": 1},
            "costs": {
                "decode_step_s": 0.01,
                "decode_per_request_s": 0.0,
                "prefill_per_token_s": 0.0,
                "train_step_s": 1.0,
                "train_per_token_s": 0.0,
                "model_bytes": 0.0,
                "sync_latency_s": 0.0,
            },
            "policy": {"mode": "sync"},
        }
    )
    result = simulate(sc)
    assert result.trained_tokens == 3 * 2 * 65
    assert result.steady_step_s == pytest.approx(50 * 0.01 + 1.0)


def test_replay_without_trajectories_says_where_it_looked(tmp_path):
    with pytest.raises(LengthError, match="no trajectory Parquet files"):
        replay_groups(str(tmp_path), 4)


def test_replay_from_a_ledger_folder_reads_the_runs_trajectories(tmp_path):
    groups = {f"p{i}@r{i}": [3, 4] for i in range(1, 11)}
    _write_run(tmp_path / "run", {g: v * 2 for g, v in groups.items()})
    (tmp_path / "run" / "ledger").mkdir()
    assert replay_groups(str(tmp_path / "run" / "ledger"), 4).shape == (10, 4)


def test_replay_of_parquet_without_lengths_names_the_columns(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    pq.write_table(pa.table({"sample_id": ["a"], "event": ["trained"]}), folder / "x.parquet")
    with pytest.raises(LengthError, match=r"no \['group_id', 'response_len'\] column"):
        replay_groups(str(folder), 4)
