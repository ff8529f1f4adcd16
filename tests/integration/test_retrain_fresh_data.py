"""Scheduled retraining on a data set trains on fresh rows only (``flows/retrain.py``): the
rows no earlier run of the job recorded as trained in its ledger, which includes a file
that appeared in the data's folder since. With no fresh row the retrain does nothing, and
says so. Real ledgers, a real Prefect flow and MLflow registry; no training run."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sluice.config.tree import RunConfig, build_config
from sluice.driver.environment import dataset_environment
from sluice.flows.retrain import earlier_runs, fresh_rows, retrain, retrain_config
from sluice.storage.ledger import Ledger, LedgerEvent

pytestmark = pytest.mark.integration


def _file(folder: Path, name: str, start: int, rows: int) -> None:
    lines = [
        json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)})
        for i in range(start, start + rows)
    ]
    (folder / name).write_text("\n".join(lines) + "\n")


def _trained(cfg: RunConfig, run: str, prompt_ids: list[str]) -> None:
    """A run folder whose ledger records ``prompt_ids`` as trained (what a run leaves)."""
    (cfg.run_dir.parent / run).mkdir(parents=True, exist_ok=True)
    ledger = Ledger(cfg.model_copy(update={"name": run}).storage_url)
    ledger.append([LedgerEvent(f"{p}@g0/0", p, "trained", version=1) for p in prompt_ids])
    ledger.flush()


def test_retrain_trains_on_rows_no_earlier_run_trained_on(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _file(data, "part-0.jsonl", 0, 50)
    cfg = build_config(
        {
            "name": "job",
            "root": str(tmp_path / "runs"),
            "env": {"name": "dataset", "data": {"path": str(data)}},
            "reward": "sluice.envs.verifiers:exact_match",
        }
    )
    env = dataset_environment(cfg.env.data, None)  # type: ignore[arg-type]
    first = [p.prompt_id for p in env.problems("train", 1000, 0)]
    assert first[0].startswith("dataset/train/part-0.jsonl/")  # ids name the file

    _trained(cfg, "job", first[:30])
    _trained(cfg, "job-20261101-020000", first[30:])
    (cfg.run_dir.parent / "other").mkdir()  # another job's run is not this job's
    trained_in = earlier_runs(cfg)
    assert [u.rsplit("/", 1)[1] for u in trained_in] == ["job", "job-20261101-020000"]
    assert fresh_rows(cfg, trained_in) == 0

    outcome = retrain.fn(cfg.model_dump())
    assert outcome["new_rows"] == 0 and not outcome["promoted"]
    assert "no new rows" in outcome["reason"]

    _file(data, "part-1.jsonl", 50, 20)  # new data arrives in the folder
    assert (
        fresh_rows(cfg, trained_in)
        == len(
            [
                p
                for p in dataset_environment(cfg.env.data, None).problems("train", 1000, 0)  # type: ignore[arg-type]
                if "part-1.jsonl" in p.prompt_id
            ]
        )
        > 0
    )
    run = retrain_config(cfg, None, datetime(2026, 11, 24, tzinfo=UTC), trained_in)
    pool = dataset_environment(run.env.data, None).problems("train", 1000, 0)  # type: ignore[arg-type]
    assert pool and all("part-1.jsonl" in p.prompt_id for p in pool)
