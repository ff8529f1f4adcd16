"""A tensor-parallel engine's weight hand-over: a version written as safetensors files of a
bounded size, in the order it came, and read back by each rank's worker extension in that
order, every tensor once (vLLM's ``reload_weights`` is replaced by a recorder here: what is
tested is the files and the order, not vLLM)."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import sluice.storage.safetensors_stream as safetensors_stream
from sluice.engines.rollout.vllm_engine import handover_dir, write_handover
from sluice.engines.rollout.vllm_weight_sync import WeightSyncExtension


class _RecordingRank(WeightSyncExtension):
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model_runner = SimpleNamespace(get_model=torch.nn.Module)  # no head to repack

    def reload_weights(self, weights_iterator):
        self.loaded.extend(weights_iterator)


def _version() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    names = [f"model.layers.{i}.{part}" for i in range(3) for part in ("mlp.w", "self_attn.q")]
    pairs = [(name, torch.randn(16, 8 + i)) for i, name in enumerate(sorted(names))]
    return [*pairs, ("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))]


def test_a_version_is_cut_into_bounded_files_and_each_rank_loads_it_in_order(tmp_path):
    version = _version()
    paths, count = write_handover(iter(version), tmp_path, file_bytes=1024)
    assert count == len(version)
    # Tensor i is 16 x (8 + i) float32, 512 + 64 i bytes: a file closes once it holds 1 KiB,
    # so two tensors a file, and the bf16 norm alone in the last.
    held = []
    for path in paths:
        with safe_open(path, "pt") as f:
            held.append(len(list(f.keys())))
    assert held == [2, 2, 2, 1]
    ranks = [_RecordingRank(), _RecordingRank()]
    counts = [rank.sluice_load_files(paths) for rank in ranks]
    assert counts == [len(version)] * 2
    for rank in ranks:
        assert [name for name, _ in rank.loaded] == [name for name, _ in version]
        for (_, got), (_, want) in zip(rank.loaded, version, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_hand_over_folder_is_in_shared_memory_where_there_is_some():
    folder = handover_dir()
    try:
        assert folder.is_dir()
        assert folder.parent.as_posix() == "/dev/shm" or not os.path.isdir("/dev/shm")
    finally:
        folder.rmdir()


def test_a_full_hand_over_folder_is_named_with_the_fix(tmp_path, monkeypatch):
    def full(layout, tensors):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield  # a generator, as stream is

    monkeypatch.setattr(safetensors_stream, "stream", full)
    with pytest.raises(OSError, match=r"filled .* GiB free.*larger /dev/shm"):
        write_handover(iter(_version()), tmp_path)
