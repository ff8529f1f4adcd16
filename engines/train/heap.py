"""What a trainer's start-up frees goes back to the operating system (glibc only).

Loading a model reads, converts and copies it a tensor at a time, and the start-up checks'
forward passes gather and free each layer's weights. glibc's allocator serves blocks under
its mmap threshold from its heap, and that threshold grows (up to 32 MiB) each time a
larger mapped block is freed; memory freed back to the heap stays resident. Measured with
`make bench-startup-memory` on SmolLM2-135M (FSDP2 at 2 ranks): a rank kept 1.78x the
model's float32 bytes of heap after start-up, of which its shard is 0.5x; with every block
of 64 KiB or more mapped on its own it kept 0.52x.

``returned_heap`` maps such blocks on their own while the trainer starts, then hands what
is free back (``malloc_trim``) and fixes the threshold at glibc's own ceiling, where its
dynamic threshold ends up in a training loop anyway. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
START_UP_THRESHOLD = 64 << 10
STEADY_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library's allocator calls, from the symbols this process already has (no
    library search, which runs ``ldconfig``); None where they are not glibc's."""
    libc = ctypes.CDLL(None)
    try:
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc has both; musl and macOS do not)
    except AttributeError:
        return None
    return libc


@contextmanager
def returned_heap() -> Iterator[None]:
    """Inside: blocks of 64 KiB and more are mapped on their own, and go back when freed.
    After: the heap's free memory is returned, and the thresholds are where glibc's dynamic
    ones end up (mapping from 32 MiB, trimming the heap's top above twice that): setting one
    turns their adjustment off."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, START_UP_THRESHOLD)
    try:
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(M_MMAP_THRESHOLD, STEADY_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * STEADY_THRESHOLD)
