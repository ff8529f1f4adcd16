"""Response lengths for the simulator: long-tail draws, or whole groups replayed from a run.

``draw_lengths`` returns a (groups, samples_per_group) integer matrix, drawn once per
simulation before any event runs, so every policy compared on one seed sees the same
responses for the same groups (common random numbers: differences between policies are
the policies', not the draw's).

Replay reads the ``response_len`` and ``group_id`` columns of a run's trajectory rows
(``storage/schema.py``), the Parquet files Sluice's trajectory store writes under
``<run>/trajectories/``, and resamples whole groups, keeping the within-group correlation
that a per-sample draw would lose. No Ray, no Sluice store: plain pyarrow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sluice.sim.scenario import LengthSpec

# Replayed runs may be small; fewer groups than this is too few to resample a long tail from.
MIN_REPLAY_GROUPS = 8


class LengthError(ValueError):
    """Lengths cannot be drawn or replayed; the message says from where and why."""


def draw_lengths(
    spec: LengthSpec,
    groups: int,
    samples_per_group: int,
    rng: np.random.Generator,
    first: int = 0,
) -> np.ndarray:
    """Response tokens, shape (groups, samples_per_group), each in [1, spec.max_tokens].

    ``first`` is the index of the first group drawn (kind ``groups`` cycles from it).
    """
    shape = (groups, samples_per_group)
    if spec.kind == "constant":
        raw = np.full(shape, spec.median)
    elif spec.kind == "groups":
        assert spec.groups is not None  # the spec's validator guarantees it
        given = np.asarray(spec.groups, dtype=np.float64)
        raw = given[(first + np.arange(groups)) % len(given)]
    elif spec.kind == "replay":
        assert spec.replay is not None  # the spec's validator guarantees it
        table = replay_groups(spec.replay, samples_per_group)
        raw = table[rng.integers(0, len(table), size=groups)] * spec.replay_scale
    else:
        prompt = np.log(spec.median) + spec.group_sigma * rng.standard_normal((groups, 1))
        raw = np.exp(prompt + spec.sigma * rng.standard_normal(shape))
        if spec.kind == "mixture" and spec.tail_fraction > 0:
            tail = rng.random(shape) < spec.tail_fraction
            long = np.exp(np.log(spec.tail_median) + spec.tail_sigma * rng.standard_normal(shape))
            raw = np.where(tail, np.maximum(raw, long), raw)
    return np.clip(np.rint(raw), 1, spec.max_tokens).astype(np.int64)


def _trajectory_files(source: str) -> tuple[object, list[str]]:
    """The filesystem and the Parquet files of a run's trajectories."""
    import pyarrow.fs as pafs

    if "://" in source:
        filesystem, root = pafs.FileSystem.from_uri(source)
    else:
        filesystem, root = pafs.LocalFileSystem(), str(Path(source).resolve())
    root = root.rstrip("/")
    # The ledger records events, not lengths: from a run's ledger/ go to its trajectories/.
    parent = root.rsplit("/", 1)[0] if root.endswith("/ledger") else root
    candidates = [parent + "/trajectories", root]
    for folder in candidates:
        info = filesystem.get_file_info(folder)
        if info.type != pafs.FileType.Directory:
            continue
        selector = pafs.FileSelector(folder, recursive=False)
        files = sorted(
            f.path
            for f in filesystem.get_file_info(selector)
            if f.path.endswith(".parquet") and f.type == pafs.FileType.File
        )
        if files:
            return filesystem, files
    raise LengthError(
        f"no trajectory Parquet files under {source!r} (looked in {candidates}); pass a run "
        "folder such as runs/<name>, its trajectories/ folder, or the run's storage URL"
    )


def replay_groups(source: str, samples_per_group: int) -> np.ndarray:
    """Whole groups of response lengths from a run, shape (groups, samples_per_group).

    A recorded group with more samples than ``samples_per_group`` keeps its first ones; one
    with fewer (a smaller group size in the recorded run) is filled by resampling its own
    lengths, so a group's spread stays its own.
    """
    import pyarrow.parquet as pq

    filesystem, files = _trajectory_files(source)
    by_group: dict[str, list[int]] = {}
    for path in files:
        with filesystem.open_input_file(path) as handle:  # type: ignore[attr-defined]
            names = pq.read_schema(handle).names
            missing = {"group_id", "response_len"} - set(names)
            if missing:
                raise LengthError(
                    f"{path} has no {sorted(missing)} column: not trajectory rows "
                    "(storage/schema.py)"
                )
            handle.seek(0)
            table = pq.read_table(handle, columns=["group_id", "response_len"])
        for group, length in zip(
            table.column("group_id").to_pylist(),
            table.column("response_len").to_pylist(),
            strict=True,
        ):
            by_group.setdefault(group, []).append(int(length))
    if len(by_group) < MIN_REPLAY_GROUPS:
        raise LengthError(
            f"{source!r} holds {len(by_group)} groups of trajectories; replay needs at least "
            f"{MIN_REPLAY_GROUPS}"
        )
    rng = np.random.default_rng(0)  # the fill-in of short groups is part of the replayed data
    rows = []
    for group in sorted(by_group):
        lengths = by_group[group]
        if len(lengths) >= samples_per_group:
            rows.append(lengths[:samples_per_group])
        else:
            extra = rng.choice(lengths, size=samples_per_group - len(lengths))
            rows.append(lengths + [int(x) for x in extra])
    return np.asarray(rows, dtype=np.float64)
