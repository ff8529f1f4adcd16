import pytest
import torch

from rl.batching import Sample, collate


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


def test_batch_slice():
    samples = [Sample([1], [i], [-1.0], float(i)) for i in range(5)]
    part = collate(samples, pad_id=0).slice(1, 3)
    assert len(part) == 2
    assert part.advantages.tolist() == [1.0, 2.0]
