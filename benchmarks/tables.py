"""Markdown tables and the statistics every benchmark writes its results into BENCHMARKS.md
with (spreads, geometric means, bootstrap intervals)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence


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


def span(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """``288-305``: the lowest and highest of ``values``, or one number when they print
    alike."""
    low, high = f"{min(values):,.{digits}f}", f"{max(values):,.{digits}f}"
    return (low if low == high else f"{low}-{high}") + unit


# How every training-run throughput is timed; docs/benchmarks.md, "One clock", says it whole.
ONE_CLOCK = (
    "Samples/s: trained samples over the run's wall clock from its first step's start to its "
    "last step's end, the driver's work between steps included, held-out evaluations taken "
    "off ([one clock](docs/benchmarks.md#one-clock))."
)

# Resamples of the rounds for a bootstrap interval; seeded, so a table rebuilt from the same
# records gives the same interval.
BOOTSTRAP_DRAWS = 10_000


def geometric_mean(values: Sequence[float]) -> float:
    """The mean of ratios that treats x and 1/x alike (2x and 0.5x average to 1x)."""
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, draws: int = BOOTSTRAP_DRAWS, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the geometric mean of paired ratios: the rounds are
    resampled with replacement ``draws`` times."""
    rng = random.Random(seed)
    means = sorted(geometric_mean(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - level) / 2
    return means[int(tail * (draws - 1))], means[math.ceil((1 - tail) * (draws - 1))]


def paired_ratio(values: Sequence[float], digits: int = 2) -> str:
    """Paired per-round ratios as ``geometric mean [95% bootstrap interval]``, or the one."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}x"
    low, high = bootstrap_interval(values)
    return f"{geometric_mean(values):.{digits}f}x [{low:.{digits}f}-{high:.{digits}f}]"


def quote_key(label: str) -> str:
    """A table row's label as a quote's key (``benchmarks/quotes.py``): lower case, runs of
    anything but letters and digits one hyphen (``async k=2`` -> ``async-k-2``)."""
    return "-".join("".join(c if c.isalnum() else " " for c in label.lower()).split())
