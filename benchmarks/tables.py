"""Markdown tables, as every benchmark writes its results into BENCHMARKS.md."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], rule: str = "---"
) -> list[str]:
    """The lines of a table: ``header``, a rule of ``rule`` per column (``---:`` aligns
    right), then one line per row of cells."""
    return [_row(header), "|" + f"{rule}|" * len(header), *(_row(cells) for cells in rows)]
