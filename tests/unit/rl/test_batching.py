import itertools

import pytest
import torch

from sluice.rl.batching import Sample, collate, micro_batches, pack


def test_collate_aligns_response_mask_with_targets():
    samples = [
        Sample(
            prompt_ids=[1, 10, 11],
            response_ids=[20, 2],
            behaviour_logprobs=[-0.5, -0.1],
            advantage=1.0,
        ),
        Sample(prompt_ids=[1, 12], response_ids=[21], behaviour_logprobs=[-0.7], advantage=-1.0),
    ]
    batch = collate(samples, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 10, 11, 20, 2], [1, 12, 21, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # the mask marks positions whose target is a response token
    assert batch.mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert (batch.targets[batch.mask.bool()]).tolist() == [20, 2, 21]
    assert batch.old_logprobs[batch.mask.bool()].tolist() == pytest.approx([-0.5, -0.1, -0.7])
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "empty list"),
        ([Sample([1], [5, 6], [-1.0], 0.0)], "2 response tokens but 1"),
        ([Sample([], [5], [-1.0], 0.0)], "empty prompt"),
    ],
    ids=["no-samples", "logprob-count", "empty-prompt"],
)
def test_collate_rejects_bad_samples(samples, match):
    with pytest.raises(ValueError, match=match):
        collate(samples, pad_id=0)


def _ragged_batch():
    samples = [Sample([1, 2], [3] * n, [-0.5] * n, float(n)) for n in (1, 9, 2, 8, 3, 7)]
    return samples, collate(samples, pad_id=0)


@pytest.mark.parametrize(
    ("max_rows", "max_tokens", "parts"),
    [(64, 10_000, 1), (2, 10_000, 3), (64, 24, 3)],
    ids=["fits-whole", "row-limit", "token-limit"],
)
def test_micro_batches_cover_every_row_once_and_pad_less(max_rows, max_tokens, parts):
    samples, batch = _ragged_batch()
    split = micro_batches(batch, max_rows, max_tokens)
    assert len(split) == parts
    assert sorted(float(a) for p in split for a in p.advantages) == sorted(
        s.advantage for s in samples
    )
    for part in split:
        assert len(part) <= max_rows
        assert part.mask.sum() == sum(float(a) for a in part.advantages)  # advantage = tokens
        # no column is pure padding
        assert part.attention_mask[:, -1].any()
    padded = sum(p.input_ids.numel() for p in split)
    assert padded <= batch.input_ids.numel()


@pytest.mark.parametrize(
    ("max_rows", "max_tokens", "rows"),
    [(64, 10_000, 1), (2, 10_000, 3), (64, 24, 2), (64, 8, 5)],
    ids=["fits-one-row", "row-limit", "token-limit", "each-alone"],
)
def test_pack_lays_every_sample_end_to_end_once(max_rows, max_tokens, rows):
    samples, batch = _ragged_batch()
    packed = pack(batch, max_rows, max_tokens)
    assert len(packed) == rows
    seen = []
    for row in packed:
        assert row.input_ids.shape[0] == 1 and row.position_ids.shape == row.input_ids.shape
        starts = (row.position_ids[0] == 0).nonzero().flatten().tolist()
        bounds = [*starts, row.input_ids.shape[1]]
        assert len(starts) <= max_rows
        assert row.input_ids.shape[1] <= max_tokens or len(starts) == 1
        for start, end in itertools.pairwise(bounds):
            n_response = end - start - 2  # every prompt here is [1, 2]
            assert row.input_ids[0, start:end].tolist() == [1, 2] + [3] * n_response
            assert row.position_ids[0, start:end].tolist() == list(range(end - start))
            # targets inside the sample: its response tokens, none across into the next one
            assert row.mask[0, start : end - 1].tolist() == [0.0] + [1.0] * n_response
            assert row.advantages[0, start : end - 1].tolist() == [float(n_response)] * (
                end - start - 1
            )
            seen.append(n_response)
        assert row.mask.shape == row.targets.shape == row.old_logprobs.shape
        assert int(row.mask.sum()) == sum(seen[-len(starts) :])
    assert sorted(seen) == sorted(len(s.response_ids) for s in samples)
