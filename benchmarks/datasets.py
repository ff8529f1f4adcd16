"""A large data set at start-up: how long until a run on a 1M-row Parquet file can start,
and whether the driver's memory stays flat while the training stream goes through it.

Writes a Parquet file of ``--rows`` addition prompts (with a reference answer and a field)
to a temporary folder, then in this process, as the driver of a run does
(``driver/environment.py``, ``envs/dataset.py``):

- start: open the file, check the mapped columns and every prompt (``DatasetEnv.check``),
  draw the held-out set (``eval.prompts`` = 256 rows, by hash) and the first training
  batch (128 prompts): the work before Ray starts;
- stream: take ``--take`` further training prompts through the stream, as a run's
  dispatcher does, and read the process's resident memory (``VmRSS``) every 64k;
- beside them, for scale: the same file read whole with ``pyarrow.parquet.read_table``.

Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and puts
the section in BENCHMARKS.md ("Data sets at start-up").

    .venv/bin/python -m benchmarks.datasets --write
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table
from sluice.envs.dataset import Columns, DatasetEnv, DataSource

MB = 1e6


def rss() -> float:
    """This process's resident memory in MB (``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError("no VmRSS in /proc/self/status")


def write_file(folder: Path, rows: int) -> Path:
    path = folder / f"prompts-{rows}.parquet"
    writer = None
    step = 100_000
    for start in range(0, rows, step):
        a = list(range(start, min(start + step, rows)))
        table = pa.table(
            {
                "prompt": [f"{i % 9973}+{i // 7}?" for i in a],
                "answer": [str(i % 9973 + i // 7) for i in a],
                "level": [i % 5 for i in a],
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=65_536)
    assert writer is not None
    writer.close()
    return path


def _warm_up(folder: Path) -> None:
    """The same steps on a file of a few rows, so that what pyarrow's dataset and compute
    modules allocate on first use is not counted as data."""
    small = write_file(folder, 64)
    env = DatasetEnv(DataSource(str(small)), Columns("prompt", "answer", ("level",)))
    env.check()
    env.problems("heldout", 4, 0)
    env.stream(seed=0).take(8)


def measure(path: Path, take: int) -> dict[str, float]:
    _warm_up(Path(tempfile.mkdtemp(prefix="sluice-bench-warm-")))
    before = rss()
    t0 = time.monotonic()
    env = DatasetEnv(DataSource(str(path)), Columns("prompt", "answer", ("level",)))
    env.check()
    env.problems("heldout", 256, 0)
    stream = env.stream(seed=0)
    stream.take(128)
    start_s = time.monotonic() - t0
    after_start = rss()
    peak, t1, along = after_start, time.monotonic(), []
    for _ in range(take // 65_536):
        stream.take(65_536)
        along.append(rss() - before)
    peak = max(along)
    stream_s = time.monotonic() - t1
    t2 = time.monotonic()
    whole = pq.read_table(path)
    whole_s, whole_rss = time.monotonic() - t2, rss()
    return {
        "rows": float(whole.num_rows),
        "file_mb": path.stat().st_size / MB,
        "start_s": start_s,
        "start_rss_mb": after_start - before,
        "stream_rows_per_s": take / stream_s,
        "stream_peak_rss_mb": peak,
        "stream_first_rss_mb": along[0],
        "stream_last_rss_mb": along[-1],
        "read_whole_s": whole_s,
        "read_whole_rss_mb": whole_rss - before,
    }


def render(record: Record) -> str:
    """The section: the file, then start, streaming and the whole-file read."""
    m, take = record.data["measured"], record.data["take"]
    rows = [
        ["start (check every prompt, held-out set, first batch)", f"{m['start_s']:.2f} s",
         f"+{m['start_rss_mb']:.0f} MB"],
        [f"stream {take:,} training prompts", f"{m['stream_rows_per_s']:,.0f} rows/s",
         f"+{m['stream_first_rss_mb']:.0f} MB after 65,536, +{m['stream_last_rss_mb']:.0f} MB "
         f"at the end, +{m['stream_peak_rss_mb']:.0f} MB at the peak"],
        ["for scale: read the file whole (pyarrow)", f"{m['read_whole_s']:.2f} s",
         f"+{m['read_whole_rss_mb']:.0f} MB"],
    ]  # fmt: skip
    header = ["step", "time", "driver memory (RSS above the start)"]
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`. A Parquet file of "
            f"{int(m['rows']):,} rows ({m['file_mb']:.0f} MB).",
            "",
            *markdown_table(header, rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--take", type=int, default=524_288)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-data-") as folder:
        path = write_file(Path(folder), args.rows)
        m = measure(path, args.take)
    data = {"rows": args.rows, "take": args.take, "measured": m}
    publish(Record.measured("datasets", "Data sets at start-up", render, data), args.write)


if __name__ == "__main__":
    main()
