from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.storage.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    VERSION_KEY,
    SchemaError,
    batch_from_rows,
    check_version,
    validate_batch,
)
from sluice.storage.trajectory_store import check_trajectory_versions


def row(**overrides):
    base = {
        "sample_id": "s1",
        "prompt_id": "p1",
        "group_id": "g1",
        "env": "addition",
        "prompt_ids": [1, 2, 3],
        "response_ids": [4, 5],
        "behaviour_logprobs": [-0.5, -1.0],
        "token_versions": [7, 8],
        "reward": 1.0,
        "advantage": 0.25,
        "prompt_len": 3,
        "response_len": 2,
        "status": "scored",
        "generated_at": datetime(2026, 1, 1, tzinfo=UTC),
    }
    base.update(overrides)
    return base


def raw_batch(*rows, schema=SCHEMA):
    return pa.RecordBatch.from_pylist(list(rows), schema=schema)


def test_a_valid_batch_passes_and_survives_parquet(tmp_path):
    batch = batch_from_rows([row(), row(sample_id="s2", reward=None, status="generated")])
    assert batch.schema.metadata[VERSION_KEY] == str(SCHEMA_VERSION).encode()
    pq.write_table(pa.Table.from_batches([batch]), tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    check_version(table.schema)
    for back in table.to_batches():
        validate_batch(back)
    assert table.column("reward").to_pylist() == [1.0, None]


def test_a_missing_column_is_named():
    batch = raw_batch(row()).drop_columns(["token_versions"])
    with pytest.raises(SchemaError, match="column 'token_versions' is missing"):
        validate_batch(batch)


def test_a_wrong_type_is_named_with_the_expected_type():
    fields = [pa.field("reward", pa.float64()) if f.name == "reward" else f for f in SCHEMA]
    batch = raw_batch(row(), schema=pa.schema(fields, metadata=SCHEMA.metadata))
    with pytest.raises(SchemaError, match=r"column 'reward' has type double, expected float"):
        validate_batch(batch)


def test_an_unexpected_column_is_named():
    batch = raw_batch(row()).append_column("extra", pa.array([1]))
    with pytest.raises(SchemaError, match="extra"):
        validate_batch(batch)


def test_a_null_in_a_required_column_is_named():
    with pytest.raises(SchemaError, match="column 'env' is null at row 1"):
        validate_batch(raw_batch(row(), row(sample_id="s2", env=None)))


@pytest.mark.parametrize(
    "column", ["behaviour_logprobs", "token_versions", "response_ids", "loss_mask"]
)
def test_response_lists_of_different_lengths_are_named(column):
    short = row(sample_id="s2", **{column: row(loss_mask=[1, 0])[column][:1]})
    with pytest.raises(SchemaError, match=rf"column '{column}' has 1 entries.*sample_id='s2'"):
        validate_batch(raw_batch(row(), short))


def test_a_loss_mask_is_optional_and_holds_only_0_and_1():
    validate_batch(raw_batch(row(), row(sample_id="s2", loss_mask=[1, 0])))
    with pytest.raises(SchemaError, match="'loss_mask' holds a value other than 0 and 1"):
        validate_batch(raw_batch(row(loss_mask=[1, 2])))


def test_response_len_must_match_the_tokens():
    with pytest.raises(SchemaError, match="response_len is 3"):
        validate_batch(raw_batch(row(response_len=3)))
    with pytest.raises(SchemaError, match="column 'prompt_len'"):
        validate_batch(raw_batch(row(prompt_len=2)))


def test_a_row_without_response_tokens_is_named():
    empty = row(response_ids=[], behaviour_logprobs=[], token_versions=[], response_len=0)
    with pytest.raises(SchemaError, match=r"row 0 \(sample_id='s1'\) has no response tokens"):
        validate_batch(raw_batch(empty))


def test_an_unknown_status_is_named():
    with pytest.raises(SchemaError, match=r"column 'status' is 'lost'.*expected one of generated"):
        validate_batch(raw_batch(row(status="lost")))


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_a_reward_that_is_not_finite_is_named(reward):
    with pytest.raises(SchemaError, match=r"column 'reward' .* expected a finite value"):
        validate_batch(raw_batch(row(reward=reward)))


@pytest.mark.parametrize("reward", [1.5, -0.5, -1.0])
def test_a_users_reward_outside_0_1_is_stored(reward):
    """A weighted sum of reward functions may leave [0, 1] (docs/environments.md: a weight
    of 2, the built-in overlong penalty's -1); the store takes it as it is."""
    validate_batch(raw_batch(row(reward=reward)))


def test_another_schema_version_fails_naming_both_versions():
    other = SCHEMA.with_metadata({VERSION_KEY: b"99"})
    with pytest.raises(SchemaError) as info:
        check_version(other)
    assert "schema version 99" in str(info.value)
    assert f"schema version {SCHEMA_VERSION}" in str(info.value)
    with pytest.raises(SchemaError, match="schema version 99"):
        validate_batch(raw_batch(row(), schema=other))


def test_data_without_version_metadata_is_refused():
    with pytest.raises(SchemaError, match=r"sluice\.schema_version"):
        validate_batch(raw_batch(row(), schema=SCHEMA.remove_metadata()))


def test_a_slice_is_checked_on_its_own_rows():
    batch = raw_batch(row(), row(sample_id="s2", response_len=3), row(sample_id="s3"))
    validate_batch(batch.slice(2, 1))  # the bad row lies outside this slice
    with pytest.raises(SchemaError, match=r"response_len is 3 at row 0 \(sample_id='s2'\)"):
        validate_batch(batch.slice(1, 2))


def test_a_run_folder_with_a_foreign_trajectory_file_is_refused_from_its_footer(tmp_path):
    """What a resume checks before anything starts: each trajectory file's schema version,
    named with the file; an unreadable file is left to the store (it drops its samples)."""
    check_trajectory_versions(tmp_path.as_uri())  # no trajectories yet: nothing to refuse
    folder = tmp_path / "trajectories"
    folder.mkdir()
    table = pa.Table.from_batches([batch_from_rows([row()])])
    pq.write_table(table, folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"not parquet")
    check_trajectory_versions(tmp_path.as_uri())  # no error: the run may resume
    pq.write_table(table.replace_schema_metadata({VERSION_KEY: b"9"}), folder / "c.parquet")
    with pytest.raises(SchemaError, match=r"c\.parquet: .*written with schema version 9"):
        check_trajectory_versions(tmp_path.as_uri())
