import random

import numpy as np
import pytest
import torch

from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.safetensors_stream import materialised
from sluice.storage.torch_state import (
    bytes_to_tensors,
    load_optimizer,
    optimizer_to_files,
    restore_rng,
    rng_state_files,
    tensors_to_bytes,
)


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.95))
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # The batch comes from the global RNGs, so restoring them is part of resuming exactly.
    x = torch.randn(16, 6) + float(np.random.rand()) + random.random()
    loss = (model(x) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_tensors_round_trip_including_shared_storage():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {"w": base, "view": base[1], "tied": base, "half": torch.ones(2, dtype=torch.half)}
    back = bytes_to_tensors(tensors_to_bytes(tensors))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor)


def test_rng_states_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    files = rng_state_files()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(files)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2])


def test_resuming_from_a_checkpoint_trains_identically(tmp_path):
    random.seed(0)
    np.random.seed(0)
    model, optimizer = make_model(seed=0)
    for _ in range(3):
        train_step(model, optimizer)
    store = CheckpointStore(f"file://{tmp_path}")
    files = {"model.safetensors": tensors_to_bytes(model.state_dict())}
    files |= optimizer_to_files(optimizer) | rng_state_files()
    store.save(3, files, {"step": 3})
    for _ in range(3):
        train_step(model, optimizer)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    random.seed(123)
    np.random.seed(123)
    fresh_model, fresh_optimizer = make_model(seed=1)  # different init, empty optimizer state
    checkpoint = store.load_latest()
    assert checkpoint is not None
    assert checkpoint.step == 3
    fresh_model.load_state_dict(bytes_to_tensors(checkpoint.files["model.safetensors"]))
    load_optimizer(fresh_optimizer, checkpoint.files)
    restore_rng(checkpoint.files)
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    for _ in range(3):
        train_step(fresh_model, fresh_optimizer)
    resumed = fresh_model.state_dict()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def test_loading_into_an_optimizer_that_has_stepped_replaces_its_state_exactly():
    model, optimizer = make_model(seed=0)
    train_step(model, optimizer)
    files = materialised(optimizer_to_files(optimizer))
    want = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    for _ in range(2):
        train_step(model, optimizer)
    load_optimizer(optimizer, files)
    got = optimizer.state_dict()["state"][0]
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert got["step"].dtype == torch.float32 and got["step"].device.type == "cpu"


def test_non_tensor_non_json_optimizer_state_is_refused():
    _, optimizer = make_model(seed=0)
    optimizer.param_groups[0]["weird"] = object()
    with pytest.raises(TypeError, match="without pickle"):
        optimizer_to_files(optimizer)
