"""Environments by name (``envs/registry.py``): built-ins, import paths, and the
``sluice.environments`` entry points of installed packages."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.config.tree import ConfigError, build_config
from sluice.envs import make_env
from sluice.envs.registry import registered

PACKAGE = """
from sluice import Problem, RewardResult


class Sorting:
    name = "sorting"

    def __init__(self, length: int = 3) -> None:
        if length < 2:
            raise ValueError("length must be at least 2")
        self.length = length

    def problems(self, split, n, seed):
        return [Problem(f"sorting/{split}/{i}", "sorting", "cab:", "abc", split) for i in range(n)]

    def reward(self, problem, completion):
        return RewardResult(float(completion == problem.answer), completion == problem.answer)
"""


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[None]:
    """A package ``sorting_envs`` installed the way pip leaves one: its module and a
    ``.dist-info`` folder whose entry_points.txt registers ``sorting``."""
    (tmp_path / "sorting_envs.py").write_text(textwrap.dedent(PACKAGE))
    info = tmp_path / "sorting_envs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sorting-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[sluice.environments]\nsorting = sorting_envs:Sorting\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sorting_envs", None)


def test_an_installed_packages_entry_point_is_an_environment_name(installed: None) -> None:
    assert registered()["sorting"] == "sorting_envs:Sorting"
    assert build_config({"env": {"name": "sorting", "args": {"length": 4}}}).env.name == "sorting"
    env = make_env("sorting", length=4)
    assert (env.name, env.length) == ("sorting", 4)  # type: ignore[attr-defined]
    assert env.reward(env.problems("train", 1, 0)[0], "abc").correct


def test_the_same_class_by_import_path(installed: None) -> None:
    assert make_env("sorting_envs:Sorting").name == "sorting"


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("sorting", {"length": 1}, "raised in its constructor: ValueError: length must be"),
        ("sorting_envs:nothing", {}, "has no attribute 'nothing'"),
        ("sorting_envs:PACKAGE_NAME", {}, "has no attribute"),
    ],
)
def test_what_cannot_be_built_is_named(
    installed: None, name: str, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_env(name, **kwargs)


def test_an_unknown_name_lists_the_registered_ones(installed: None) -> None:
    with pytest.raises(ConfigError, match=r"unknown environment 'chess'; allowed: .*sorting"):
        build_config({"env": {"name": "chess"}})
