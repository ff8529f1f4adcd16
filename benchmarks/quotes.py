"""Numbers quoted outside their tables, tied to the records they come from.

A measured number that README.md, BENCHMARKS.md's hand-written text or a page of docs/
quotes is written as ``<!-- q:SOURCE:NAME -->VALUE<!-- /q -->`` (the markers do not show
when the Markdown is rendered). SOURCE is where the number comes from:

- a section of BENCHMARKS.md (``peer-trl-smollm2``): its newest record
  (``benchmarks/records.py``), whose module names its quotable values in
  ``quotes(record) -> dict[str, str]``, beside the ``commit`` and ``date`` of every record;
- ``learning/<folder>/<steps>``: the learning runs kept under
  ``benchmarks/results/<folder>/`` (``benchmarks/learning.py``; the folder may be nested,
  ``learning/repeats``), their ``quotes``.

``python -m benchmarks.regenerate`` writes every quote's VALUE from its source;
``tests/unit/benchmarks/test_quotes.py`` fails when a quote differs from its source or
names a value the source does not have, and when a file of ``quoted_files()`` holds
a number that reads like a measurement (a ratio, a percentage, a rate, milliseconds,
points) outside a quote, code and a generated section. A quote from a
section still waiting for its first record (``NOT_YET_RECORDED``) waits with it.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import learning
from benchmarks.records import newest, sections
from benchmarks.report import ROOT

QUOTE = re.compile(r"<!-- q:([\w./-]+):([\w.+-]+) -->(.*?)<!-- /q -->", re.S)
# The pages not yet converted: their measured numbers are still written by hand.
UNCONVERTED = ("docs/results.md", "docs/real-model.md", "docs/training-engines.md")
# BENCHMARKS.md is converted section by section (``## `` headings); these are not yet.
UNCONVERTED_SECTIONS = (
    "Against TRL",
    "Against TRL: the default workload",
    "Against TRL: the agentic workload",
    "The trainer on one GPU",
    "Against TRL: SmolLM2-135M-Instruct",
)
_HEADING = re.compile(r"^## (.*)$", re.M)
# Generated from the config's field descriptions (``make docs``): settings, not measurements.
GENERATED_FILES = ("docs/configuration-reference.md",)
# A number as a measurement is written: 1.42x, 61.9%, 190.6 samples/s, 6.91 GB/s, 37 ms,
# +5.5 points; an interval's confidence level (a 95% bootstrap interval) is not one.
MEASUREMENT = re.compile(
    r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?"
    r"(?:x\b|%(?!\s(?:bootstrap\s)?interval)"
    r"|\s?(?:samples|episodes|tokens|rows|calls|takes)/s\b|\s?[GM]B/s|\s?ms\b"
    r"|\s(?:points?|pts)\b)"
)
_GENERATED = re.compile(r"<!-- ([a-z0-9-]+):begin -->.*?<!-- \1:end -->", re.S)
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`]+`")  # inline code: a setting, a log line as printed


def files() -> list[Path]:
    """Every file that may quote: README.md, BENCHMARKS.md and docs/."""
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def quoted_files() -> list[str]:
    """The files whose every measured number is a quote: all of ``files`` but those not yet
    converted and the generated reference."""
    names = [str(path.relative_to(ROOT)) for path in files()]
    return [name for name in names if name not in (*UNCONVERTED, *GENERATED_FILES)]


def values(source: str) -> dict[str, str] | None:
    """What ``source`` quotes, by name; None when it has no records yet."""
    if source.startswith("learning/"):
        _, *folder, steps = source.split("/")
        return learning.quotes("/".join(folder), int(steps))
    if source not in sections():
        return None
    record = newest(source)
    assert record is not None
    quotes = record.beside("quotes")
    # Every record's commit and date, beside what its module names.
    own = {"commit": record.commit, "date": record.date.split()[0]}
    return own | (quotes(record) if quotes else {})


def rewrite(text: str, read: dict[str, dict[str, str] | None] | None = None) -> str:
    """``text`` with every quote whose source has records written from it (a name the
    source does not have is left for the test to report); ``read``: the sources' values
    already read, filled as they are."""
    read = {} if read is None else read

    def value(match: re.Match[str]) -> str:
        source, name, old = match.groups()
        if source not in read:
            read[source] = values(source)
        return f"<!-- q:{source}:{name} -->{(read[source] or {}).get(name, old)}<!-- /q -->"

    return QUOTE.sub(value, text)


def converted(name: str) -> str:
    """The text of page ``name`` whose numbers must all be quotes: the page, less
    BENCHMARKS.md's sections not yet converted."""
    text = (ROOT / name).read_text()
    if name != "BENCHMARKS.md":
        return text
    parts = _HEADING.split(text)  # preamble, then heading and body in turn
    kept = [parts[0]]
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if heading not in UNCONVERTED_SECTIONS:
            kept.append(f"## {heading}\n{body}")
    return "".join(kept)


def unquoted(text: str) -> list[str]:
    """The measurement-like numbers of ``text`` outside quotes, fenced code blocks and
    generated sections."""
    for pattern in (_GENERATED, _FENCED, QUOTE, _CODE):
        text = pattern.sub("", text)
    return MEASUREMENT.findall(text)
