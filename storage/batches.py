"""Arrow trajectory rows <-> padded training tensors, in one vectorised step.

The trainer turns the table a store lease delivers into the ``rl.batching.TrainBatch`` its
loss consumes; the same layout as ``rl.batching.collate`` (which builds it from Python
lists), without a Python loop over rows.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rl.batching import TrainBatch

# The columns a training step reads.
TRAIN_FIELDS = ("prompt_ids", "response_ids", "behaviour_logprobs", "advantage")


def _flat(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The values of a list column and each value's row index (slices and chunks handled)."""
    column = table.column(name).combine_chunks()
    return (
        column.flatten().to_numpy(zero_copy_only=False),
        pc.list_parent_indices(column).to_numpy(zero_copy_only=False),
    )


def _offsets_within_rows(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """For flattened list values, each value's position inside its own row's list."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.arange(len(rows)) - starts[rows]


def to_train_batch(table: pa.Table | pa.RecordBatch, pad_id: int) -> TrainBatch:
    """Right-padded tensors from trajectory rows (needs the ``TRAIN_FIELDS`` columns)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    missing = [name for name in TRAIN_FIELDS if name not in table.column_names]
    if missing:
        raise ValueError(f"trajectory table lacks column(s) {missing} needed for training")
    size = table.num_rows
    if size == 0:
        raise ValueError("cannot build a training batch from zero rows")
    advantage = table.column("advantage")
    if advantage.null_count:
        raise ValueError("trajectory rows without an advantage cannot be trained on")
    prompt, prompt_rows = _flat(table, "prompt_ids")
    response, response_rows = _flat(table, "response_ids")
    logprobs, _ = _flat(table, "behaviour_logprobs")
    prompt_len = np.bincount(prompt_rows, minlength=size)
    response_len = np.bincount(response_rows, minlength=size)
    if (prompt_len == 0).any():
        raise ValueError("a trajectory row has an empty prompt (it needs at least a BOS token)")
    if len(logprobs) != len(response):
        raise ValueError("behaviour_logprobs and response_ids differ in length")
    width = int((prompt_len + response_len).max())
    input_ids = np.full((size, width), pad_id, dtype=np.int64)
    attention = np.zeros((size, width), dtype=np.int64)
    mask = np.zeros((size, width - 1), dtype=np.float32)
    old = np.zeros((size, width - 1), dtype=np.float32)
    prompt_cols = _offsets_within_rows(prompt_rows, prompt_len)
    input_ids[prompt_rows, prompt_cols] = prompt
    attention[prompt_rows, prompt_cols] = 1
    # Response token j of a row sits at input position p + j and is predicted from p + j - 1.
    response_cols = prompt_len[response_rows] + _offsets_within_rows(response_rows, response_len)
    input_ids[response_rows, response_cols] = response
    attention[response_rows, response_cols] = 1
    mask[response_rows, response_cols - 1] = 1.0
    old[response_rows, response_cols - 1] = logprobs
    ids = torch.from_numpy(input_ids)
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.from_numpy(attention),
        targets=ids[:, 1:].clone(),
        mask=torch.from_numpy(mask),
        old_logprobs=torch.from_numpy(old),
        advantages=torch.tensor(advantage.to_numpy(zero_copy_only=False), dtype=torch.float32),
    )
