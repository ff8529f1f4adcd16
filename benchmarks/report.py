"""Writing a table into its own section of BENCHMARKS.md (the benchmarks and the simulator),
reading a section back, the commit a measurement names and whether the checkout's code is
that commit's."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
# What a benchmark run writes, or a person writes about it: a commit that changes only these
# leaves the measured code as it was, so measurements at it keep naming the commit before.
RESULTS = (
    "BENCHMARKS.md",
    "README.md",
    "docs",
    "sim/profiles/cpu2core.json",
    "benchmarks/results",
)


def scratch() -> Path:
    """``runs/`` of the checkout, made if missing (a fresh clone has none): where the
    benchmarks' runs go while they run."""
    path = ROOT / "runs"
    path.mkdir(exist_ok=True)
    return path


def measured_commit(root: Path = ROOT) -> str:
    """The short hash of the newest commit that changed code, that is, anything but
    ``RESULTS``: the code a benchmark run measures. "unknown" outside a git checkout."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", ".", *(f":(exclude){p}" for p in RESULTS)],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


# What a training run (``sluice run``) never imports: a run measured at one commit is the
# same measurement at a later one when the commits between change only these, ``RESULTS``
# and no module of the benchmark's own (``code_changes``). The simulator is ``sluice
# simulate``'s alone.
NOT_IN_A_RUN = ("tests", "sim", "infra", ".ci", "benchmarks")


def code_changes(
    since: str, until: str, runs_with: tuple[str, ...] = (), root: Path | None = None
) -> list[str]:
    """The files that ``until`` changes since ``since`` among those a measurement runs:
    everything but ``RESULTS`` and ``NOT_IN_A_RUN``, and the paths of ``runs_with`` (a
    benchmark's own modules under ``benchmarks/``). A commit that is not in the checkout's
    history is named as the change."""

    def changed(*paths: str) -> list[str]:
        out = subprocess.run(
            ["git", "diff", "--name-only", since, until, "--", *paths],
            cwd=root or ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise LookupError(out.stderr.strip())
        return out.stdout.split()

    excluded = (f":(exclude){p}" for p in (*RESULTS, *NOT_IN_A_RUN))
    try:
        return sorted({*changed(".", *excluded), *(changed(*runs_with) if runs_with else [])})
    except LookupError:
        return [f"{since} or {until} (not a commit of this checkout)"]


def uncommitted() -> list[str]:
    """Tracked files outside ``RESULTS`` that differ from the checkout's commit."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    paths = [line[3:] for line in out.stdout.splitlines()]
    return [p for p in paths if not any(p == r or p.startswith(f"{r}/") for r in RESULTS)]


def read_section(key: str) -> str | None:
    """What lies between a section's markers, or None when BENCHMARKS.md has no such section."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else ""
    if begin not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


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
