"""Write BENCHMARKS.md's sections again from their newest records (``benchmarks/records.py``),
and every quoted number from its source (``benchmarks/quotes.py``), changing nothing else:
``make bench`` ends with it, and after a change to how a section is written it brings
every section up to date without measuring anything.

    .venv/bin/python -m benchmarks.regenerate
"""

from __future__ import annotations

from benchmarks import quotes
from benchmarks.records import newest, sections
from benchmarks.report import ROOT, read_section, write_section

# Sections measured before benchmarks kept records: their next measurement keeps one (and
# leaves this list); tests/unit/benchmarks/test_records.py holds the two in step.
NOT_YET_RECORDED = frozenset(
    {
        "peer-trl",
        "peer-trl-agentic",
        "gpu-trainer",
        "kill-resume",
    }
)


def regenerate() -> list[str]:
    """Rewrite every recorded section from its newest record, then every quote of a number
    (``benchmarks/quotes.py``) from its source; the sections and files that changed."""
    changed = []
    for section in sections():
        record = newest(section)
        assert record is not None
        text = record.text()
        if read_section(section) != text:
            write_section(section, record.title, text)
            changed.append(section)
    read: dict[str, dict[str, str] | None] = {}
    for path in quotes.files():
        text = path.read_text()
        if (new := quotes.rewrite(text, read)) != text:
            path.write_text(new)
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main() -> None:
    changed = regenerate()
    print(f"rewrote {', '.join(changed)}" if changed else "every recorded number is as written")


if __name__ == "__main__":
    main()
