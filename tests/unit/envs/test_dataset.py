"""Prompts from data files (``envs/dataset.py``): JSONL, Parquet and datasets folders on the
local disk, the column mapping, the held-out split, and the training stream's cursor."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.envs import dataset as ds
from sluice.envs.base import split_of
from sluice.envs.dataset import Columns, DataError, DatasetEnv, DataSource
from sluice.envs.prompts import FittingPrompts, PromptsTooLong

ROWS = [{"q": f"{i}+{i}=", "a": str(2 * i), "level": i % 3} for i in range(200)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(params=["jsonl", "parquet", "save_to_disk", "dataset_dict"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> DataSource:
    kind = request.param
    if kind == "jsonl":
        return DataSource(_jsonl(tmp_path / "p.jsonl", ROWS))
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet", row_group_size=64)
        return DataSource(str(tmp_path / "p.parquet"))
    data = datasets.Dataset.from_list(ROWS)
    if kind == "save_to_disk":
        data.save_to_disk(str(tmp_path / "hf"))
        return DataSource(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": data, "test": data.select(range(5))}).save_to_disk(
        str(tmp_path / "hfdd")
    )
    return DataSource(str(tmp_path / "hfdd"), split="train")


def test_every_format_maps_columns_to_problems_and_splits_by_hash(source: DataSource) -> None:
    env = DatasetEnv(source, Columns("q", "a", ("level",)))
    env.check()
    train = env.problems("train", 500, seed=0)
    heldout = env.problems("heldout", 500, seed=0)
    assert len(train) + len(heldout) == len(ROWS)
    assert all(split_of("dataset", p.prompt) == "heldout" for p in heldout)
    first = train[0]
    assert (first.prompt, first.answer, dict(first.fields)) == ("0+0=", "0", {"level": 0})
    assert first.prompt_id == "dataset/train/0" and first.env == "dataset"


def test_a_separate_heldout_file_is_the_heldout_split(tmp_path: Path) -> None:
    main = DataSource(_jsonl(tmp_path / "train.jsonl", ROWS))
    held = DataSource(_jsonl(tmp_path / "held.jsonl", ROWS[:7]))
    env = DatasetEnv(main, Columns("q", "a"), heldout=held)
    assert len(env.problems("train", 1000, 0)) == len(ROWS)
    assert [p.prompt for p in env.problems("heldout", 1000, 0)] == [r["q"] for r in ROWS[:7]]


@pytest.mark.parametrize(
    ("rows", "columns", "message"),
    [
        (ROWS, Columns("question", "a"), "has no column 'question'; its columns are q, a, level"),
        (ROWS, Columns("q", "a", ("hint",)), "has no column 'hint'"),
        ([*ROWS[:3], {"q": "", "a": "0", "level": 0}], Columns("q", "a"), "row 3 has an empty"),
    ],
    ids=["prompt-column", "field-column", "empty-prompt"],
)
def test_bad_data_is_named(tmp_path: Path, rows: list, columns: Columns, message: str) -> None:
    env = DatasetEnv(DataSource(_jsonl(tmp_path / "p.jsonl", rows)), columns)
    with pytest.raises(DataError, match=message):
        env.check()


def test_a_missing_or_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        DataSource(str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot be read as parquet"):
        DataSource(str(tmp_path / "bad.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataError, match="has no 'test'"):
        DataSource(str(tmp_path / "dd"), split="test")


def test_chat_message_prompts_are_rendered_and_need_a_template(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "hi"}], "a": "x"}]
    source = DataSource(_jsonl(tmp_path / "chat.jsonl", rows))
    render = lambda messages: "<u>" + messages[0]["content"] + "</u><a>"  # noqa: E731
    env = DatasetEnv(source, Columns("messages", "a"), render=render)
    (problem,) = env.problems("train", 1, 0) or env.problems("heldout", 1, 0)
    assert problem.prompt == "<u>hi</u><a>"
    bare = DatasetEnv(source, Columns("messages", "a"))
    with pytest.raises(DataError, match="no chat template"):
        bare.problems("train", 1, 0) or bare.problems("heldout", 1, 0)


def test_the_stream_shuffles_windows_covers_each_epoch_and_resumes_from_its_cursor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ds, "WINDOW_ROWS", 16)  # several windows over 200 rows
    env = DatasetEnv(DataSource(_jsonl(tmp_path / "p.jsonl", ROWS)), Columns("q", "a"))
    train_ids = {p.prompt_id for p in env.problems("train", 1000, 0)}
    stream = env.stream(seed=5)
    epoch = stream.take(len(train_ids))
    assert {p.prompt_id for p in epoch} == train_ids  # every row once per epoch
    assert [p.prompt_id for p in epoch[:16]] != sorted(p.prompt_id for p in epoch[:16])
    stream.take(37)
    cursor = stream.cursor()
    assert cursor == {"epoch": 2, "taken": 37}
    ahead = [p.prompt_id for p in stream.take(50)]
    again = env.stream(seed=5)
    again.restore(json.loads(json.dumps(cursor)))
    assert [p.prompt_id for p in again.take(50)] == ahead
    copy = pickle.loads(pickle.dumps(again))  # the dispatcher's copy, in async
    assert copy.cursor() == again.cursor()
    assert [p.prompt_id for p in copy.take(9)] == [p.prompt_id for p in again.take(9)]


class _Skips:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def skipped(self, problem, reason: str) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((problem.prompt_id, reason))


def test_prompts_longer_than_the_limit_are_passed_over_and_recorded(tmp_path: Path) -> None:
    rows = [{"q": f"{i:03d}" + "x" * (0 if i % 4 else 37), "a": "y"} for i in range(64)]
    env = DatasetEnv(DataSource(_jsonl(tmp_path / "p.jsonl", rows)), Columns("q", "a"))
    sink = _Skips()
    fitting = FittingPrompts(env.stream(seed=0), len, 10, sink, "the context leaves 10")
    taken = fitting.take(20)
    assert len(taken) == 20 and all(len(p.prompt) <= 10 for p in taken)
    assert sink.seen and all(
        r == "the prompt is 40 tokens: the context leaves 10" for _, r in sink.seen
    )
    assert fitting.passed_over == len(sink.seen)
    assert fitting.cursor() == fitting.inner.cursor()


def test_a_stream_of_only_too_long_prompts_fails_with_the_count_and_the_longest(
    tmp_path: Path,
) -> None:
    rows = [{"q": "x" * (20 + i), "a": "y"} for i in range(30)]
    env = DatasetEnv(DataSource(_jsonl(tmp_path / "p.jsonl", rows)), Columns("q", "a"))
    fitting = FittingPrompts(env.stream(seed=0), len, 10, _Skips(), "the context leaves 10")
    with pytest.raises(
        PromptsTooLong,
        match=r"every training prompt is too long: \d+ in a row passed over, the longest 4\d",
    ):
        fitting.take(4)
