"""The two data planes, measured in one Ray session: trajectory store vs a queue, and weights.

Trajectories: a producer actor holds rows as a rollout worker has them after generation
(Python lists of token ids and log-probs) and hands them over in blocks of ``BLOCK`` rows
(8 groups of 8); a consumer actor turns each delivered block into padded training tensors,
as the trainer does. Compared side by side on the same rows:

- ``store``: the trajectory store: the producer builds an Arrow RecordBatch from the
  rows' lists as the rollout worker does (``storage.block_builder.trajectory_block``, which
  takes token versions as runs, the form the worker keeps them in) and puts it
  (``StoreClient.put``, two puts in flight as an async rollout worker has them), the
  consumer leases whole groups, reads them zero-copy, pads them with
  ``storage.batches.to_train_batch`` and acknowledges. No durable copy.
- ``store+file``: the same with the ledger and the Parquet copy of every block written
  to a local ``file://`` folder (what a run does).
- ``queue``: ``ray.util.queue.Queue``, what several peer frameworks use: the producer puts
  each trajectory as a Python dict as it finishes, the consumer gets 64 of them and pads
  them with ``rl.batching.collate``.
- ``queue, blocks``: the same queue handed whole blocks (a list of 64 dicts per put), to
  separate what batching buys from what the Arrow format buys.
- ``queue, pipelined``: whole blocks with ``PIPELINE`` puts in flight and as many gets
  ahead, as the store's producer and a prefetching consumer run: the like-for-like
  baseline of ``store+file``, which the headline ratio is taken against.

Each size runs every variant once a round, for ``--rounds`` rounds (side by side, so a
busy moment hits all variants); the table gives each variant's median and each ratio's
median with its range over the rounds (ratios paired within a round).

Throughput is rows (and MB of row payload) per second from the first put to the last
padded batch, after one untimed block has gone the same way (first-call costs such as
pyarrow's lazy import of pandas, ~0.3 s, belong to a process's start, not to throughput).
Weights: the parameter service's publish and pull latency against model size
(``benchmarks.params``). Prints the section, keeps the record (``benchmarks/records.py``)
and writes the section, both tables, in BENCHMARKS.md.

    .venv/bin/python -m benchmarks.data_planes
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.util.queue import Queue

from benchmarks import params as params_bench
from benchmarks.records import Record, publish
from benchmarks.tables import markdown_table, quote_key, spread
from sluice.rl.batching import Sample, collate
from sluice.storage.batches import TRAIN_FIELDS, to_train_batch
from sluice.storage.block_builder import trajectory_block
from sluice.storage.trajectory_store import StoreClient, create_store

BLOCK = 64  # rows per hand-over: 8 prompts x 8 samples, one rollout call's worth
GROUP = 8
# Bytes per response token in a row: token id (int32), behaviour log-prob (float32) and
# policy version (int32).
BYTES_PER_TOKEN = 12
PROMPT_TOKENS = 32
MAX_ROWS_MB = 96  # total payload per variant and size, so large rows stay quick
VARIANTS = ("store", "store+file", "queue", "queue, blocks", "queue, pipelined")
PIPELINE = 2  # puts in flight per producer, as an async rollout worker runs them


def make_rows(block: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "sample_id": f"b{block}/g{i // GROUP}/{i % GROUP}",
            "prompt_id": f"p{block}/{i // GROUP}",
            "group_id": f"b{block}/g{i // GROUP}",
            "env": "addition",
            "prompt_ids": list(range(1, PROMPT_TOKENS + 1)),
            "response_ids": [(i + t) % 90 + 3 for t in range(tokens)],
            "behaviour_logprobs": [-0.01 * (t % 50) for t in range(tokens)],
            "token_versions": [0] * tokens,
            "reward": 1.0 if i % 2 else 0.0,
            "advantage": 1.0 if i % 2 else -1.0,
            "prompt_len": PROMPT_TOKENS,
            "response_len": tokens,
            "status": "scored",
        }
        for i in range(BLOCK)
    ]


def block_from_rows(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """The rows' lists laid out as a rollout worker lays out its samples (``block_of``):
    every token of a row has one version, so its versions are one run."""
    return trajectory_block(
        sample_ids=[r["sample_id"] for r in rows],
        prompt_ids=[r["prompt_id"] for r in rows],
        group_ids=[r["group_id"] for r in rows],
        env=rows[0]["env"],
        prompts=[r["prompt_ids"] for r in rows],
        responses=[r["response_ids"] for r in rows],
        logprobs=[r["behaviour_logprobs"] for r in rows],
        version_runs=[[(0, r["token_versions"][0])] for r in rows],
        rewards=[r["reward"] for r in rows],
        advantages=[r["advantage"] for r in rows],
        status="scored",
    )


@ray.remote(num_cpus=1)
class Producer:
    def __init__(self, blocks: int, tokens: int) -> None:
        self.blocks = {
            "warm-up": [make_rows(-1, tokens)],  # own sample ids: never a duplicate
            "timed": [make_rows(b, tokens) for b in range(blocks)],
        }

    def to_store(self, client: StoreClient, run: str) -> None:
        for rows in self.blocks[run]:
            client.put(block_from_rows(rows))
        client.flush()

    def to_queue(self, queue: Queue, blocks: bool, run: str) -> None:
        for rows in self.blocks[run]:
            if blocks:
                queue.put(rows)
            else:
                for row in rows:
                    queue.put(row)

    def to_queue_pipelined(self, queue: Queue, run: str) -> None:
        """Whole blocks, PIPELINE puts in flight: wait for the oldest before the next."""
        in_flight: list[ray.ObjectRef] = []
        for rows in self.blocks[run]:
            if len(in_flight) == PIPELINE:
                ray.get(in_flight.pop(0))
            in_flight.append(queue.actor.put.remote(rows, None))
        ray.get(in_flight)


@ray.remote(num_cpus=1)
class Consumer:
    def from_store(self, client: StoreClient, blocks: int) -> int:
        tokens = 0
        for _ in range(blocks):
            lease = client.lease(BLOCK, 0, 0, list(TRAIN_FIELDS))
            tokens += int(to_train_batch(lease.table, 0).mask.sum())
            client.ack(lease, 1)
        return tokens

    def from_queue(self, queue: Queue, count: int, blocks: bool) -> int:
        tokens = 0
        for _ in range(count):
            rows = queue.get() if blocks else [queue.get() for _ in range(BLOCK)]
            tokens += _padded_tokens(rows)
        return tokens

    def from_queue_pipelined(self, queue: Queue, count: int) -> int:
        """Whole blocks, PIPELINE gets asked ahead of the one being padded."""
        ahead = [queue.actor.get.remote(None) for _ in range(min(PIPELINE, count))]
        tokens = 0
        for i in range(count):
            rows = ray.get(ahead.pop(0))
            if i + len(ahead) + 1 < count:
                ahead.append(queue.actor.get.remote(None))
            tokens += _padded_tokens(rows)
        return tokens


def _padded_tokens(rows: list[dict[str, Any]]) -> int:
    samples = [
        Sample(r["prompt_ids"], r["response_ids"], r["behaviour_logprobs"], r["advantage"])
        for r in rows
    ]
    return int(collate(samples, 0).mask.sum())


def run_variant(variant: str, blocks: int, tokens: int, folder: Path) -> float:
    """Seconds from the first hand-over to the last padded batch.

    One block goes through first, untimed, in the same actors and store or queue, so that
    no variant's time holds a process's first-call costs (lazy imports, first connections).
    """
    producer = Producer.remote(blocks, tokens)
    consumer = Consumer.remote()
    ray.get(producer.__ray_ready__.remote())
    ray.get(consumer.__ray_ready__.remote())
    if variant == "queue, pipelined":
        queue = Queue(maxsize=8)

        def hand_over(run: str, count: int) -> int:
            done = consumer.from_queue_pipelined.remote(queue, count)
            ray.get(producer.to_queue_pipelined.remote(queue, run))
            return int(ray.get(done))

        close = queue.shutdown
    elif variant.startswith("queue"):
        in_blocks = variant == "queue, blocks"
        queue = Queue(maxsize=8 if in_blocks else 8 * BLOCK)

        def hand_over(run: str, count: int) -> int:
            done = consumer.from_queue.remote(queue, count, in_blocks)
            ray.get(producer.to_queue.remote(queue, in_blocks, run))
            return int(ray.get(done))

        close = queue.shutdown
    else:
        url = f"file://{folder / variant}-{tokens}" if variant == "store+file" else None
        client = StoreClient(create_store(url, capacity=8 * BLOCK), url, pipeline=PIPELINE)

        def hand_over(run: str, count: int) -> int:
            done = consumer.from_store.remote(client, count)
            ray.get(producer.to_store.remote(client, run))
            return int(ray.get(done))

        def close() -> None:
            ray.kill(client.handle)

    hand_over("warm-up", 1)
    start = time.perf_counter()
    got = hand_over("timed", blocks)
    elapsed = time.perf_counter() - start
    close()
    if got != blocks * BLOCK * tokens:
        raise RuntimeError(f"{variant}: consumed {got} tokens, expected {blocks * BLOCK * tokens}")
    ray.kill(producer)
    ray.kill(consumer)
    return elapsed


def measure_store(row_kb: list[int], rounds: int) -> list[dict[str, Any]]:
    """Per row size: every variant's samples/s in each round, and the row's bytes."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        for kb in row_kb:
            tokens = max(1, (kb * 1024 - PROMPT_TOKENS * 4) // BYTES_PER_TOKEN)
            row_bytes = PROMPT_TOKENS * 4 + tokens * BYTES_PER_TOKEN
            blocks = max(4, min(64, (MAX_ROWS_MB << 20) // (row_bytes * BLOCK)))
            samples = blocks * BLOCK
            rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(rounds):
                for variant in VARIANTS:
                    seconds = run_variant(variant, blocks, tokens, Path(tmp) / f"round-{r}")
                    rates[variant].append(samples / seconds)
                    print(
                        f"  {kb} KB rows, round {r + 1}, {variant}: {samples / seconds:,.0f} "
                        "samples/s",
                        flush=True,
                    )
            rows.append({"row_kb": kb, "samples": samples, "row_bytes": row_bytes, **rates})
    return rows


# (column, numerator, denominator): ratios of samples/s, paired within a round.
RATIOS = [
    ("store+file / queue, pipelined", "store+file", "queue, pipelined"),
    ("store / queue, blocks", "store", "queue, blocks"),
    ("store / queue", "store", "queue"),
]


def store_table(rows: list[dict[str, Any]]) -> str:
    header = ["row size", "rows", *(f"{v} samples/s" for v in VARIANTS), *(c for c, _, _ in RATIOS)]
    cells = []
    for r in rows:
        medians = [statistics.median(r[v]) for v in VARIANTS]
        ratios = [
            spread([a / b for a, b in zip(r[top], r[bottom], strict=True)])
            for _, top, bottom in RATIOS
        ]
        cells.append(
            [
                f"{r['row_kb']} KB",
                str(r["samples"]),
                *(f"{m:,.0f} ({m * r['row_bytes'] / 1e6:.0f} MB/s)" for m in medians),
                *ratios,
            ]
        )
    return "\n".join(markdown_table(header, cells))


def quotes(record: Record) -> dict[str, str]:
    """What docs may quote (``benchmarks/quotes.py``): each row size's ratios, median of the
    rounds (``16kb.store-file-queue-pipelined``), and each ratio's range over the row sizes
    (``store-queue.range``)."""
    out: dict[str, str] = {}
    medians: dict[str, list[float]] = {}
    for r in record.data["store"]:
        for column, top, bottom in RATIOS:
            key = quote_key(column)
            ratio = statistics.median(a / b for a, b in zip(r[top], r[bottom], strict=True))
            out[f"{r['row_kb']}kb.{key}"] = f"{ratio:.1f}x"
            medians.setdefault(key, []).append(ratio)
    for key, values in medians.items():
        out[f"{key}.range"] = f"{min(values):.1f}-{max(values):.1f}x"
    return out


def render(record: Record) -> str:
    """The section: the trajectory variants by row size, then the weights by model size."""
    data = record.data
    return (
        f"{record.measured_on()}; `{record.command}`. One Ray session, one producer and one "
        "consumer actor (1 CPU each).\n\n"
        f"Trajectories, blocks of {data['block']} rows, {data['rounds']} rounds; samples/s "
        f"are medians, ratios medians (min-max) of the rounds:\n\n{store_table(data['store'])}"
        "\n\nWeights (publish holds the trainer; pull is what a rollout worker waits):\n\n"
        f"{params_bench.table(data['weights'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-kb", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--model-mb", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5, help="weight publish/pull repeats")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the store variants")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        print("trajectory store vs ray.util.queue.Queue ...", flush=True)
        store = measure_store(args.row_kb, args.rounds)
        print("parameter service publish vs pull ...", flush=True)
        weights = params_bench.measure(args.model_mb, args.repeats)
    finally:
        ray.shutdown()
    data = {
        "block": BLOCK,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "store": store,
        "weights": weights,
    }
    publish(Record.measured("data-planes", "Data planes", render, data, ["ray", "pyarrow"]))


if __name__ == "__main__":
    main()
