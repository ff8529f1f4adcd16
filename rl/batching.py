"""Turn scored samples into the tensors a policy-gradient step consumes: right-padded rows
(``collate``, cut by ``micro_batches``), or samples packed end to end into rows (``pack``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sample:
    """One generated completion, as the trainer needs it.

    ``behaviour_logprobs[i]`` is the log-probability the generating policy gave
    ``response_ids[i]``; ``advantage`` is one number for the whole sequence (GRPO).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    loss_mask: list[int] | None = None
    """1 on tokens the policy sampled, 0 on tokens an environment added (None: all 1)."""


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded tensors; position t of the targets is predicted from input position t.

    input_ids [B, T], targets [B, T-1] (input_ids shifted left), mask [B, T-1] is 1 on
    response tokens the policy sampled, old_logprobs [B, T-1], advantages [B].

    A packed batch (``pack``) holds several samples end to end in each row: advantages are
    then per token [B, T-1], and ``position_ids`` [B, T] restart at 0 where each sample
    starts, which is how the model keeps attention inside a sample.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    position_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        """The same batch on ``device`` (tensors already there are not copied)."""
        return TrainBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.targets.to(device),
            self.mask.to(device),
            self.old_logprobs.to(device),
            self.advantages.to(device),
            None if self.position_ids is None else self.position_ids.to(device),
        )

    def rows(self, index: torch.Tensor) -> TrainBatch:
        """The rows ``index``, with columns past their longest sequence cut off."""
        width = int(self.attention_mask[index].sum(dim=1).max())
        return TrainBatch(
            self.input_ids[index, :width],
            self.attention_mask[index, :width],
            self.targets[index, : width - 1],
            self.mask[index, : width - 1],
            self.old_logprobs[index, : width - 1],
            self.advantages[index],
        )


def sequence_ids(batch: TrainBatch) -> torch.Tensor:
    """Which sample each target position belongs to, [B, T-1] long, unique within the batch:
    the row of a padded batch; in a packed row (``pack``) the sample whose positions restart
    at 0 where it starts. Target t is predicted from input position t, so it belongs to the
    sample that holds input position t."""
    rows, width = batch.input_ids.shape
    row = torch.arange(rows, device=batch.input_ids.device).unsqueeze(1)
    if batch.position_ids is None:
        return row.expand(rows, width - 1)
    starts = (batch.position_ids[:, :-1] == 0).long().cumsum(dim=1) - 1
    return row * width + starts


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    """Pad samples to one [B, T] batch with response masks aligned to next-token targets."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    for s in samples:
        if len(s.response_ids) != len(s.behaviour_logprobs):
            raise ValueError(
                f"sample has {len(s.response_ids)} response tokens but "
                f"{len(s.behaviour_logprobs)} behaviour log-probs"
            )
        if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
            raise ValueError(
                f"sample has {len(s.response_ids)} response tokens but a loss mask of "
                f"{len(s.loss_mask)}"
            )
        if not s.prompt_ids:
            raise ValueError("sample has an empty prompt (it needs at least a BOS token)")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width - 1))
    old = torch.zeros((batch, width - 1))
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[row, : p + r] = 1
        # Response token j sits at input position p + j and is predicted from position p + j - 1.
        mask[row, p - 1 : p - 1 + r] = (
            1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        )
        old[row, p - 1 : p - 1 + r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TrainBatch(input_ids, attention, input_ids[:, 1:].clone(), mask, old, advantages)


def micro_batches(batch: TrainBatch, max_rows: int, max_tokens: int) -> list[TrainBatch]:
    """Split a batch for forward/backward passes, padding each part only to its own longest row.

    A batch that fits (``max_rows`` rows and ``max_tokens`` padded tokens) stays whole and in
    order. Otherwise rows are sorted by length and cut into parts within both limits, so a
    few long answers no longer pad every short one to their length (sequence bucketing, as
    in length-grouped samplers). Every row lands in exactly one part.
    """
    lengths = batch.attention_mask.sum(dim=1)
    size, width = len(batch), batch.input_ids.shape[1]
    if size <= max_rows and size * width <= max_tokens:
        return [batch]
    order = torch.argsort(lengths, stable=True)
    parts, start = [], 0
    for end in range(1, size + 1):
        rows, longest = end - start, int(lengths[order[end - 1]])
        last = end == size
        too_many = rows > max_rows or (rows > 1 and rows * longest > max_tokens)
        if too_many:
            parts.append(batch.rows(order[start : end - 1]))
            start = end - 1
        if last:
            parts.append(batch.rows(order[start:end]))
    return parts


def pack(batch: TrainBatch, max_rows: int, max_tokens: int) -> list[TrainBatch]:
    """The batch's samples packed end to end, one row of at most ``max_tokens`` tokens and
    ``max_rows`` samples per part, in place of padding each part to its longest row.

    Samples go longest first into the first row with room (first-fit decreasing); one
    longer than ``max_tokens`` gets a row of its own. In a row, positions restart at 0 with
    each sample, advantages are per token, and the last token of a sample, whose target is
    the next sample's first token, carries mask 0 (it always did: it predicts no response
    token). Every sample lands in exactly one part.
    """
    lengths = batch.attention_mask.sum(dim=1).tolist()
    rows: list[list[int]] = []  # sample indices per packed row
    room: list[int] = []  # tokens left per row
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = (r for r in range(len(rows)) if room[r] >= lengths[i] and len(rows[r]) < max_rows)
        r = next(fits, len(rows))
        if r == len(rows):
            rows.append([])
            room.append(max_tokens)
        rows[r].append(i)
        room[r] -= lengths[i]
    return [_packed_row(batch, members, lengths) for members in rows]


def _packed_row(batch: TrainBatch, members: list[int], lengths: list[int]) -> TrainBatch:
    """One row of the samples ``members``, end to end, as a [1, sum of lengths] batch."""
    ids, positions, mask, old, advantages = [], [], [], [], []
    for i in members:
        n = lengths[i]
        ids.append(batch.input_ids[i, :n])
        positions.append(torch.arange(n))
        # Sample i's n - 1 predictions, then the one across into the next sample (mask 0).
        gap = batch.mask.new_zeros(1)
        mask.append(torch.cat([batch.mask[i, : n - 1], gap]))
        old.append(torch.cat([batch.old_logprobs[i, : n - 1], gap]))
        advantages.append(batch.advantages[i].expand(n))
    row = torch.cat(ids)[None]
    return TrainBatch(
        input_ids=row,
        attention_mask=torch.ones_like(row),
        targets=row[:, 1:],
        mask=torch.cat(mask)[None, :-1],
        old_logprobs=torch.cat(old)[None, :-1],
        advantages=torch.cat(advantages)[None, :-1],
        position_ids=torch.cat(positions)[None],
    )
