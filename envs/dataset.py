"""Prompts from a data file: JSONL, Parquet, or a folder saved by Hugging Face ``datasets``
(``save_to_disk``), on a local disk or any filesystem fsspec opens (``s3://``).

``DatasetEnv`` maps columns to problems: the prompt (plain text, or a list of chat messages
rendered with the policy's chat template), an optional reference answer, and further
columns that reach the reward functions as ``Problem.fields``. It has no verifier of its
own: a run scores it with the user's reward functions (``reward`` in the config).

Held-out problems come from a separate file, or from a stable hash of the prompt text
(about one in ``HELDOUT_MODULUS`` rows, as the built-in environments split theirs). The
data are scanned in record batches, never loaded whole: ``DatasetPrompts`` streams the
training rows in windows shuffled per epoch, and its cursor (epoch, rows taken) is what a
checkpoint keeps.
"""

from __future__ import annotations

import json
import posixpath
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from pyarrow.fs import FileSystem, FSSpecHandler, PyFileSystem

from sluice.envs.base import Problem, RewardResult, Split, check_split, split_of

# Rows read per record batch, and rows shuffled together in the training stream: the
# driver holds at most about this many rows of the data at once.
BATCH_ROWS = 4096
WINDOW_ROWS = 4096

_JSON = (".jsonl", ".json")
Messages = list[dict[str, str]]
Renderer = Callable[[Messages], str]


@dataclass(frozen=True)
class Columns:
    """Which columns are the prompt, the reference answer, and the reward's further fields."""

    prompt: str = "prompt"
    answer: str | None = "answer"
    fields: tuple[str, ...] = ()

    @property
    def read(self) -> list[str]:
        names = [self.prompt, *([self.answer] if self.answer else []), *self.fields]
        return list(dict.fromkeys(names))


class DataError(ValueError):
    """A data file or folder cannot be used; the message says what is wrong and the fix."""


def _local(fs: Any) -> bool:
    return fs is None or "file" in getattr(fs, "protocol", ("file",))


