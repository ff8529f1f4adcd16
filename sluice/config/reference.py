"""The configuration reference page, generated from the config tree (``sluice/config/tree.py``).

``render`` walks ``RunConfig`` and its sections and returns docs/configuration-reference.md:
one section per config section, each a table of dotted key, type (with its allowed range),
default and the field's description. ``make docs`` writes the page;
``tests/unit/config/test_config_reference.py`` fails when the committed page differs from
``render()``, so the page cannot drift from the code.

    .venv/bin/python -m sluice.config.reference           # print the page
    .venv/bin/python -m sluice.config.reference --write   # write docs/configuration-reference.md
"""

from __future__ import annotations

import argparse
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sluice.config.tree import RunConfig

# Where --write puts the page, relative to the folder it runs in (the repository root, as
# `make docs` runs it): the page lives beside the other docs, not inside the package.
PAGE = Path("docs") / "configuration-reference.md"

HEADER = """\
# Configuration reference

Every key of a run's config, generated from the config tree in `sluice/config/tree.py` by
`make docs` (`.venv/bin/python -m sluice.config.reference --write`); do not edit this
page by hand. How configs and `--set` overrides work, and the example configs, are in
[configuration.md](configuration.md).

A key is set in a YAML config as its section and field (`checkpoint:` then `every: 100`)
or on the command line as `--set checkpoint.every=100`. Unknown keys and values outside a
field's range stop the run before anything starts, with a message naming the field. Rules
that tie two fields together (for example `policy.heads` must divide `policy.hidden`) are
checked at load too.
"""


def _type_name(annotation: Any) -> str:
    """``annotation`` as a user writes its values: ``int``, ``str | null``, ``"a" | "b"``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:  # a union member with bounds of its own: int (>= 1)
        metadata = [m for item in args[1:] for m in getattr(item, "metadata", [item])]
        bounds = _bounds_of(metadata)
        return f"{_type_name(args[0])} ({bounds})" if bounds else _type_name(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if origin is tuple:
        return f"[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    """The range pydantic enforces on ``field``: ``>= 1, <= 32``, or a pattern."""
    return _bounds_of(field.metadata)


def _bounds_of(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    """The default as it would be written in YAML's JSON subset (``null``, ``true``, ``[]``)."""
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    return json.dumps(value)


def _one_line(text: str | None) -> str:
    return re.sub(r"\s+", " ", text or "").strip()


def _cell(text: str) -> str:
    """``text`` safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def _is_section(field: FieldInfo) -> bool:
    annotation = field.annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _optional_section(field: FieldInfo) -> type[BaseModel] | None:
    """The section model of a field typed ``Section | None`` (off unless set)."""
    args = [a for a in get_args(field.annotation) if a is not type(None)]
    if get_origin(field.annotation) in (Union, types.UnionType) and len(args) == 1:
        (only,) = args
        if isinstance(only, type) and issubclass(only, BaseModel):
            return only
    return None


def sections(
    model: type[BaseModel] = RunConfig, prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """(dotted section name, its model, its own (dotted key, field) pairs), parents first.

    The top level is the section named ``""``; nested sections follow in field order.
    """
    own = [
        (f"{prefix}{name}", field)
        for name, field in model.model_fields.items()
        if not _is_section(field)
    ]
    yield prefix.rstrip("."), model, own
    for name, field in model.model_fields.items():
        if _is_section(field):
            assert isinstance(field.annotation, type)  # for the type checker: _is_section
            yield from sections(field.annotation, f"{prefix}{name}.")
        elif (optional := _optional_section(field)) is not None:
            yield from sections(optional, f"{prefix}{name}.")


def _section_text(name: str, model: type[BaseModel]) -> list[str]:
    if not name:
        return ["## Top level", "", _one_line(model.__doc__).replace("``", "`")]
    return [f"## `{name}`", "", _one_line(model.__doc__).replace("``", "`")]


def render() -> str:
    """docs/configuration-reference.md for the config tree as it is in ``sluice/config/tree.py``."""
    lines = [HEADER.rstrip("\n")]
    for name, model, fields in sections():
        lines += ["", *_section_text(name, model), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, field in fields:
            kind = _type_name(field.annotation)
            bounds = _bounds(field)
            if bounds:
                kind = f"{kind} ({bounds})"
            row = [f"`{key}`", kind, f"`{_default(field)}`", _one_line(field.description)]
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="write the page to --out instead of printing it"
    )
    parser.add_argument(
        "--out", type=Path, default=PAGE, help=f"where --write puts the page (default: {PAGE})"
    )
    args = parser.parse_args(argv)
    page = render()
    if not args.write:
        print(page, end="")
        return
    if not args.out.parent.is_dir():
        parser.error(f"no folder {args.out.parent}/ here: run from the repository root")
    args.out.write_text(page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
