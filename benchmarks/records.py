"""Benchmark records: what one benchmark run measured, kept in the repository, and the
BENCHMARKS.md section written from it.

A benchmark's ``main`` measures, puts the raw numbers in a ``Record`` (with the commit,
the date, the machine, the package versions and the command that measured them) and calls
``publish``: the record is kept as a small JSON file under
``benchmarks/results/records/<section>/`` and the section is what the benchmark's
renderer (named in the record, ``module:function``) makes of it, and of nothing else.
``python -m benchmarks.regenerate`` writes every section again from its newest record;
``tests/unit/benchmarks/test_records.py`` fails when a section differs from what its
record renders. A run of the product inside a benchmark is kept whole by ``run_record``:
per step its wall time, samples, tokens, the trainer's wait and the staleness of what it
trained, per evaluation the held-out accuracy.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from benchmarks.report import ROOT, measured_commit, write_section

RECORDS = ROOT / "benchmarks" / "results" / "records"
Render = Callable[["Record"], str]


def machine() -> dict[str, Any]:
    """The machine a record was measured on: CPU (with the vector instructions torch
    uses), architecture, cores, Python."""
    import torch

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {
        "cpu": f"{names[0] if names else platform.processor() or 'unknown'} "
        f"({torch.backends.cpu.get_cpu_capability()})",
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that is running, as a reader types it from the checkout's root:
    ``.venv/bin/python -m benchmarks.<module> ARGS``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    module = script.stem if script.parent.name == "benchmarks" else None
    head = f".venv/bin/python -m benchmarks.{module}" if module else shlex.quote(argv[0])
    return " ".join([head, *(shlex.quote(a) for a in argv[1:])])


@dataclass(frozen=True)
class Record:
    """One measurement of a section: ``data`` holds the raw numbers (JSON), ``render``
    names the function that writes the section from the record."""

    section: str
    title: str
    render: str  # "benchmarks.datasets:render"
    command: str
    data: dict[str, Any]
    commit: str
    date: str  # "2026-11-30 17:40 UTC": when the measurement ended
    machine: dict[str, Any]  # cpu, arch, cores, python
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def measured(
        cls,
        section: str,
        title: str,
        render: Render,
        data: dict[str, Any],
        packages: Sequence[str] = (),
        command: str | None = None,
        commit: str | None = None,
        date: str | None = None,
    ) -> Record:
        """A record of what was just measured on this machine, at this checkout's code
        (``measured_commit``) and now, or, for a table of runs kept earlier, at their
        ``commit`` and the ``date`` the last ended ("2026-11-30 17:40 UTC")."""
        versions = {}
        for name in packages:
            try:
                versions[name] = version(name)
            except PackageNotFoundError:
                versions[name] = "not installed"
        return cls(
            section=section,
            title=title,
            render=f"{_module_of(render)}:{render.__qualname__}",
            command=command or command_line(),
            data=_strict(json.loads(json.dumps(data))),  # what the file holds: lists, no NaN
            commit=commit or measured_commit(),
            date=date or f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            machine=machine(),
            versions=versions,
        )

    def measured_on(self) -> str:
        """``Measured <date> at commit <c> on <arch>, <n> cores, Python <v>, <package> <v>``:
        the first words of a section."""
        m = self.machine
        versions = "".join(f", {name} {v}" for name, v in self.versions.items())
        return (
            f"Measured {self.date.split()[0]} at commit {self.commit} on {m['arch']}, "
            f"{m['cores']} cores, Python {m['python']}{versions}"
        )

    def beside(self, name: str) -> Callable[..., Any] | None:
        """The function ``name`` of the module that renders this record, None if it has
        none (a module's ``quotes``, ``benchmarks/quotes.py``)."""
        module = importlib.import_module(self.render.split(":")[0])
        return getattr(module, name, None)

    def text(self) -> str:
        """The section this record renders."""
        render = self.beside(self.render.split(":")[1])
        assert render is not None, f"{self.render} is gone: no renderer for {self.section}"
        return str(render(self))


def _module_of(function: Callable[..., Any]) -> str:
    """The importable name of ``function``'s module, also when that module is the one
    ``python -m benchmarks.<name>`` runs as ``__main__``."""
    name = function.__module__
    if name == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError("run the benchmark with python -m benchmarks.<name>")
        name = spec.name
    return name


def _strict(value: Any) -> Any:
    """``value`` with every float that JSON cannot hold (NaN, infinities) as None: a record
    is strict JSON, and a number that was not measured reads as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def record_path(record: Record, root: Path | None = None) -> Path:
    stamp = record.date.replace("-", "").replace(":", "").replace(" ", "T")[:13]
    return (root or RECORDS) / record.section / f"{stamp}-{record.commit}.json"


def keep(record: Record, root: Path | None = None) -> Path:
    """Write ``record`` as ``<root>/<section>/<date>-<commit>.json`` (``root``: ``RECORDS``);
    its path."""
    path = record_path(record, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(record), indent=1, allow_nan=False) + "\n")
    return path


def read(path: Path) -> Record:
    raw = json.loads(path.read_text())
    try:
        return Record(**raw)
    except TypeError as error:
        raise ValueError(f"{path} is not a benchmark record: {error}") from None


def newest(section: str, root: Path | None = None) -> Record | None:
    """The newest record of ``section`` (by its file name, which starts with the date)."""
    found = sorted(((root or RECORDS) / section).glob("*.json"))
    return read(found[-1]) if found else None


def sections(root: Path | None = None) -> list[str]:
    """The sections that have records."""
    root = root or RECORDS
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def publish(record: Record, write: bool = True) -> str:
    """Print the section ``record`` renders; with ``write``, keep the record and put the
    section in BENCHMARKS.md. The section's text."""
    text = record.text()
    print(text)
    if write:
        print(f"record: {keep(record)}")
        write_section(record.section, record.title, text)
    return text


def run_record(run_dir: Path, root: Path) -> dict[str, Any]:
    """A finished Sluice run under ``root`` as a record keeps it: per step the wall time
    (the benchmarks' one clock, ``benchmarks/series.py``), trained samples and tokens, the
    trainer's wait for data and the staleness counts of what it trained; per evaluation
    the held-out accuracy; the run's own summary throughput."""
    from benchmarks.series import STALENESS_PREFIX, _metrics, sluice_series

    summary = json.loads((run_dir / "summary.json").read_text())
    series = sluice_series(run_dir.name, run_dir, root)
    metrics = _metrics(root / "mlflow.db", summary["mlflow_run_id"])
    waits = series.phases[0].spans  # the trainer's "waiting for data"
    steps = []
    for i, wall in enumerate(series.step_s):
        step = i + 1
        stale = {
            key.removeprefix(STALENESS_PREFIX): int(values[step])
            for key, values in sorted(metrics.items())
            if key.startswith(STALENESS_PREFIX) and values.get(step)
        }
        steps.append(
            {
                "wall_s": round(wall, 4),
                "samples": int(series.samples[i]),
                "tokens": int(series.tokens[i]),
                "trainer_wait_s": round(waits[i][1], 4),
                "staleness": stale,
            }
        )
    return {
        "run": run_dir.name,
        "mode": summary.get("mode"),
        "samples_per_s": summary.get("samples_per_s"),
        "steps": steps,
        "heldout": {str(k): v for k, v in sorted(series.evals.items())},
    }
