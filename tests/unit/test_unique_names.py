"""pytest imports test files by basename (no packages under tests/): two files with one name fail collection."""

from collections import Counter
from pathlib import Path


def test_test_files_have_unique_basenames():
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
