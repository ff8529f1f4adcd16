"""Small filesystem helpers shared by the ledger and checkpoint stores.

They hide the one difference that matters for durability: on a local disk a file is written
under a temporary name, fsynced and renamed into place; on S3 a single put is already atomic.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable
from typing import BinaryIO

import fsspec

from sluice.storage.urls import is_local


def join(*parts: str) -> str:
    """Join path parts with ``/`` (fsspec paths use ``/`` on every filesystem)."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


def random_suffix() -> str:
    return secrets.token_hex(4)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local(path: str, data: bytes, *, atomic: bool) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    target = f"{path}.tmp-{random_suffix()}" if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)
    _fsync_dir(folder)


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, atomic: bool) -> None:
    """Write ``data`` to ``path``, durably; with ``atomic`` readers never see a partial file."""
    if is_local(fs):
        _write_local(path, data, atomic=atomic)
    else:
        fs.pipe_file(path, data)


def write_chunks(
    fs: fsspec.AbstractFileSystem, path: str, chunks: Iterable[bytes | memoryview]
) -> tuple[str, int]:
    """Write ``chunks`` to ``path`` as they come, durably (not atomically: a checkpoint's
    manifest, written last, is what makes its files count); returns the sha256 and size."""
    digest, size = hashlib.sha256(), 0

    def copy(f: BinaryIO) -> None:
        nonlocal size
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
            size += memoryview(chunk).nbytes
            del chunk  # let go before the next is made

    if is_local(fs):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        with open(path, "wb") as f:
            copy(f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(folder)
    else:
        with fs.open(path, "wb") as f:  # s3fs: a multipart upload, a block at a time
            copy(f)
    return digest.hexdigest(), size


def digest_file(fs: fsspec.AbstractFileSystem, path: str, block: int = 1 << 23) -> tuple[str, int]:
    """The sha256 and size of the file at ``path``, read a block at a time."""
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    return bytes(fs.cat_file(path))


def list_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Base names of the entries directly under ``folder``; empty when it does not exist."""
    try:
        entries = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    names = {basename(str(e)) for e in entries}
    names.discard(basename(folder))
    return sorted(names)


def file_sizes(fs: fsspec.AbstractFileSystem, folder: str) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``folder`` (recursively)."""
    try:
        found = fs.find(folder, detail=True)
    except FileNotFoundError:
        return {}
    prefix = folder.rstrip("/") + "/"
    return {
        str(p)[len(prefix) :]: int(info.get("size") or 0)
        for p, info in found.items()
        if str(p).startswith(prefix) and info.get("type") != "directory"
    }


def remove_tree(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete ``path`` and everything under it; a missing path is not an error."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        return


def rename_dir(src: str, dst: str) -> None:
    """Atomically rename a local folder (only called on local filesystems)."""
    os.rename(src, dst)
    _fsync_dir(os.path.dirname(dst.rstrip("/")))
