"""A fresh run refuses a storage location another run has written to; a resume needs a
valid checkpoint (``tasks/job.py: check_start``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config.tree import ConfigError, build_config
from sluice.driver.session import check_meta
from sluice.storage.checkpoints import Checkpoint, CheckpointError, CheckpointStore
from sluice.tasks.job import JobError, check_start


def _cfg(root: Path):
    return build_config({"name": "r1", "root": str(root)})


def test_a_fresh_run_on_an_unused_location_starts_from_nothing(tmp_path: Path) -> None:
    (tmp_path / "r1" / "ledger").mkdir(parents=True)  # an empty folder is no run's state
    assert check_start(_cfg(tmp_path), resume=False) is None


@pytest.mark.parametrize(
    "left",
    [
        pytest.param("ledger/000000000001-ab.parquet", id="a-ledger"),
        pytest.param("trajectories/x.parquet", id="trajectories"),
        pytest.param("checkpoints/step-00000010.tmp-1/model.safetensors", id="broken-checkpoint"),
    ],
)
def test_a_fresh_run_refuses_a_location_that_holds_another_runs_state(
    tmp_path: Path, left: str
) -> None:
    file = tmp_path / "r1" / left
    file.parent.mkdir(parents=True)
    file.write_bytes(b"not ours")
    with pytest.raises(JobError, match=r"already has .*sluice resume r1.*--set name="):
        check_start(_cfg(tmp_path), resume=False)
    assert file.read_bytes() == b"not ours"  # nothing touched


def test_a_resume_needs_a_valid_checkpoint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(JobError, match="no valid checkpoint"):
        check_start(cfg, resume=True)
    store = CheckpointStore(cfg.storage_url, keep_last=3)
    store.save(4, {"model.safetensors": b"x"}, _meta(4))
    store.save(6, {"model.safetensors": b"y"}, {**_meta(6), "data_cursor": None})
    found = check_start(cfg, resume=True)  # step 6's meta lacks its data cursor
    assert found is not None and found.step == 4


def _meta(step: int) -> dict:
    return {
        "step": step,
        "version": step,
        "ledger_watermark": 3,
        "data_cursor": {"prompts": {}},
        "scheduler": {},
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"version": 5}, "not 4"),
        ({"ledger_watermark": -1}, "non-negative integer 'ledger_watermark'"),
        ({"step": True}, "non-negative integer 'step'"),
        ({"data_cursor": []}, "no data cursor"),
        ({"scheduler": None}, "no learning-rate schedule state"),
    ],
    ids=["version", "watermark", "bool-step", "cursor", "scheduler"],
)
def test_checkpoint_meta_is_validated_on_load(change: dict, why: str) -> None:
    found = Checkpoint(4, {**_meta(4), **change}, {"model.safetensors": b"x"})
    with pytest.raises(CheckpointError, match=why):
        check_meta(found)
    check_meta(Checkpoint(4, _meta(4), {"model.safetensors": b"x"}))


LORA_META = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    ("files", "meta", "lora", "why"),
    [
        (
            {"adapter_model.safetensors": b"a"},
            {"lora": LORA_META},
            None,
            "holds a LoRA adapter .* resume it with train.lora set",
        ),
        (
            {"model.safetensors": b"w"},
            {"lora": None},
            {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
            "holds full weights .* resume it without train.lora",
        ),
        (
            {"adapter_model.safetensors": b"a"},
            {"lora": LORA_META},
            {"rank": 16, "target_modules": ["q_proj", "v_proj"]},
            "adapter of .*'rank': 8.* train.lora asks for .*'rank': 16",
        ),
    ],
    ids=["lora-checkpoint-full-run", "full-checkpoint-lora-run", "other-rank"],
)
def test_a_resume_refuses_a_checkpoint_of_the_other_kind(
    tmp_path: Path, files: dict, meta: dict, lora: dict | None, why: str
) -> None:
    """Before any pool starts, with the fix named: the checkpoint stays as it is."""
    cfg = build_config({"name": "r1", "root": str(tmp_path), "train": {"lora": lora}})
    CheckpointStore(cfg.storage_url, keep_last=3).save(4, files, {**_meta(4), **meta})
    with pytest.raises(ConfigError, match=why):
        check_start(cfg, resume=True)
    same = build_config({"name": "r1", "root": str(tmp_path), "train": {"lora": meta["lora"]}})
    found = check_start(same, resume=True)
    assert found is not None and set(found.files) == set(files)


def test_a_run_whose_pools_cannot_fit_this_machine_is_refused(tmp_path: Path) -> None:
    """What a deployment's run meets (the CLI refuses it sooner, in ``check_run``)."""
    cfg = build_config({"name": "r1", "root": str(tmp_path), "rollout": {"workers": 1000}})
    with pytest.raises(JobError, match="does not fit this machine's Ray cluster"):
        check_start(cfg, resume=False)
    assert check_start(_cfg(tmp_path), resume=False) is None  # one worker fits