class DataSource:
    """One data file or folder, read in record batches of the columns asked for.

    ``filesystem``: an fsspec filesystem for ``path`` (None: the local disk).
    """

    def __init__(self, path: str, filesystem: Any = None, split: str = "train") -> None:
        self.path, self.filesystem, self.split = path, filesystem, split
        fs = filesystem
        self._fs: FileSystem | None = None if _local(fs) else PyFileSystem(FSSpecHandler(fs))
        self._exists, self._isdir, self._open = self._probes()
        if not self._exists(path):
            raise DataError(f"data {path!r} does not exist")
        self._arrow_files: list[str] | None = None
        self._format: str | None = None
        if self._isdir(path) and self._exists(posixpath.join(path, "dataset_dict.json")):
            splits = json.loads(self._read(posixpath.join(path, "dataset_dict.json")))["splits"]
            if split not in splits:
                raise DataError(
                    f"data {path!r} is a datasets folder with the splits {', '.join(splits)}; "
                    f"it has no {split!r} (set env.data.split)"
                )
            self._arrow_files = self._hf_files(posixpath.join(path, split))
        elif self._isdir(path) and self._exists(posixpath.join(path, "state.json")):
            self._arrow_files = self._hf_files(path)
        else:
            named = self._data_files() if self._isdir(path) else [path]
            fmt = self._format = "json" if named[0].endswith(_JSON) else "parquet"
            try:
                self._dataset().schema  # noqa: B018 - reading it surfaces a bad file here
            except (pa.ArrowInvalid, OSError) as error:
                raise DataError(
                    f"data {path!r} cannot be read as {fmt} ({error}); give a .jsonl, .parquet "
                    "or a folder saved by datasets' save_to_disk"
                ) from None

    def _data_files(self) -> list[str]:
        """A folder's data files: its JSONL files if it has any, else every other file
        (Parquet), in path order; hidden files and ``_``-prefixed markers left out."""
        if _local(self.filesystem):
            import os

            found = [
                os.path.join(top, f)
                for top, _, files in os.walk(self.path)
                for f in files
                if not f.startswith((".", "_"))
            ]
        else:
            found = [
                f
                for f in self.filesystem.find(self.path)
                if not posixpath.basename(f).startswith((".", "_"))
            ]
        if not found:
            raise DataError(f"data folder {self.path!r} holds no data files")
        json_files = [f for f in found if f.endswith(_JSON)]
        return sorted(json_files or found)

    def _dataset(self) -> pads.Dataset:
        files = self._data_files() if self._isdir(self.path) else self.path
        return pads.dataset(files, format=self._format, filesystem=self._fs)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_exists", "_isdir", "_open")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._exists, self._isdir, self._open = self._probes()

    def _probes(self) -> tuple[Callable[[str], bool], Callable[[str], bool], Callable[..., Any]]:
        if _local(self.filesystem):
            import os

            return os.path.exists, os.path.isdir, open
        fs = self.filesystem
        return fs.exists, fs.isdir, fs.open

    def _read(self, path: str) -> str:
        with self._open(path, "rb") as f:
            return f.read().decode("utf-8")

    def _hf_files(self, folder: str) -> list[str]:
        state = json.loads(self._read(posixpath.join(folder, "state.json")))
        return [posixpath.join(folder, f["filename"]) for f in state["_data_files"]]

    @property
    def schema(self) -> pa.Schema:
        if self._format is not None:
            return self._dataset().schema
        assert self._arrow_files is not None
        with self._open(self._arrow_files[0], "rb") as f:
            return pa.ipc.open_stream(f).schema

    def batches(self, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
        for _, batch in self.file_batches(columns):
            yield batch

    def file_batches(self, columns: Sequence[str]) -> Iterator[tuple[str, pa.RecordBatch]]:
        """Record batches of ``columns`` with the file each comes from: its path below the
        folder for a folder of data files (one of several shards of a datasets folder), ""
        for a single file."""
        if self._format is not None:
            folder = self._isdir(self.path)
            for fragment in sorted(self._dataset().get_fragments(), key=lambda f: f.path):
                key = posixpath.relpath(fragment.path, self.path) if folder else ""
                for batch in fragment.to_batches(
                    columns=list(columns),
                    batch_size=BATCH_ROWS,
                    # One batch at a time: with threads the scanner decodes row groups ahead
                    # (30-40 MB of a 10 MB file in a measurement); the driver needs a few.
                    use_threads=False,
                    batch_readahead=1,
                ):
                    yield key, batch
            return
        assert self._arrow_files is not None
        for name in self._arrow_files:
            key = posixpath.basename(name) if len(self._arrow_files) > 1 else ""
            with self._open(name, "rb") as f:
                for batch in pa.ipc.open_stream(f):
                    yield key, batch.select(list(columns))


class DatasetEnv:
    """Problems from a data source (see the module docstring); no built-in verifier."""

    name = "dataset"

    def __init__(
        self,
        source: DataSource,
        columns: Columns,
        heldout: DataSource | None = None,
        render: Renderer | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.source, self.columns, self.heldout, self.render = source, columns, heldout, render
        self.skip = skip  # prompt ids of training rows to leave out (trained in earlier runs)

    def check(self) -> None:
        """The mapped columns exist and no prompt is empty; a ``DataError`` naming the first
        problem. Scans the prompt column only."""
        for source in (self.source, self.heldout):
            if source is None:
                continue
            names = source.schema.names
            missing = [c for c in self.columns.read if c not in names]
            if missing:
                raise DataError(
                    f"data {source.path!r} has no column {', '.join(map(repr, missing))}; its "
                    f"columns are {', '.join(names)} (set env.data.prompt / answer / fields)"
                )
            row = 0
            for batch in source.batches([self.columns.prompt]):
                column = batch.column(0)
                if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                    empty = pc.or_(pc.is_null(column), pc.equal(pc.utf8_length(column), 0))
                else:
                    empty = pc.or_(pc.is_null(column), pc.equal(pc.list_value_length(column), 0))
                hit = pc.index(empty, True).as_py()
                if hit != -1:
                    raise DataError(
                        f"data {source.path!r}: row {row + hit} has an empty prompt "
                        f"(column {self.columns.prompt!r}); remove the row or fill it"
                    )
                row += batch.num_rows
            pa.default_memory_pool().release_unused()

    def _problem(self, split: Split, row_id: str, row: dict[str, Any]) -> Problem:
        prompt = row[self.columns.prompt]
        if not isinstance(prompt, str):
            if self.render is None:
                raise DataError(
                    f"row {row_id}: the prompt is a list of chat messages, and the policy has "
                    "no chat template to render it (set policy.path to a model folder with one)"
                )
            prompt = self.render(list(prompt))
        answer = row.get(self.columns.answer) if self.columns.answer else None
        return Problem(
            prompt_id=f"{self.name}/{split}/{row_id}",
            env=self.name,
            prompt=prompt,
            answer="" if answer is None else str(answer),
            split=split,
            fields={f: row[f] for f in self.columns.fields},
        )

    def rows(self, split: Split) -> Iterator[tuple[str, dict[str, Any]]]:
        """(row id, row) of ``split`` in file order: the row's number in its file, after
        the file's path for a folder of files (``part-2.parquet/17``), so that a file added
        later leaves the other rows' ids as they were. Training rows whose
        prompt id is in ``skip`` are left out."""
        source = self.heldout if split == "heldout" and self.heldout else self.source
        hashed = self.heldout is None
        file, index = None, 0
        for key, batch in source.file_batches(self.columns.read):
            if key != file:
                file, index = key, 0
            for row in batch.to_pylist():
                row_id = f"{key}/{index}" if key else str(index)
                index += 1
                if hashed and split_of(self.name, _canonical(row[self.columns.prompt])) != split:
                    continue
                if split == "train" and f"{self.name}/train/{row_id}" in self.skip:
                    continue
                yield row_id, row

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """The first ``n`` problems of ``split`` in file order (``seed`` is not used: a data
        file's order is its own; the training stream shuffles)."""
        checked = check_split(split)
        out: list[Problem] = []
        for row_id, row in self.rows(checked):
            if len(out) == n:
                break
            out.append(self._problem(checked, row_id, row))
        return out

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        raise RuntimeError(
            "a dataset environment has no verifier of its own: name reward functions in the "
            "config (reward: mypkg.rewards:exact_match)"
        )

    def stream(self, seed: int) -> DatasetPrompts:
        return DatasetPrompts(self, seed)


def _canonical(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


class DatasetPrompts:
    """The training rows as a stream: windows of ``WINDOW_ROWS`` rows in file order, each
    shuffled by a seed of its own, epoch after epoch. ``cursor``/``restore`` as
    ``PromptStream``'s: the stream resumes at the row it stood at."""

    def __init__(self, env: DatasetEnv, seed: int) -> None:
        self.env, self.seed = env, seed
        self.epoch, self.taken = 1, 0  # rows of this epoch handed out
        self._rows: Iterator[tuple[str, dict[str, Any]]] = iter(())
        self._window: list[tuple[str, dict[str, Any]]] = []
        self._windows = 0  # windows read this epoch
        self._restart()

    def _restart(self) -> None:
        self._rows, self._window, self._windows = self.env.rows("train"), [], 0

    def _fill(self) -> None:
        window = [row for _, row in zip(range(WINDOW_ROWS), self._rows, strict=False)]
        if not window:
            if self._windows == 0:
                raise DataError(f"data {self.env.source.path!r} has no training rows")
            self.epoch, self.taken = self.epoch + 1, 0
            self._restart()
            return self._fill()
        # Arrow's allocator keeps the pages of decoded batches; hand them back each window,
        # so that the driver's memory stays flat however far the stream goes.
        pa.default_memory_pool().release_unused()
        random.Random(f"{self.seed}/{self.epoch}/{self._windows}").shuffle(window)
        self._windows += 1
        self._window = window[::-1]  # pop() from the end hands them out in shuffled order

    def take(self, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            if not self._window:
                self._fill()
            row_id, row = self._window.pop()
            self.taken += 1
            out.append(self.env._problem("train", row_id, row))
        return out

    def cursor(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "taken": self.taken}

    # A copy (the dispatcher's, in async) reopens the data where the stream stood.
    def __getstate__(self) -> dict[str, Any]:
        return {"env": self.env, "seed": self.seed, "cursor": self.cursor()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.env, self.seed = state["env"], state["seed"]
        self.restore(state["cursor"])

    def restore(self, cursor: dict[str, Any]) -> None:
        self.epoch, taken = int(cursor["epoch"]), int(cursor["taken"])
        self._restart()
        self.taken = 0
        while self.taken + len(self._window) < taken:  # skip whole windows
            self.taken += len(self._window)
            self._window = []
            self._fill()
        del self._window[len(self._window) - (taken - self.taken) :]
        self.taken = taken
