"""docs/configuration-reference.md is ``render()`` of the config tree, and names every key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from sluice.config.reference import render
from sluice.config.tree import RunConfig

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration-reference.md"


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of the tree, dotted, read from the models directly (not via render)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


KEYS = _keys(RunConfig)


def test_committed_page_is_current():
    assert PAGE.is_file(), f"{PAGE} is missing: run `make docs`"
    assert PAGE.read_text() == render(), (
        f"{PAGE.name} is stale (sluice/config/tree.py changed since it was written): run "
        "`make docs` and commit the page"
    )


@pytest.mark.parametrize("key", KEYS)
def test_every_field_is_in_the_page(key):
    assert f"| `{key}` |" in render()
    assert f"| `{key}` |" in PAGE.read_text(), f"`{key}` is not in {PAGE.name}: run `make docs`"


def test_every_section_has_a_heading():
    sections = {key.rpartition(".")[0] for key in KEYS if "." in key}
    for section in sections:
        assert f"## `{section}`" in render()


def test_checkpoint_every_row():
    # A known row, to check the columns: key, type with its range, default, description.
    row = next(line for line in render().splitlines() if line.startswith("| `checkpoint.every` |"))
    assert row.startswith("| `checkpoint.every` | int (>= 1) | `200` | Checkpoint every")
