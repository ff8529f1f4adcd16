"""The ledger and checkpoint contracts, run against the local disk and a real S3 server."""

import json
import logging
from datetime import UTC, datetime, timedelta

import pytest
import torch
from fsspec import AbstractFileSystem

from sluice.storage.checkpoints import MANIFEST, CheckpointStore, folder_name
from sluice.storage.ledger import (
    Ledger,
    LedgerError,
    LedgerEvent,
    check_exactly_once,
    latest_events,
)
from sluice.storage.torch_state import (
    bytes_to_tensors,
    load_optimizer,
    optimizer_to_files,
    tensors_to_bytes,
)
from sluice.storage.urls import ALLOWED_FORMS, open_url

pytestmark = pytest.mark.integration

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def ev(sample, prompt, event, t, **kw):
    return LedgerEvent(sample, prompt, event, ts=T0 + timedelta(seconds=t), **kw)


# Final states: a trained (staleness 2), b dropped, c scored, d generated, e dropped.
BATCHES = [
    [
        ev("a", "p1", "generated", 0),
        ev("b", "p1", "generated", 0),
        ev("c", "p2", "generated", 1),
        ev("a", "p1", "scored", 2),
    ],
    [
        ev("b", "p1", "dropped", 3, reason="stale"),
        ev("c", "p2", "scored", 3),
        ev("d", "p2", "generated", 4),
        ev("e", "p2", "generated", 4),
        ev("e", "p2", "dropped", 5, reason="the run ended"),
    ],
    [ev("a", "p1", "trained", 6, version=4, staleness=2)],
]


def path_in(url: str, *parts: str) -> tuple[AbstractFileSystem, str]:
    fs, root = open_url(url)
    return fs, "/".join([root, *parts])


def filled_ledger(url: str) -> Ledger:
    ledger = Ledger(url)
    for batch in BATCHES:
        ledger.append(batch)
        assert ledger.flush() == len(batch)
    return ledger


def test_ledger_contract(store_url):
    ledger = filled_ledger(store_url)
    assert ledger.watermark() == 3
    assert latest_events(ledger.read()) == {
        "a": "trained",
        "b": "dropped",
        "c": "scored",
        "d": "generated",
        "e": "dropped",
    }
    assert [(e["sample_id"], e["event"]) for e in ledger.where("p1")] == [
        ("a", "generated"),
        ("b", "generated"),
        ("a", "scored"),
        ("b", "dropped"),
        ("a", "trained"),
    ]
    assert ledger.summary() == {
        "events": 10,
        "samples": 5,
        "final": {"dropped": 2, "generated": 1, "scored": 1, "trained": 1},
        "staleness": {2: 1},
    }
    assert check_exactly_once(ledger.read()) == []


def test_ledger_survives_a_restart_and_keeps_counting(store_url):
    filled_ledger(store_url)
    again = Ledger(store_url)
    assert again.read().num_rows == 10
    again.append([ev("a", "p1", "trained", 9, version=5, staleness=0)])
    assert again.flush() == 1
    assert again.watermark() == 4
    assert check_exactly_once(again.read()) == ["sample a was trained 2 times"]


def test_roll_back_sets_aside_what_came_after_a_checkpoint(store_url):
    """A resume from a checkpoint taken at watermark 2: the third file's events are void."""
    ledger = filled_ledger(store_url)
    attempt, where, moved = ledger.roll_back(watermark=2, step=4)
    assert (attempt, moved) == (1, 1)
    assert where.endswith("ledger-rolled-back/0001")
    # a's training is undone with the weights
    assert latest_events(ledger.read())["a"] == "scored"
    fs, folder = path_in(store_url, "ledger-rolled-back", "0001")
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(folder, detail=False))
    assert names[0] == "000000000003" + names[0][12:] and names[-1] == "RESUMED.json"
    record = json.loads(fs.cat_file(f"{folder}/RESUMED.json"))
    assert record["resumed_from_step"] == 4 and record["watermark"] == 2
    # the resumed run trains `a` again: once, as far as the ledger is concerned
    ledger.append([ev("a", "p1", "trained", 9, version=3, staleness=1)])
    ledger.flush()
    assert ledger.watermark() == 3
    assert check_exactly_once(Ledger(store_url).read()) == []
    # a second resume gets the next number, even when nothing is moved
    assert Ledger(store_url).roll_back(watermark=3, step=5)[::2] == (2, 0)


