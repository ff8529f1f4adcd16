"""Turn scored samples into the padded tensors a policy-gradient step consumes."""

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


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded tensors; position t of the targets is predicted from input position t.

    input_ids [B, T], targets [B, T-1] (input_ids shifted left), mask [B, T-1] is 1 on
    response tokens, old_logprobs [B, T-1], advantages [B].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def slice(self, start: int, stop: int) -> TrainBatch:
        return TrainBatch(
            *(t[start:stop] for t in (self.input_ids, self.attention_mask, self.targets)),
            *(t[start:stop] for t in (self.mask, self.old_logprobs, self.advantages)),
        )


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
        mask[row, p - 1 : p - 1 + r] = 1.0
        old[row, p - 1 : p - 1 + r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TrainBatch(input_ids, attention, input_ids[:, 1:].clone(), mask, old, advantages)
