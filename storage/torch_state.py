"""Pack torch model, optimizer and RNG state into checkpoint files without pickle.

Driven by the trainer, which hands the resulting ``{name: bytes}`` to
``storage.checkpoints.CheckpointStore.save`` and feeds loaded files back here. Tensors go to
safetensors; everything else (optimizer hyper-parameters, step counts, Python and NumPy RNG
state) goes to JSON, with tuples and non-string dict keys encoded so they come back exactly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from sluice.storage.checkpoints import tensors_of
from sluice.storage.safetensors_stream import Streamed, stream

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_JSON = "rng.json"
RNG_TENSORS = "rng_torch.safetensors"
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize a flat ``{name: tensor}`` dict (e.g. a state dict) with safetensors."""
    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.nbytes:
            t = t.clone()  # safetensors refuses tensors that share or view a larger storage
        seen.add(t.untyped_storage().data_ptr())
        flat[name] = t
    return bytes(st_save(flat))


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The inverse of ``tensors_to_bytes`` (tensors land on the CPU)."""
    return dict(st_load(data))


@dataclass(frozen=True)
class Gathered:
    """A tensor of ``like``'s dtype and shape (a meta tensor), made by ``make`` only when it
    is written: a sharded AdamW moment, gathered from the ranks."""

    like: torch.Tensor
    make: Callable[[], torch.Tensor]


Leaf = torch.Tensor | Gathered


def _encode(obj: Any, path: str, tensors: dict[str, Any]) -> Any:
    """A JSON-able copy of ``obj`` with tensors (and ``Gathered`` ones) moved into ``tensors``
    and referenced by key."""
    if isinstance(obj, torch.Tensor | Gathered):
        key = f"{path}#{len(tensors)}"
        tensors[key] = obj
        return {_TENSOR: key}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str | int):
                raise TypeError(f"cannot store dict key {key!r} at {path}")
            items.append([key, _encode(value, f"{path}.{key}", tensors)])
        return {_ITEMS: items}
    raise TypeError(f"cannot store a {type(obj).__name__} at {path} without pickle")


def _decode(obj: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _TUPLE in obj:
        return tuple(_decode(v, tensors) for v in obj[_TUPLE])
    return {key: _decode(value, tensors) for key, value in obj[_ITEMS]}


def streamed_state_files(
    state: Any, json_name: str, tensors_name: str
) -> dict[str, bytes | Streamed]:
    """Any nest of dicts/lists/tuples/scalars/tensors as a JSON file plus a safetensors
    file, the latter streamed: each ``Gathered`` leaf is made as it is written and let go
    before the next, so no more than one is held at a time. Every rank that gathers must
    read the stream through (``storage.safetensors_stream.drain``)."""
    leaves: dict[str, Leaf] = {}
    tree = _encode(state, "", leaves)
    layout = {k: v.like if isinstance(v, Gathered) else v for k, v in leaves.items()}
    return {
        json_name: json.dumps(tree).encode(),
        tensors_name: Streamed(stream(layout, _made(leaves))),
    }


def _made(leaves: dict[str, Leaf]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, leaf in leaves.items():
        yield key, leaf.make() if isinstance(leaf, Gathered) else leaf


class _Deferred(Mapping[str, Callable[[], torch.Tensor]]):
    """Each stored tensor as a call that reads it."""

    def __init__(self, stored: Mapping[str, torch.Tensor]) -> None:
        self._stored = stored

    def __getitem__(self, key: str) -> Callable[[], torch.Tensor]:
        if key not in self._stored:
            raise KeyError(key)
        return partial(self._stored.__getitem__, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def read_deferred(value: Any) -> Any:
    """A leaf of ``files_to_deferred_state``'s state read now (a call that reads a stored
    tensor), or the value itself (a number, or a tensor already in hand)."""
    return value() if callable(value) else value


def files_to_deferred_state(files: Mapping[str, bytes], json_name: str, tensors_name: str) -> Any:
    """The inverse of ``streamed_state_files``, every tensor a call that reads it: a loader that
    places or shards each tensor as it goes holds one full tensor at a time."""
    return _decode(json.loads(files[json_name]), _Deferred(tensors_of(files, tensors_name)))


def optimizer_to_files(
    optimizer: torch.optim.Optimizer, name: str = "optimizer"
) -> dict[str, bytes | Streamed]:
    """The optimizer's state dict as ``<name>.json`` + ``<name>.safetensors``
    (``optimizer.json`` + ``optimizer.safetensors`` by default), the tensors streamed from
    the live ones (no copy of the whole state is made)."""
    return streamed_state_files(optimizer.state_dict(), f"{name}.json", f"{name}.safetensors")


def load_optimizer(
    optimizer: torch.optim.Optimizer, files: Mapping[str, bytes], name: str = "optimizer"
) -> None:
    """Restore state written by ``optimizer_to_files`` under ``name``, one tensor in
    flight: torch's ``load_state_dict`` checks the groups, sets their hyper-parameters and
    drops the state the optimizer held, then each parameter's state is read from storage
    when its turn comes and placed as torch places it (its dtype and device; ``step`` as it
    was)."""
    saved = files_to_deferred_state(files, f"{name}.json", f"{name}.safetensors")
    groups = saved["param_groups"]
    optimizer.load_state_dict({"state": {}, "param_groups": groups})
    ids = [i for group in groups for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stray = sorted(set(saved["state"]) - set(ids), key=str)
    if stray:
        raise ValueError(f"optimizer state for parameters {stray[:5]} its groups do not list")
    place = torch.optim.Optimizer._process_value_according_to_param_policy
    for param_id, param in zip(ids, params, strict=True):
        entry = saved["state"].get(param_id)
        if entry is None:
            continue
        optimizer.state[param] = {
            key: place(param, value(), param_id, groups, key) if callable(value) else value
            for key, value in entry.items()
        }


def _byte_tensor(state: torch.Tensor) -> torch.Tensor:
    return state.detach().to("cpu", torch.uint8).clone()


def rng_state_files() -> dict[str, bytes]:
    """Python, NumPy (legacy global) and torch RNG states: the CPU's, and the current CUDA
    device's when there is one (only the device this actor owns: reading every visible
    device's state would open a CUDA context on each)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    doc = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    tensors = {"cpu": _byte_tensor(torch.get_rng_state())}
    if torch.cuda.is_available():
        tensors["cuda"] = _byte_tensor(torch.cuda.get_rng_state())
    return {RNG_JSON: json.dumps(doc).encode(), RNG_TENSORS: tensors_to_bytes(tensors)}


def restore_rng(files: Mapping[str, bytes]) -> None:
    """Restore the RNG states written by ``rng_state_files``."""
    doc = json.loads(files[RNG_JSON])
    py = doc["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = doc["numpy"]
    keys = np.asarray(npy["keys"], dtype=np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    tensors = bytes_to_tensors(files[RNG_TENSORS])
    torch.set_rng_state(tensors["cpu"])
    # "cuda": the owning device's state; "cuda.0", ...: every device's (older checkpoints)
    cuda = tensors.get("cuda", tensors.get("cuda.0"))
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
