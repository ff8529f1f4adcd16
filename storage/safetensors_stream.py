"""A safetensors file written as its tensors arrive, and read back one tensor at a time.

A sharded engine's checkpoint gathers each full tensor from the ranks in turn; held all at
once, that is the whole model and AdamW's two moments in float32 on one host (131 GB of
weights alone at 32B). A safetensors header needs only each tensor's name, dtype and shape,
which are known before anything is gathered, so the file can be written as the tensors come
and the writer holds one of them at a time. ``stream`` gives the file's bytes as chunks;
``storage.checkpoints.CheckpointStore.save`` takes them as a ``Streamed`` file. Read back,
``StoredTensors`` reads each tensor by its byte range when it is asked for.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

# torch dtype -> the safetensors dtype name (safetensors' own table, torch.py _TYPES).
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
NAMES = {name: dtype for dtype, name in DTYPES.items()}
ALIGN = 8  # the header is padded with spaces to this (safetensors does the same)
Chunk = bytes | memoryview


@dataclass(frozen=True)
class Streamed:
    """A file's bytes as chunks made while it is written: read once, in order."""

    chunks: Iterator[Chunk]


def drain(files: Mapping[str, bytes | Streamed]) -> None:
    """Read every streamed file through, writing nothing: a rank's part in the gathers of
    files another rank writes (in the same order)."""
    for data in files.values():
        if isinstance(data, Streamed):
            for _ in data.chunks:
                pass


def materialised(files: Mapping[str, bytes | Streamed]) -> dict[str, bytes]:
    """The files with every streamed one read into bytes (a checkpoint handed over in
    memory: tests, and loading into another engine in the same process)."""
    return {
        name: b"".join(bytes(c) for c in data.chunks) if isinstance(data, Streamed) else data
        for name, data in files.items()
    }


def header(layout: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding ``layout``'s
    tensors in its order (each given by a tensor of the name's dtype and shape: a meta
    tensor will do), with ``metadata`` (transformers looks for ``{"format": "pt"}``)."""
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, like in layout.items():
        if like.dtype not in DTYPES:
            raise TypeError(f"{name!r}: safetensors has no dtype for {like.dtype}")
        size = math.prod(like.shape) * like.element_size()
        entries[name] = {
            "dtype": DTYPES[like.dtype],
            "shape": list(like.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def stream(
    layout: Mapping[str, torch.Tensor],
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> Iterator[Chunk]:
    """The safetensors file of ``tensors``, which must come in ``layout``'s order with its
    dtypes and shapes: the header, then each tensor's bytes as it arrives (copied to the
    CPU one at a time). Raises ValueError at the first tensor that is not the layout's."""
    yield header(layout, metadata)
    expected = iter(layout.items())
    for name, tensor in tensors:
        want_name, like = next(expected, (None, None))
        if want_name != name or like is None:
            raise ValueError(f"tensor {name!r} came where the layout has {want_name!r}")
        if tensor.dtype != like.dtype or tuple(tensor.shape) != tuple(like.shape):
            raise ValueError(
                f"{name!r} is {tensor.dtype} {tuple(tensor.shape)}, the layout says "
                f"{like.dtype} {tuple(like.shape)}"
            )
        cpu = tensor.detach().to("cpu").contiguous()
        yield cpu.reshape(-1).view(torch.uint8).numpy().data  # a view: no copy of its own
        del cpu, tensor  # let go before the next is gathered
    missing = [name for name, _ in expected]
    if missing:
        raise ValueError(f"the stream ended without {missing[:5]} (of {len(missing)})")


class StoredTensors(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file by name, each read when asked for through
    ``read(offset, size)`` (a byte range of the file, in memory or in storage): reading a
    checkpoint's weights this way holds one tensor at a time."""

    def __init__(self, read: Callable[[int, int], bytes | memoryview]) -> None:
        (length,) = struct.unpack("<Q", bytes(read(0, 8)))
        try:
            entries = json.loads(bytes(read(8, length)))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a safetensors file: its header is not JSON ({err})") from err
        entries.pop("__metadata__", None)
        self._read, self._base, self._entries = read, 8 + length, entries

    @classmethod
    def of_bytes(cls, data: bytes) -> StoredTensors:
        view = memoryview(data)
        return cls(lambda offset, size: view[offset : offset + size])

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        dtype, shape = NAMES[entry["dtype"]], entry["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = bytearray(self._read(self._base + begin, end - begin))  # the tensor's own copy
        return torch.frombuffer(raw, dtype=dtype).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
