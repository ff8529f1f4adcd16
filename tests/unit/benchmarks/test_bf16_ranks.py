"""The bf16 bench's arithmetic: an update's gap as a fraction of the reference update's
norm (the launches themselves: `make bench-bf16-ranks`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bf16_ranks import update_gap


def test_the_update_gap_is_the_difference_over_the_reference_updates_norm():
    start = {"a": torch.zeros(2), "b": torch.zeros(1)}
    want = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # moved by 5
    got = {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([4.0]).bfloat16()}  # 1 away
    assert update_gap(want, want, start) == 0.0
    assert update_gap(got, want, start) == pytest.approx(0.2)
