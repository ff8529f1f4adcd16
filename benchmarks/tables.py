"""Markdown tables, as every benchmark writes its results into BENCHMARKS.md, and the
commit they were measured at."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from importlib.metadata import version

from benchmarks.report import measured_commit


def measured_on(*packages: str, commit: str | None = None) -> str:
    """``Measured <date> at commit <c> on <machine>, <n> cores, Python <v>, <package> <v>...``:
    the first words of every benchmark's section; ``commit`` defaults to ``measured_commit()``."""
    versions = "".join(f", {name} {version(name)}" for name in packages)
    return (
        f"Measured {datetime.now(UTC):%Y-%m-%d} at commit {commit or measured_commit()} on "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        + versions
    )


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], rule: str = "---"
) -> list[str]:
    """The lines of a table: ``header``, a rule of ``rule`` per column (``---:`` aligns
    right), then one line per row of cells."""
    return [_row(header), "|" + f"{rule}|" * len(header), *(_row(cells) for cells in rows)]


def spread(values: Sequence[float], unit: str = "x", digits: int = 1) -> str:
    """``median (min-max)`` of repeats, or the one value."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"
