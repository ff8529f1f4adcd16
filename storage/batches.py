"""Arrow trajectory rows -> padded training tensors, without per-token Python work.

The trainer turns the table a store lease delivers into the ``rl.batching.TrainBatch`` its
loss consumes: the same layout as ``rl.batching.collate`` (which builds it from Python
lists), reading the Arrow buffers in place.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sluice.rl.advantages import whiten
from sluice.rl.batching import TrainBatch

# The columns a training step reads; ``loss_mask`` (multi-turn episodes) may be absent, and
# ``reason`` (a failed reward's) is read by ``batch_normalised``.
NEEDED = ("prompt_ids", "response_ids", "behaviour_logprobs", "advantage")
TRAIN_FIELDS = (*NEEDED, "loss_mask", "reason")


def _lists(column: pa.ChunkedArray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(offsets, values)`` of each chunk of a list column: row i of a chunk is
    ``values[offsets[i]:offsets[i + 1]]`` (a slice's offsets point into its parent's values,
    so lease slices need no copy)."""
    return [
        (chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False))
        for chunk in column.chunks
    ]


def _masks(table: pa.Table, size: int) -> list[np.ndarray | None]:
    """Each row's loss mask as a numpy view, or None where every response token counts."""
    if "loss_mask" not in table.column_names or table.column("loss_mask").null_count == size:
        return [None] * size
    out: list[np.ndarray | None] = []
    for chunk in table.column("loss_mask").chunks:
        offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        out.extend(
            values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(chunk))
        )
    return out


def batch_normalised(table: pa.Table) -> pa.Table:
    """``table`` with its ``advantage`` column normalised over the batch's loss tokens
    (REINFORCE++, ``rl.advantages.whiten``): each row weighs by its loss tokens, and a row
    whose reward failed (it has a ``reason``) is left out and keeps advantage 0."""
    size = table.num_rows
    lengths = pc.list_value_length(table.column("response_ids")).to_numpy(zero_copy_only=False)
    tokens = [
        float(length) if mask is None else float(mask.sum())
        for length, mask in zip(lengths, _masks(table, size), strict=True)
    ]
    if "reason" in table.column_names:
        valid = pc.is_null(table.column("reason")).to_numpy(zero_copy_only=False)
    else:
        valid = np.ones(size, dtype=bool)
    i = table.schema.get_field_index("advantage")
    advantages = torch.tensor(table.column(i).to_numpy(zero_copy_only=False), dtype=torch.float64)
    out = whiten(advantages, torch.tensor(tokens), torch.from_numpy(np.asarray(valid)))
    return table.set_column(i, table.schema.field(i), pa.array(out.numpy(), pa.float32()))


def to_train_batch(
    table: pa.Table | pa.RecordBatch, pad_id: int, skip_failed: bool = False
) -> TrainBatch:
    """Right-padded tensors from trajectory rows (needs the ``NEEDED`` columns). The loss
    mask is 1 on response tokens, times the row's ``loss_mask`` when it has one;
    ``skip_failed``: 0 on every token of a row whose reward failed (it has a ``reason``),
    for a loss that would read its reward of 0 as a verdict (a critic's).

    One pass over the rows, each copied with slice assignments (a few microseconds per row;
    fancy indexing over every token was ten times slower for long responses).
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    missing = [name for name in NEEDED if name not in table.column_names]
    if missing:
        raise ValueError(f"trajectory table lacks column(s) {missing} needed for training")
    size = table.num_rows
    if size == 0:
        raise ValueError("cannot build a training batch from zero rows")
    advantage = table.column("advantage")
    if advantage.null_count:
        raise ValueError("trajectory rows without an advantage cannot be trained on")
    rows = []  # (prompt, response, logprobs) per row, as numpy views
    for (po, pv), (ro, rv), (lo, lv) in zip(
        _lists(table.column("prompt_ids")),
        _lists(table.column("response_ids")),
        _lists(table.column("behaviour_logprobs")),
        strict=True,
    ):
        for i in range(len(po) - 1):
            rows.append((pv[po[i] : po[i + 1]], rv[ro[i] : ro[i + 1]], lv[lo[i] : lo[i + 1]]))
    masks = _masks(table, size)
    for (prompt, response, logprobs), loss_mask in zip(rows, masks, strict=True):
        if loss_mask is not None and len(loss_mask) != len(response):
            raise ValueError("loss_mask and response_ids differ in length")
        if len(prompt) == 0:
            raise ValueError("a trajectory row has an empty prompt (it needs at least a BOS token)")
        if len(logprobs) != len(response):
            raise ValueError("behaviour_logprobs and response_ids differ in length")
    width = max(len(p) + len(r) for p, r, _ in rows)
    input_ids = np.full((size, width), pad_id, dtype=np.int64)
    attention = np.zeros((size, width), dtype=np.int64)
    mask = np.zeros((size, width - 1), dtype=np.float32)
    old = np.zeros((size, width - 1), dtype=np.float32)
    for row, (prompt, response, logprobs) in enumerate(rows):
        p, r = len(prompt), len(response)
        input_ids[row, :p] = prompt
        input_ids[row, p : p + r] = response
        attention[row, : p + r] = 1
        # Response token j sits at input position p + j and is predicted from p + j - 1.
        mask[row, p - 1 : p - 1 + r] = 1.0 if masks[row] is None else masks[row]
        old[row, p - 1 : p - 1 + r] = logprobs
    if skip_failed and "reason" in table.column_names:
        failed = pc.is_valid(table.column("reason")).to_numpy(zero_copy_only=False)
        mask[np.asarray(failed, dtype=bool)] = 0.0
    ids = torch.from_numpy(input_ids)
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.from_numpy(attention),
        targets=ids[:, 1:].clone(),
        mask=torch.from_numpy(mask),
        old_logprobs=torch.from_numpy(old),
        advantages=torch.tensor(advantage.to_numpy(zero_copy_only=False), dtype=torch.float32),
    )
