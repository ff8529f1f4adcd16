"""A data set at an s3:// URL (``env.data.path``), read through the run's storage code from a
real S3 server on 127.0.0.1: JSONL, Parquet and a datasets save_to_disk folder, scanned in
batches; the training stream survives a copy (the dispatcher's) and a resume."""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.config.tree import DataConfig
from sluice.driver.environment import dataset_environment
from sluice.storage.urls import open_url
from tests.integration.storage.conftest import S3Server

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "tag": f"t{i % 4}"} for i in range(120)]


def _upload(tmp_path: Path, server: S3Server, kind: str) -> str:
    url = f"s3://{server.bucket}/data-{uuid.uuid4().hex[:8]}"
    fs, root = open_url(url)
    if kind == "jsonl":
        local = tmp_path / "d.jsonl"
        local.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        fs.put(str(local), f"{root}/d.jsonl")
        return f"{url}/d.jsonl"
    if kind == "parquet":
        local = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), local, row_group_size=32)
        fs.put(str(local), f"{root}/d.parquet")
        return f"{url}/d.parquet"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    fs.put(str(tmp_path / "hf"), f"{root}/hf", recursive=True)
    return f"{url}/hf"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk"])
def test_a_dataset_on_s3_reads_checks_and_streams(
    tmp_path: Path, s3_env: S3Server, kind: str
) -> None:
    path = _upload(tmp_path, s3_env, kind)
    env = dataset_environment(DataConfig(path=path, fields=["tag"]), None)
    env.check()
    train = env.problems("train", 1000, 0)
    heldout = env.problems("heldout", 1000, 0)
    assert len(train) + len(heldout) == len(ROWS) and heldout
    row = int(train[0].prompt_id.rsplit("/", 1)[1])  # dataset/train/<row number>
    assert (train[0].prompt, dict(train[0].fields)) == (
        ROWS[row]["prompt"],
        {"tag": ROWS[row]["tag"]},
    )

    stream = env.stream(seed=1)
    stream.take(25)
    copy = pickle.loads(pickle.dumps(stream))  # the dispatcher's copy reopens the S3 data
    assert [p.prompt_id for p in copy.take(40)] == [p.prompt_id for p in stream.take(40)]
    again = env.stream(seed=1)
    again.restore(stream.cursor())
    assert [p.prompt_id for p in again.take(10)] == [p.prompt_id for p in stream.take(10)]
