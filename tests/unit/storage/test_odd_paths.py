"""A run folder whose path has spaces, '#', '%' or non-ASCII characters: its storage URL
(``Path.as_uri``, percent-encoded) writes where the path says and reads back from there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.layout import RunLayout, durable_state
from sluice.storage.urls import open_url

NAMES = ["a b", "run #1", "100% done", "café ü", "x%20y"]


@pytest.mark.parametrize("name", NAMES)
def test_the_url_of_a_folder_names_that_folder(tmp_path: Path, name: str) -> None:
    folder = tmp_path / name
    _, root = open_url(folder.as_uri())
    assert root == str(folder)
    _, plain = open_url(str(folder))  # a plain path, unencoded, names it too
    assert plain == str(folder)


@pytest.mark.parametrize("name", NAMES)
def test_state_written_through_the_url_lands_in_the_folder(tmp_path: Path, name: str) -> None:
    folder = tmp_path / name
    store = CheckpointStore(folder.as_uri(), keep_last=2)
    store.save(3, {"model.safetensors": b"weights"}, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no encoded sibling
    assert (folder / "checkpoints").is_dir()
    loaded = CheckpointStore(folder.as_uri()).load_latest()
    assert loaded is not None and loaded.files["model.safetensors"] == b"weights"
    assert durable_state(folder.as_uri()) == ["checkpoints"]


@pytest.mark.parametrize("name", NAMES)
def test_rays_temp_folder_is_a_plain_short_path(name: str) -> None:
    """Ray writes its sockets under its temp folder and encodes their paths as ASCII."""
    temp = str(RunLayout(Path("/r") / name, Path("/c")).ray_temp)
    assert re.fullmatch(r"[A-Za-z0-9_./-]+", temp) and len(temp) <= 60