def test_ledger_ignores_temp_files_and_names_a_corrupt_file(store_url):
    ledger = filled_ledger(store_url)
    fs, tmp = path_in(store_url, "ledger", "000000000007-0a0b0c0d.parquet.tmp-12345678")
    fs.pipe_file(tmp, b"partial")
    assert ledger.read().num_rows == 10
    assert ledger.watermark() == 3
    fs, bad = path_in(store_url, "ledger", "000000000008-deadbeef.parquet")
    fs.pipe_file(bad, b"PAR1 definitely not parquet")
    with pytest.raises(LedgerError, match=r"000000000008-deadbeef\.parquet"):
        ledger.read()


def files_for(step):
    return {"weights.bin": bytes([step % 256]) * 1000, "nested/state.json": b'{"s": %d}' % step}


def test_checkpoint_save_load_and_prune(store_url):
    store = CheckpointStore(store_url, keep_last=2)
    for step in (10, 20, 30):
        url = store.save(step, files_for(step), {"step": step})
        assert url.endswith(folder_name(step))
    assert store.list() == [20, 30]
    loaded = store.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.meta, loaded.files) == (30, {"step": 30}, files_for(30))


def test_checkpoint_falls_back_past_a_corrupt_newest(store_url, caplog):
    store = CheckpointStore(store_url)
    store.save(1, files_for(1), {})
    store.save(2, files_for(2), {})
    fs, victim = path_in(store_url, "checkpoints", folder_name(2), "weights.bin")
    data = bytearray(fs.cat_file(victim))
    data[500] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        loaded = store.load_latest()
    assert loaded is not None
    assert loaded.step == 1
    assert folder_name(2) in caplog.text
    assert "sha256" in caplog.text


def test_checkpoint_without_manifest_is_not_valid(store_url, caplog):
    store = CheckpointStore(store_url)
    store.save(1, files_for(1), {})
    store.save(2, files_for(2), {})
    fs, manifest = path_in(store_url, "checkpoints", folder_name(2), MANIFEST)
    fs.rm(manifest)
    assert store.list() == [1]
    with caplog.at_level(logging.WARNING, logger="sluice.storage.checkpoints"):
        loaded = store.load_latest()
    assert loaded is not None
    assert loaded.step == 1
    assert "no manifest" in caplog.text


def test_checkpoint_resaving_a_step_replaces_it(store_url):
    store = CheckpointStore(store_url)
    store.save(3, files_for(3), {"try": 1})
    store.save(3, {"only.bin": b"x"}, {"try": 2})
    loaded = store.load_latest()
    assert loaded is not None
    assert (loaded.meta, loaded.files) == ({"try": 2}, {"only.bin": b"x"})


def test_model_and_optimizer_round_trip_through_the_store(store_url):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    files = {"model.safetensors": tensors_to_bytes(model.state_dict())}
    CheckpointStore(store_url).save(1, files | optimizer_to_files(optimizer), {})

    loaded = CheckpointStore(store_url).load_latest()
    assert loaded is not None
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(bytes_to_tensors(loaded.files["model.safetensors"]))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_optimizer(fresh_optimizer, loaded.files)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    for before, after in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(before, after)
        state, restored = optimizer.state[before], fresh_optimizer.state[after]
        assert torch.equal(state["exp_avg_sq"], restored["exp_avg_sq"])


@pytest.mark.parametrize("url", ["s3://", "s3://ab/x", "ftp://host/x", "file://host/x"])
def test_a_bad_url_gives_a_clear_error(url):
    for opener in (Ledger, CheckpointStore, open_url):
        with pytest.raises(ValueError, match="bad storage URL") as info:
            opener(url)
        assert ALLOWED_FORMS in str(info.value)


def test_wrong_credentials_are_refused_by_the_server(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    ledger = Ledger(f"s3://{s3_env.bucket}/wrong-credentials")
    ledger.append([ev("a", "p", "generated", 0)])
    with pytest.raises(PermissionError, match="signature"):
        ledger.flush()
