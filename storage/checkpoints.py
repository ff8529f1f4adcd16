"""Atomic checkpoints: named files plus a manifest, under ``<url>/checkpoints/step-NNNNNNNN/``.

Driven by the trainer, which saves every few steps and loads the newest valid checkpoint on
restart. The manifest (sha256 and size of every file, the step, meta, a format version) is
written last, and its presence is what makes a checkpoint valid. On a local disk the files
go to ``step-NNNNNNNN.tmp-<random>/`` first and the folder is renamed into place; on S3,
where rename is a copy, the files go straight into the final folder, manifest last. A
corrupt or incomplete newest checkpoint is skipped with a warning in favour of the previous
one; pruning keeps the newest ones that verify against their checksums, and a save that
died between its renames is put back in place before anything is listed or loaded. A
checkpoint is verified by reading each file a block at a time; its loaded files are read
from storage when asked for (``CheckpointFiles``: a safetensors file tensor by tensor), so
neither a save nor a load holds a whole model. Tensor, optimizer and RNG state are packed
with ``storage.torch_state`` (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sluice.storage import fsio
from sluice.storage.faults import fault_point
from sluice.storage.safetensors_stream import StoredTensors, Streamed
from sluice.storage.urls import is_local, open_url, redact, url_of

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_FINAL = re.compile(r"^step-(\d{8,})$")
_STALE = re.compile(r"^step-(\d{8,})\.(tmp|old)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt or incomplete; the message says which and why."""


class CheckpointFiles(Mapping[str, bytes]):
    """A saved checkpoint's files, read from its folder when asked for: ``files[name]`` the
    whole file, ``tensors(name)`` a safetensors file tensor by tensor, by byte range. It
    holds the store's URL and the folder's place under it, not the bytes, so a training
    pool's ranks each read what they need of it (S3 credentials come from the environment,
    as the store's own do)."""

    def __init__(self, store_url: str, folder: str, names: list[str]) -> None:
        self._store_url, self._folder, self._names = store_url, folder, names

    def _path(self, name: str) -> tuple[Any, str]:
        if name not in self._names:
            raise KeyError(name)
        fs, root = open_url(self._store_url)
        return fs, fsio.join(root, "checkpoints", self._folder, name)

    def __getitem__(self, name: str) -> bytes:
        return fsio.read_bytes(*self._path(name))

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def tensors(self, name: str) -> StoredTensors:
        fs, path = self._path(name)

        def read(offset: int, size: int) -> bytes:
            with fs.open(path, "rb") as f:
                f.seek(offset)
                return bytes(f.read(size))

        return StoredTensors(read)


def tensors_of(files: Mapping[str, bytes], name: str) -> StoredTensors:
    """The tensors of the safetensors file ``name`` of ``files``, each read when asked for
    (from storage for a saved checkpoint's files, else from the bytes in hand)."""
    if isinstance(files, CheckpointFiles):
        return files.tensors(name)
    return StoredTensors.of_bytes(files[name])


@dataclass(frozen=True)
class Checkpoint:
    step: int
    meta: dict[str, Any]
    files: Mapping[str, bytes] = field(repr=False)
    url: str = ""


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def _check_file_name(name: str) -> None:
    parts = name.split("/")
    if name == MANIFEST or not name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid checkpoint file name {name!r}")


def file_entry(data: bytes) -> tuple[str, int]:
    """A file's manifest entry: its sha256 and size."""
    return hashlib.sha256(data).hexdigest(), len(data)


def make_manifest(step: int, entries: dict[str, tuple[str, int]], meta: dict[str, Any]) -> bytes:
    """The manifest of a checkpoint whose files have ``entries`` (sha256 and size by name),
    as JSON bytes (raises ValueError if meta is not JSON)."""
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "meta": meta,
        "files": {
            name: {"sha256": sha, "size": size} for name, (sha, size) in sorted(entries.items())
        },
        "created_at": datetime.now(UTC).isoformat(),
    }
    try:
        return json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint meta must be plain JSON data: {err}") from err


