"""The trajectory schema: one Arrow row per sample, with its tokens, reward and status.

Rollout workers build rows as 'scored' (``storage.block_builder``); the trajectory store
takes them, hands them to the trainer out of Ray's object store and writes them to
``<url>/trajectories/`` as Parquet, read back by a restarted store and by offline analysis.
A row is never rewritten: what became of its sample (leased, trained, dropped) is recorded
in the ledger (``storage.ledger``), and the rollout workers leave ``version`` and
``trained_at`` null. ``validate_batch`` accepts any of ``STATUSES``; the store takes only
'scored' rows. The schema version lives in the schema metadata under
``sluice.schema_version``; ``validate_batch`` checks a batch before it is written and
``check_version`` refuses data written by another version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 3  # 2: loss_mask; 3: verdict
VERSION_KEY = b"sluice.schema_version"
STATUSES = ("generated", "scored", "failed", "leased", "trained", "dropped")
TIMESTAMP = pa.timestamp("ms", tz="UTC")

_FIELDS = [
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
    # The policy version that produced each response token (weights can change mid-sample).
    pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
    # 1 on the tokens the policy sampled, 0 on tokens an environment added between turns
    # (a multi-turn episode); null: every response token was sampled.
    pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("reward", pa.float32()),
    pa.field("advantage", pa.float32()),
    pa.field("prompt_len", pa.int32(), nullable=False),
    pa.field("response_len", pa.int32(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("reason", pa.string()),
    # What a judge model answered about the response (null: no judge scored it).
    pa.field("verdict", pa.string()),
    # The policy version the sample was trained at.
    pa.field("version", pa.int32()),
    pa.field("generated_at", TIMESTAMP),
    pa.field("scored_at", TIMESTAMP),
    pa.field("trained_at", TIMESTAMP),
]
SCHEMA = pa.schema(_FIELDS, metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()})
# Columns whose per-row lists must all have ``response_len`` entries.
RESPONSE_LISTS = ("response_ids", "behaviour_logprobs", "token_versions", "loss_mask")
_STATUS_SET = pa.array(STATUSES)


class SchemaError(ValueError):
    """A batch or file does not match the trajectory schema; the message names the column."""


def check_version(schema: pa.Schema) -> None:
    """Refuse data written with another schema version, naming both versions."""
    metadata = schema.metadata or {}
    raw = metadata.get(VERSION_KEY)
    if raw is None:
        raise SchemaError(
            f"schema metadata has no {VERSION_KEY.decode()!r} key: not written by this "
            f"trajectory schema (this code reads version {SCHEMA_VERSION})"
        )
    found = raw.decode(errors="replace")
    if found != str(SCHEMA_VERSION):
        raise SchemaError(
            f"trajectory data was written with schema version {found}, "
            f"but this code reads schema version {SCHEMA_VERSION}"
        )


def _same_type(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_list(expected):
        return pa.types.is_list(actual) and actual.value_type == expected.value_type
    return bool(actual == expected)


def _check_columns(schema: pa.Schema) -> None:
    expected_names = set(SCHEMA.names)
    for field in SCHEMA:
        if field.name not in schema.names:
            raise SchemaError(f"column {field.name!r} is missing (expected {field.type})")
        actual = schema.field(field.name).type
        if not _same_type(actual, field.type):
            raise SchemaError(f"column {field.name!r} has type {actual}, expected {field.type}")
    extra = [name for name in schema.names if name not in expected_names]
    if extra:
        raise SchemaError(f"unexpected column(s) {extra}: not in trajectory schema")


def _first(bad: pa.Array) -> int | None:
    """Index of the first True in ``bad`` (nulls count as False), or None.

    The true count is read first, so a clean batch costs no search.
    """
    if not bad.true_count:
        return None
    return int(pc.index(bad.fill_null(False), True).as_py())


def _row(batch: pa.RecordBatch, index: int) -> str:
    return f"row {index} (sample_id={batch.column('sample_id')[index].as_py()!r})"


def _check_nulls(batch: pa.RecordBatch) -> None:
    for field in SCHEMA:
        column = batch.column(field.name)
        if not field.nullable and column.null_count:
            index = _first(pc.is_null(column))
            raise SchemaError(
                f"column {field.name!r} is null at {_row(batch, index or 0)}; expected a value"
            )


def _list_lengths(column: pa.Array) -> np.ndarray:
    """Entries per row of a list column, from its offsets (nulls were refused before)."""
    return np.diff(column.offsets.to_numpy())


def _nulls(column: pa.Array) -> np.ndarray:
    """Which rows of ``column`` are null (a null list has no entries to check)."""
    if not column.null_count:
        return np.zeros(len(column), dtype=bool)
    return column.is_null().to_numpy(zero_copy_only=False)


def _check_lengths(batch: pa.RecordBatch) -> None:
    response_len = batch.column("response_len").to_numpy()
    empty = np.flatnonzero(response_len < 1)
    if empty.size:
        raise SchemaError(
            f"{_row(batch, int(empty[0]))} has no response tokens; a trajectory needs at least "
            "one (a failed sample keeps one, with loss mask 0)"
        )
    for name in RESPONSE_LISTS:
        column = batch.column(name)
        lengths = _list_lengths(column)
        wrong = np.flatnonzero((lengths != response_len) & ~_nulls(column))
        if wrong.size:
            index = int(wrong[0])
            raise SchemaError(
                f"column {name!r} has {lengths[index]} entries but response_len is "
                f"{response_len[index]} at {_row(batch, index)}; expected "
                f"{', '.join(RESPONSE_LISTS)} to all have response_len entries"
            )
    wrong = np.flatnonzero(
        _list_lengths(batch.column("prompt_ids")) != batch.column("prompt_len").to_numpy()
    )
    if wrong.size:
        raise SchemaError(
            f"column 'prompt_len' does not match len(prompt_ids) at {_row(batch, int(wrong[0]))}"
        )


def _check_status(batch: pa.RecordBatch) -> None:
    status = batch.column("status")
    index = _first(pc.invert(pc.is_in(status, value_set=_STATUS_SET)))
    if index is not None:
        raise SchemaError(
            f"column 'status' is {status[index].as_py()!r} at {_row(batch, index)}; "
            f"expected one of {', '.join(STATUSES)}"
        )


def _check_loss_mask(batch: pa.RecordBatch) -> None:
    mask = batch.column("loss_mask")
    if mask.null_count == len(mask):
        return
    bad = pc.invert(pc.is_in(mask.values, value_set=pa.array([0, 1], pa.int8())))
    if bad.true_count:
        raise SchemaError("column 'loss_mask' holds a value other than 0 and 1")


def _check_reward(batch: pa.RecordBatch) -> None:
    """Any finite reward: a verifier's lie in [0, 1], but a user's weighted sum of reward
    functions (a weight of 2, the built-in overlong penalty's -1) may lie anywhere."""
    reward = batch.column("reward")
    index = _first(pc.invert(pc.is_finite(reward)))
    if index is not None:
        raise SchemaError(
            f"column 'reward' is {reward[index].as_py()} at {_row(batch, index)}; "
            "expected a finite value (or null before scoring)"
        )


def validate_batch(batch: pa.RecordBatch) -> None:
    """Raise ``SchemaError`` naming the column when ``batch`` breaks the trajectory schema."""
    check_version(batch.schema)
    if not batch.schema.equals(SCHEMA):  # the usual case needs no column-by-column look
        _check_columns(batch.schema)
    _check_nulls(batch)
    _check_lengths(batch)
    _check_status(batch)
    _check_loss_mask(batch)
    _check_reward(batch)


def batch_from_rows(rows: Iterable[Mapping[str, Any]]) -> pa.RecordBatch:
    """A validated batch built from dicts keyed by column name (missing nullable -> null)."""
    batch = pa.RecordBatch.from_pylist([dict(r) for r in rows], schema=SCHEMA)
    validate_batch(batch)
    return batch
