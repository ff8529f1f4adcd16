"""A safetensors file streamed tensor by tensor: what safetensors reads back, what it refuses,
how much it holds, and the checkpoint store writing it."""

from __future__ import annotations

import gc
import json
import pickle
import weakref

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from sluice.storage.checkpoints import MANIFEST, CheckpointStore, folder_name, tensors_of
from sluice.storage.safetensors_stream import StoredTensors, Streamed, stream


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=gen),
        "norm.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(3.0),  # a 0-d tensor, as AdamW's step
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(3, generator=gen).to(torch.float16),
    }


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}


def test_a_streamed_file_is_what_safetensors_reads(tmp_path):
    tensors = _tensors()
    data = b"".join(bytes(c) for c in stream(_layout(tensors), iter(tensors.items())))
    back = load(data)
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("embed.weight"), tensors["embed.weight"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda items: items[1:], "came where the layout has 'embed.weight'"),
        (lambda items: items[:-1], "ended without ['half']"),
        (lambda items: [("embed.weight", torch.zeros(7, 4)), *items[1:]], "the layout says"),
        (lambda items: [(items[0][0], items[0][1].double()), *items[1:]], "torch.float64"),
    ],
    ids=["out-of-order", "short", "shape", "dtype"],
)
def test_a_tensor_that_is_not_the_layouts_is_refused_by_name(change, message):
    tensors = _tensors()
    chunks = stream(_layout(tensors), iter(change(list(tensors.items()))))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        for _ in chunks:
            pass


def test_the_store_writes_a_stream_holding_one_tensor_at_a_time(tmp_path):
    """Each tensor is made when the stream asks for it (a gather) and let go before the
    next is asked for: none written before it is still alive."""
    layout = {f"w{i}": torch.empty(64, 64, device="meta") for i in range(4)}
    alive: list[weakref.ref[np.ndarray]] = []  # each tensor's memory, however it is viewed

    def gathered():
        for name in layout:
            gc.collect()
            assert sum(ref() is not None for ref in alive) == 0, f"held when {name} is asked for"
            memory = np.full((64, 64), float(len(alive)), dtype=np.float32)
            alive.append(weakref.ref(memory))
            yield name, torch.from_numpy(memory)
            del memory

    store = CheckpointStore(tmp_path.as_uri())
    store.save(1, {"model.safetensors": Streamed(stream(layout, gathered()))}, {})
    back = load(store.load_latest().files["model.safetensors"])  # type: ignore[union-attr]
    assert len(alive) == 4 and [float(back[f"w{i}"][0, 0]) for i in range(4)] == [0, 1, 2, 3]


def test_the_store_writes_a_streamed_file_and_checks_it_like_any_other(tmp_path):
    tensors = _tensors()
    whole = b"".join(bytes(c) for c in stream(_layout(tensors), iter(tensors.items())))
    store = CheckpointStore(tmp_path.as_uri(), keep_last=1)
    files = {
        "model.safetensors": Streamed(stream(_layout(tensors), iter(tensors.items()))),
        "meta.json": b"{}",
    }
    store.save(1, files, {"version": 1})
    loaded = store.load_latest()
    assert loaded is not None and loaded.files["model.safetensors"] == whole
    manifest = json.loads((tmp_path / "checkpoints" / folder_name(1) / MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == len(whole)
    # Pruning checks a streamed file's checksum block by block; loading falls back past it.
    store = CheckpointStore(tmp_path.as_uri(), keep_last=3)
    store.save(2, {"model.safetensors": Streamed(iter([whole[:9], whole[9:]]))}, {})
    assert store._verifies(2)
    path = tmp_path / "checkpoints" / folder_name(2) / "model.safetensors"
    path.write_bytes(whole[:-1] + b"x")
    assert not store._verifies(2)
    assert store.load_latest().step == 1  # type: ignore[union-attr]


def test_stored_tensors_read_only_the_header_and_the_tensor_asked_for():
    tensors = _tensors()
    data = b"".join(bytes(c) for c in stream(_layout(tensors), iter(tensors.items())))
    ranges: list[tuple[int, int]] = []

    def read(offset: int, size: int) -> bytes:
        ranges.append((offset, size))
        return data[offset : offset + size]

    stored = StoredTensors(read)
    assert set(stored) == set(tensors) and "embed.weight" in stored and len(ranges) == 2
    assert torch.equal(stored["embed.weight"], tensors["embed.weight"])
    assert ranges[2][1] == tensors["embed.weight"].nbytes  # that tensor's bytes alone
    for name, tensor in tensors.items():
        assert stored[name].dtype == tensor.dtype and torch.equal(stored[name], tensor), name


def test_a_loaded_checkpoints_files_are_read_from_storage_when_asked_for(tmp_path):
    """What a training pool's ranks get: the files' names and where they are, not their
    bytes; each rank reads the tensors it needs (a pickled copy reads the same)."""
    tensors = _tensors()
    store = CheckpointStore((tmp_path / "run #1").as_uri())
    store.save(
        4,
        {
            "model.safetensors": Streamed(stream(_layout(tensors), iter(tensors.items()))),
            "rng.json": b"{}",
        },
        {},
    )
    loaded = store.load_latest()
    assert loaded is not None and set(loaded.files) == {"model.safetensors", "rng.json"}
    files = pickle.loads(pickle.dumps(loaded.files))
    assert len(pickle.dumps(loaded.files)) < 500  # no file's bytes travel
    assert files["rng.json"] == b"{}"
    stored = tensors_of(files, "model.safetensors")
    assert torch.equal(stored["ids"], tensors["ids"]) and set(stored) == set(tensors)