def _parse_manifest(raw: bytes, step: int) -> dict[str, Any]:
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"manifest is not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError("manifest has no 'files' table")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"manifest format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}"
        )
    if manifest.get("step") != step:
        raise CheckpointError(f"manifest says step {manifest.get('step')!r}")
    return manifest


def _verify(name: str, got: tuple[str, int], entry: Any) -> None:
    """Raise unless a file's sha256 and size (``got``) are its manifest ``entry``'s."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"manifest entry for {name!r} is malformed")
    sha, size = got
    if size != entry.get("size"):
        raise CheckpointError(f"{name!r} has {size} bytes, manifest says {entry.get('size')}")
    if sha != entry.get("sha256"):
        raise CheckpointError(f"{name!r} does not match its sha256 checksum")


class CheckpointStore:
    """Saves and loads checkpoints under ``<url>/checkpoints/``, keeping the last N valid."""

    def __init__(self, url: str, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.url = redact(url)
        self._url = url  # what the files of a loaded checkpoint are opened by
        self.keep_last = keep_last
        self._fs, root = open_url(url)
        self._dir = fsio.join(root, "checkpoints")

    def _path(self, step: int) -> str:
        return fsio.join(self._dir, folder_name(step))

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, files: Mapping[str, bytes | Streamed], meta: dict[str, Any]) -> str:
        """Write a checkpoint atomically, prune old ones; returns the checkpoint's URL. A
        ``Streamed`` file is written as its chunks are made (a sharded engine's weights,
        gathered one tensor at a time), and checksummed as it goes."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        for name in files:
            _check_file_name(name)
        make_manifest(step, {}, meta)  # meta that is not JSON is refused before any write
        final = self._path(step)
        if is_local(self._fs):
            self._save_local(final, files, step, meta)
        else:
            self._save_direct(final, files, step, meta)
        self.prune(written=step)
        return url_of(self._fs, final)

    def _write_files(
        self, folder: str, files: Mapping[str, bytes | Streamed], step: int, meta: dict[str, Any]
    ) -> None:
        entries = {}
        for i, (name, data) in enumerate(files.items()):
            if i == len(files) // 2:
                fault_point("checkpoint.write")  # tests: a write that dies half way
            path = fsio.join(folder, name)
            if isinstance(data, Streamed):
                entries[name] = fsio.write_chunks(self._fs, path, data.chunks)
            else:
                fsio.write_bytes(self._fs, path, data, atomic=False)
                entries[name] = file_entry(data)
        manifest = make_manifest(step, entries, meta)
        fsio.write_bytes(self._fs, fsio.join(folder, MANIFEST), manifest, atomic=False)

    def _save_local(
        self, final: str, files: Mapping[str, bytes | Streamed], step: int, meta: dict[str, Any]
    ) -> None:
        tmp = f"{final}.tmp-{fsio.random_suffix()}"
        self._write_files(tmp, files, step, meta)
        old = None
        if self._fs.exists(final):
            old = f"{final}.old-{fsio.random_suffix()}"
            fsio.rename_dir(final, old)
        fsio.rename_dir(tmp, final)
        if old is not None:
            fsio.remove_tree(self._fs, old)

    def _save_direct(
        self, final: str, files: Mapping[str, bytes | Streamed], step: int, meta: dict[str, Any]
    ) -> None:
        # Object stores: un-validate any older copy first, then files, manifest last.
        fsio.remove_tree(self._fs, final)
        self._write_files(final, files, step, meta)

    def prune(self, written: int | None = None) -> None:
        """Keep the newest ``keep_last`` checkpoints that verify against their checksums;
        delete older ones and what interrupted saves left behind. ``written``: the step
        this process just saved (from the bytes it holds: not read back)."""
        self._recover()
        kept: list[int] = []
        for step in reversed(self._steps()):
            if len(kept) == self.keep_last:
                break
            if step == written or self._verifies(step):
                kept.append(step)
        oldest_kept = kept[-1] if len(kept) == self.keep_last else -1
        for name in fsio.list_names(self._fs, self._dir):
            final, stale = _FINAL.match(name), _STALE.match(name)
            doomed = (final and int(final.group(1)) < oldest_kept) or stale
            if doomed:
                fsio.remove_tree(self._fs, fsio.join(self._dir, name))

    def _recover(self) -> None:
        """Put back a checkpoint whose save died between its two renames (local disks).

        Saving step N over an existing copy renames ``step-N`` to ``step-N.old-*``, then
        ``step-N.tmp-*`` (the new copy) to ``step-N``. In between there is no ``step-N``:
        the complete one of the two is renamed into place, the new copy first.
        """
        if not is_local(self._fs):
            return
        names = fsio.list_names(self._fs, self._dir)
        finals = {int(m.group(1)) for m in map(_FINAL.match, names) if m}
        left: dict[int, list[tuple[str, str]]] = {}
        for m in filter(None, map(_STALE.match, names)):
            left.setdefault(int(m.group(1)), []).append((m.group(2), m.group(0)))
        for step, copies in left.items():
            if step in finals:
                continue
            for _, name in sorted(copies, key=lambda c: c[0] != "tmp"):  # tmp, then old
                folder = fsio.join(self._dir, name)
                if self._complete(folder, step):
                    fsio.rename_dir(folder, self._path(step))
                    logger.warning(
                        "checkpoint step %d: a save died between its renames; put back %s",
                        step,
                        name,
                    )
                    break

    # -- loading ---------------------------------------------------------------------------

    def _steps(self) -> list[int]:
        """Steps of every final-named folder, valid or not, ascending."""
        names = fsio.list_names(self._fs, self._dir)
        return sorted(int(m.group(1)) for m in map(_FINAL.match, names) if m)

    def _complete(self, folder: str, step: int) -> bool:
        """Manifest parses and every listed file exists with the right size (no checksums)."""
        try:
            manifest = _parse_manifest(fsio.read_bytes(self._fs, fsio.join(folder, MANIFEST)), step)
        except (FileNotFoundError, CheckpointError):
            return False
        sizes = fsio.file_sizes(self._fs, folder)
        return all(
            isinstance(entry, dict) and sizes.get(name) == entry.get("size")
            for name, entry in manifest["files"].items()
        )

    def _verifies(self, step: int) -> bool:
        """The checkpoint at ``step`` matches its checksums."""
        try:
            self.load(step)
        except CheckpointError:
            return False
        return True

    def list(self) -> list[int]:
        """Steps of the complete checkpoints, ascending (checksums are verified on load)."""
        self._recover()
        return [step for step in self._steps() if self._complete(self._path(step), step)]

    def load(self, step: int) -> Checkpoint:
        """Verify one checkpoint (each file checksummed a block at a time, none held whole)
        and return it, its files read from storage when asked for; raises
        ``CheckpointError`` saying what is wrong."""
        folder = self._path(step)
        try:
            raw = fsio.read_bytes(self._fs, fsio.join(folder, MANIFEST))
        except FileNotFoundError as err:
            raise CheckpointError("no manifest (incomplete checkpoint)") from err
        manifest = _parse_manifest(raw, step)
        for name, entry in manifest["files"].items():
            try:
                _check_file_name(name)
            except ValueError as err:
                raise CheckpointError(f"manifest lists {err}") from err
            try:
                got = fsio.digest_file(self._fs, fsio.join(folder, name))
            except FileNotFoundError as err:
                raise CheckpointError(f"file {name!r} is missing") from err
            _verify(name, got, entry)
        meta = manifest.get("meta")
        files = CheckpointFiles(self._url, folder_name(step), sorted(manifest["files"]))
        return Checkpoint(
            step, meta if isinstance(meta, dict) else {}, files, url_of(self._fs, folder)
        )

    def load_latest(self, check: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies, falling back past broken ones with a warning.

        ``check`` validates what the loader needs of a checkpoint's meta and files, raising
        ``CheckpointError``; a checkpoint that fails it is skipped like a corrupt one.
        """
        self._recover()
        for step in reversed(self._steps()):
            try:
                found = self.load(step)
                if check is not None:
                    check(found)
                return found
            except CheckpointError as err:
                logger.warning(
                    "checkpoint %s is unusable (%s); falling back to an older checkpoint",
                    url_of(self._fs, self._path(step)),
                    err,
                )
        return None
