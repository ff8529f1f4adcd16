"""Column-built trajectory blocks equal the row-built ones, and bad values are named."""

from datetime import UTC, datetime

import pyarrow as pa
import pytest

from sluice.storage.block_builder import decode_block, encode_block, trajectory_block
from sluice.storage.schema import SchemaError, batch_from_rows, validate_batch
from sluice.storage.trajectory_store import _metas

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def samples(**overrides):
    """Two samples of one group as a rollout worker holds them (lists per sample)."""
    base = {
        "sample_ids": ["g/0", "g/1"],
        "prompt_ids": ["p", "p"],
        "group_ids": ["g", "g"],
        "env": "addition",
        "prompts": [[1, 2, 3], [1, 2, 3]],
        "responses": [[4, 5], [6, 7, 8]],
        "logprobs": [[-0.5, -1.0], [-0.25, -2.0, -0.125]],
        "version_runs": [[(0, 7)], [(0, 7), (1, 8)]],
        "rewards": [1.0, 0.0],
        "advantages": [0.5, -0.5],
        "status": "scored",
        "reasons": [None, "no answer"],
        "generated_at": NOW,
        "scored_at": NOW,
    }
    return {**base, **overrides}


def rows():
    """The same two samples as row dicts, for ``batch_from_rows``."""
    common = {"prompt_id": "p", "group_id": "g", "env": "addition", "prompt_ids": [1, 2, 3]}
    return [
        {
            **common,
            "sample_id": "g/0",
            "response_ids": [4, 5],
            "behaviour_logprobs": [-0.5, -1.0],
            "token_versions": [7, 7],
            "reward": 1.0,
            "advantage": 0.5,
            "prompt_len": 3,
            "response_len": 2,
            "status": "scored",
            "generated_at": NOW,
            "scored_at": NOW,
        },
        {
            **common,
            "sample_id": "g/1",
            "response_ids": [6, 7, 8],
            "behaviour_logprobs": [-0.25, -2.0, -0.125],
            "token_versions": [7, 8, 8],
            "reward": 0.0,
            "advantage": -0.5,
            "prompt_len": 3,
            "response_len": 3,
            "status": "scored",
            "reason": "no answer",
            "generated_at": NOW,
            "scored_at": NOW,
        },
    ]


def test_equals_the_row_built_batch_and_validates():
    block = trajectory_block(**samples())
    validate_batch(block)
    assert block.equals(batch_from_rows(rows()))


def test_loss_masks_are_packed_and_a_row_without_one_is_all_ones():
    block = trajectory_block(**samples(loss_masks=[None, [1, 0, 1]]))
    validate_batch(block)
    assert block.column("loss_mask").to_pylist() == [[1, 1], [1, 0, 1]]
    assert trajectory_block(**samples()).column("loss_mask").null_count == 2
    with pytest.raises(SchemaError, match="loss_mask"):
        trajectory_block(**samples(loss_masks=[None, [1, 0, 300]]))


def test_unscored_samples_have_null_rewards_and_timestamps():
    block = trajectory_block(
        **samples(
            rewards=[None, None],
            advantages=[None, None],
            status="generated",
            reasons=None,
            generated_at=None,
            scored_at=None,
        )
    )
    validate_batch(block)
    assert block.column("reward").null_count == 2
    assert block.column("scored_at").null_count == 2 and block.column("reason").null_count == 2


@pytest.mark.parametrize(
    ("runs", "versions"),
    [
        ([(0, 3)], [3, 3, 3, 3, 3]),
        ([(0, 3), (2, 4)], [3, 3, 4, 4, 4]),
        # two loads between tokens 2 and 3: version 4 covers no token
        ([(0, 3), (2, 4), (2, 5), (4, 6)], [3, 3, 5, 5, 6]),
        ([(0, 3), (5, 4)], [3, 3, 3, 3, 3]),  # a load after the last token
    ],
    ids=["one-run", "two-runs", "empty-run", "run-at-the-end"],
)
def test_version_runs_expand_to_one_version_per_token(runs, versions):
    block = trajectory_block(
        **samples(
            responses=[[4, 5], [1, 2, 3, 4, 5]],
            logprobs=[[-0.5, -1.0], [-0.1] * 5],
            version_runs=[[(0, 1)], runs],
        )
    )
    assert block.column("token_versions").to_pylist() == [[1, 1], versions]


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([(1, 3)], "the first run must start at token 0"),
        ([], "the first run must start at token 0"),
        ([(0, 3), (2, 4), (1, 5)], r"run starts \[0, 2, 1\] must be non-decreasing"),
        ([(0, 3), (4, 4)], "within its 3 tokens"),
    ],
    ids=["late-start", "no-runs", "decreasing", "past-the-end"],
)
def test_bad_version_runs_are_named(runs, message):
    with pytest.raises(SchemaError, match=rf"token_versions of row 1: .*{message}"):
        trajectory_block(**samples(version_runs=[[(0, 7)], runs]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"responses": [[4, 5], [6, 7.5, 8]]}, "column 'response_ids' row 1: a value is not int32"),
        ({"responses": [[4, 2**31], [6, 7, 8]]}, "column 'response_ids' row 0: a value is not"),
        ({"prompts": [[1, 2, 3], [1, None, 3]]}, "column 'prompt_ids' row 1"),
        (
            {"logprobs": [[-0.5, -1.0], [-0.25, "x", -0.1]]},
            "column 'behaviour_logprobs' row 1: a value is not float32",
        ),
        ({"logprobs": [[-0.5, -1e39], [-0.25, -2.0, -0.1]]}, "column 'behaviour_logprobs' row 0"),
    ],
    ids=["float-token", "token-too-large", "null-prompt-token", "text-logprob", "huge-logprob"],
)
def test_values_that_do_not_fit_their_column_are_named(override, message):
    with pytest.raises(SchemaError, match=message):
        trajectory_block(**samples(**override))


def test_sequences_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"2 sample_ids but lengths \{'rewards': 1\}"):
        trajectory_block(**samples(rewards=[1.0]))


def test_a_log_prob_count_that_differs_from_the_tokens_fails_validation():
    block = trajectory_block(**samples(logprobs=[[-0.5], [-0.25, -2.0, -0.125]]))
    with pytest.raises(SchemaError, match="'behaviour_logprobs' has 1 entries but response_len"):
        validate_batch(block)


@pytest.mark.parametrize(("start", "length"), [(0, 2), (1, 1)], ids=["whole", "slice"])
def test_encoded_blocks_read_back_equal_and_in_place(start, length):
    batch = trajectory_block(**samples()).slice(start, length)
    buffer = encode_block(batch)
    back = decode_block(buffer)
    assert back.equals(batch) and back.schema.metadata == batch.schema.metadata
    values = back.column("response_ids").values.buffers()[1]
    assert buffer.address <= values.address < buffer.address + buffer.size  # no copy
    validate_batch(back)


def test_a_buffer_that_is_not_a_block_fails_to_decode():
    with pytest.raises(pa.ArrowInvalid):
        decode_block(pa.py_buffer(b"not an arrow stream"))


def test_the_store_reads_each_rows_first_and_last_token_version():
    """What the staleness rule counts: sample 1 started under version 7 and its last token
    came from version 8 (partial rollout)."""
    metas = _metas(trajectory_block(**samples()))
    assert [(m.version, m.last_version) for m in metas] == [(7, 7), (7, 8)]
