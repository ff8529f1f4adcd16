"""Arrow rows -> padded tensors must match the list-based collate exactly."""

import pyarrow as pa
import pytest
import torch

from sluice.rl.batching import Sample, collate
from sluice.storage.batches import batch_normalised, to_train_batch

SAMPLES = [
    Sample([1, 5, 6], [7, 8], [-0.5, -0.25], 1.5),
    Sample([1], [9, 10, 11, 2], [-1.0, -2.0, -3.0, -0.1], -0.5),
    Sample([1, 4, 4, 4, 4], [3], [-0.75], 0.0),
]


def table_of(samples: list[Sample]) -> pa.Table:
    masks = [s.loss_mask for s in samples]
    return pa.table(
        {
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            "prompt_ids": pa.array([s.prompt_ids for s in samples], pa.list_(pa.int32())),
            "response_ids": pa.array([s.response_ids for s in samples], pa.list_(pa.int32())),
            "behaviour_logprobs": pa.array(
                [s.behaviour_logprobs for s in samples], pa.list_(pa.float32())
            ),
            "advantage": pa.array([s.advantage for s in samples], pa.float32()),
        }
    )


def assert_same(got, want) -> None:
    for name in ("input_ids", "attention_mask", "targets", "mask", "old_logprobs", "advantages"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)


@pytest.mark.parametrize("pad_id", [0, 3])
def test_matches_collate(pad_id):
    assert_same(to_train_batch(table_of(SAMPLES), pad_id), collate(SAMPLES, pad_id))


def test_a_loss_mask_keeps_environment_tokens_out_of_the_loss():
    """A multi-turn row: tokens 1 and 2 of its response came from the environment."""
    turns = Sample([1, 5], [7, 3, 4, 8], [-0.5, 0.0, 0.0, -0.25], 1.0, loss_mask=[1, 0, 0, 1])
    batch = to_train_batch(table_of([turns, SAMPLES[0]]), 0)
    assert_same(batch, collate([turns, SAMPLES[0]], 0))
    assert batch.mask[0].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert batch.mask[1].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert batch.targets[0][batch.mask[0].bool()].tolist() == [7, 8]


def test_slices_and_chunks_match_collate():
    """What a lease delivers: slices of several stored blocks, as one chunked table."""
    both = table_of(SAMPLES + SAMPLES[:1]).to_batches()[0]
    chunked = pa.Table.from_batches([both.slice(1, 2), both.slice(3, 1)])
    assert chunked.column("prompt_ids").num_chunks == 2
    want = collate([SAMPLES[1], SAMPLES[2], SAMPLES[0]], 0)
    assert_same(to_train_batch(chunked, 0), want)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (table_of(SAMPLES).drop_columns(["advantage"]), "lacks column"),
        (table_of(SAMPLES).slice(0, 0), "zero rows"),
        (table_of([Sample([], [7], [-1.0], 1.0)]), "empty prompt"),
        (table_of([Sample([1], [7, 8], [-1.0], 1.0)]), "differ in length"),
    ],
    ids=["no-advantage", "empty", "empty-prompt", "ragged-logprobs"],
)
def test_bad_tables_are_named(table, match):
    with pytest.raises(ValueError, match=match):
        to_train_batch(table, 0)


def test_batch_normalised_weighs_rows_by_loss_tokens_and_leaves_failed_ones_at_zero():
    # advantages 1.5 (2 tokens), -1 (4 tokens, 2 of them the environment's), 3 (failed):
    # mean (2 x 1.5 - 2) / 4 = 0.25, variance (2 x 1.25^2 + 2 x 1.25^2) / 4 = 1.25^2:
    # advantages 1 and -1, the failed row 0
    rows = [
        SAMPLES[0],
        Sample([1], [9, 10, 11, 2], [-1.0] * 4, -1.0, loss_mask=[1, 0, 0, 1]),
        Sample([1], [3], [-0.75], 3.0),
    ]
    table = table_of(rows).append_column("reason", pa.array([None, None, "reward timed out"]))
    out = batch_normalised(table).column("advantage").to_pylist()
    assert out == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert batch_normalised(table).column("prompt_ids") == table.column("prompt_ids")


def test_skip_failed_takes_a_failed_rows_tokens_out_of_the_loss():
    table = table_of(SAMPLES[:2]).append_column("reason", pa.array([None, "reward raised"]))
    kept = to_train_batch(table, 0, skip_failed=True)
    assert kept.mask[0].sum() == 2 and kept.mask[1].sum() == 0
    assert to_train_batch(table, 0).mask[1].sum() == 4  # by default every row trains
