import json
import logging
import shutil

import pytest

from sluice.storage.checkpoints import MANIFEST, CheckpointError, CheckpointStore, folder_name


def files_for(step: int) -> dict[str, bytes]:
    return {"model.safetensors": bytes([step]) * (100 + step), "sub/extra.json": b"{}"}


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(f"file://{tmp_path}", keep_last=3)


def folder(tmp_path, step):
    return tmp_path / "checkpoints" / folder_name(step)


def test_save_then_load_latest(store, tmp_path):
    url = store.save(5, files_for(5), {"loss": 0.25, "version": 5})
    assert url == f"file://{folder(tmp_path, 5)}"
    loaded = store.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.meta, loaded.files) == (
        5,
        {"loss": 0.25, "version": 5},
        files_for(5),
    )
    manifest = json.loads((folder(tmp_path, 5) / MANIFEST).read_text())
    assert manifest["step"] == 5
    assert manifest["files"]["model.safetensors"]["size"] == 105
    assert set(manifest["files"]) == set(files_for(5))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [folder_name(5)]


def test_no_checkpoint_loads_as_none(store):
    assert store.load_latest() is None
    assert store.list() == []


def test_only_the_last_n_are_kept_and_stale_temps_are_removed(store, tmp_path):
    stale = tmp_path / "checkpoints" / "step-00000001.tmp-0badc0de"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    for step in range(1, 6):
        store.save(step, files_for(step), {})
    assert store.list() == [3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        folder_name(3),
        folder_name(4),
        folder_name(5),
    ]


def test_a_corrupt_newest_falls_back_to_the_previous_with_a_warning(store, tmp_path, caplog):
    store.save(1, files_for(1), {"n": 1})
    store.save(2, files_for(2), {"n": 2})
    victim = folder(tmp_path, 2) / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        loaded = store.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.meta) == (1, {"n": 1})
    assert folder_name(2) in caplog.text
    assert "sha256" in caplog.text


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "sub" / "extra.json").unlink(), "missing"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "model.safetensors").write_bytes(b"short"), "bytes"),
    ],
)
def test_every_kind_of_damage_is_named(store, tmp_path, caplog, damage, reason):
    store.save(1, files_for(1), {})
    store.save(2, files_for(2), {})
    damage(folder(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        loaded = store.load_latest()
    assert loaded is not None
    assert loaded.step == 1
    assert reason in caplog.text


def test_nothing_valid_loads_as_none(store, tmp_path, caplog):
    store.save(1, files_for(1), {})
    (folder(tmp_path, 1) / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        assert store.load_latest() is None


def test_saving_a_step_again_replaces_it(store):
    store.save(4, files_for(4), {"try": 1})
    store.save(4, {"other.bin": b"x"}, {"try": 2})
    loaded = store.load_latest()
    assert loaded is not None
    assert (loaded.meta, loaded.files) == ({"try": 2}, {"other.bin": b"x"})


@pytest.mark.parametrize("name", ["", "../up", "a//b", MANIFEST, "./x"])
def test_bad_file_names_are_refused(store, name):
    with pytest.raises(ValueError, match="invalid checkpoint file name"):
        store.save(1, {name: b"x"}, {})


def test_meta_must_be_json(store):
    with pytest.raises(ValueError, match="plain JSON"):
        store.save(1, {}, {"bad": object()})


def _corrupt_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_pruning_keeps_the_newest_checkpoints_that_verify(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}", keep_last=2)
    for step in (1, 2, 3):
        store.save(step, files_for(step), {})
    _corrupt_one_byte(folder(tmp_path, 3) / "model.safetensors")
    store.save(4, files_for(4), {})
    # 3 is corrupt, so 2 is kept as the second good one; 1 goes.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        folder_name(2),
        folder_name(3),
        folder_name(4),
    ]
    _corrupt_one_byte(folder(tmp_path, 4) / "model.safetensors")
    assert store.load_latest().step == 2  # the newest that verifies


@pytest.mark.parametrize("left", ["old", "tmp", "both"])
def test_a_save_that_died_between_its_renames_loses_neither_copy(store, tmp_path, left):
    store.save(7, files_for(7), {"copy": "first"})
    final = folder(tmp_path, 7)
    old = final.with_name(f"{final.name}.old-0a1b2c3d")
    final.rename(old)  # the first rename happened, the second did not
    if left == "old":
        expected = "first"
    else:
        newer = CheckpointStore(f"file://{tmp_path / 'elsewhere'}")
        newer.save(7, files_for(7), {"copy": "second"})
        tmp = final.with_name(f"{final.name}.tmp-0d1e2f3a")
        folder(tmp_path / "elsewhere", 7).rename(tmp)
        expected = "second"
        if left == "tmp":
            shutil.rmtree(old)
    assert store.list() == [7]
    loaded = store.load_latest()
    assert loaded is not None and loaded.meta["copy"] == expected
    store.save(8, files_for(8), {})  # a later save's pruning removes the other copy
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        folder_name(7),
        folder_name(8),
    ]


def test_a_checkpoint_whose_meta_the_loader_refuses_is_skipped(store, tmp_path, caplog):
    store.save(1, files_for(1), {"ok": True})
    store.save(2, files_for(2), {"ok": False})

    def check(found) -> None:
        if not found.meta["ok"]:
            raise CheckpointError("its meta is not ok")

    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        assert store.load_latest(check).step == 1
    assert "its meta is not ok" in caplog.text
