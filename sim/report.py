"""Writing a table into its own section of BENCHMARKS.md (the benchmarks and the simulator)."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "BENCHMARKS.md"


def write_section(key: str, title: str, body: str) -> None:
    """Replace what lies between ``<!-- key:begin -->`` and ``<!-- key:end -->`` with
    ``body``; append a ``## title`` section holding it when the markers are not there yet."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    BENCHMARKS.write_text(text)
