"""pytest imports test files by basename (there are no packages under tests/), so two test
files with one name fail the whole collection."""

from collections import Counter
from pathlib import Path


def test_test_files_have_unique_basenames():
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
