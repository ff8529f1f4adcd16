"""LoRA adapters: the trainer's (peft) and the folders that carry them into vLLM.

With ``train.lora`` set the trainer (``engines/train/trainer.py``) wraps its model with
``attach``: the base weights are frozen and only the adapters train, so it publishes,
checkpoints and saves ``adapter_state`` (peft's tensor names, which vLLM reads) instead of
the full weights. A rollout engine (``engines/rollout/vllm_engine.py``) writes each version it
pulls into its adapter folder with ``write_adapter`` and has vLLM reload that adapter in
place. Both sides build the adapter's config here, from the same ``LoraConfig``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import safe_open

from sluice.config.tree import VLLM_LORA_RANKS, LoraConfig
from sluice.storage.torch_state import tensors_to_bytes

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_config(lora: LoraConfig, base: str) -> PeftLoraConfig:
    """peft's config for ``lora`` over the base model folder ``base``."""
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name part of each linear module of ``model`` (what target_modules names)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
    )


def check_targets(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Raise a ValueError naming the model's linear modules unless it has every target."""
    have = linear_names(model)
    missing = [t for t in lora.target_modules if t not in have]
    if missing:
        raise ValueError(
            f"train.lora.target_modules {missing} are not linear modules of "
            f"{type(model).__name__}; its linear modules are: {', '.join(have)}"
        )


def attach(model: torch.nn.Module, lora: LoraConfig, base: str) -> PeftModel:
    """``model`` with adapters on ``lora.target_modules`` and every base weight frozen.
    Adapters start as peft makes them (B = 0), so the wrapped model computes the base's
    outputs exactly until the first step."""
    check_targets(model, lora)
    return get_peft_model(model, peft_config(lora, base))


def check_base(folder: Path, lora: LoraConfig) -> None:
    """Raise a ValueError unless the model folder ``folder`` can carry ``lora``'s adapters:
    vLLM serves adapters for its architecture, and it has every target module. Reads the
    config only (the model is laid out on the meta device, no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    config = AutoConfig.from_pretrained(folder)
    for arch in config.architectures or []:
        served = ModelRegistry._try_load_model_cls(arch)  # vLLM 0.32: its class, or None
        if served is not None and not supports_lora(served):
            raise ValueError(
                f"vLLM cannot load LoRA adapters into {arch} (the architecture of {folder}): "
                "unset train.lora to train the full weights"
            )
    with torch.device("meta"):
        check_targets(AutoModelForCausalLM.from_config(config), lora)


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors by peft's names (``base_model.model.<module>.lora_A.weight``),
    live (not copies): what a rollout engine and a checkpoint receive."""
    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: PeftModel, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapter's tensors from ``tensors`` (``adapter_state``'s names); raises when
    they are not this adapter's (another rank or other target modules)."""
    want = get_peft_model_state_dict(model)
    if set(tensors) != set(want) or any(tensors[k].shape != want[k].shape for k in want):
        theirs = {k: tuple(v.shape) for k, v in tensors.items()}
        ours = {k: tuple(v.shape) for k, v in want.items()}
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise ValueError(
            f"the checkpoint's adapter does not fit train.lora (rank, target_modules): "
            f"tensors that differ include {differ}"
        )
    set_peft_model_state_dict(model, tensors)


_ADAPTER_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every weight in a model folder's safetensors files, read from their
    headers (nothing is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def adapter_misfit(
    tensors: Mapping[str, torch.Tensor], base: Mapping[str, tuple[int, ...]], lora: LoraConfig
) -> str | None:
    """Why the adapter ``tensors`` (peft's names) would not reach the modules they name in a
    base model of these weight shapes (``weight_shapes``), or None when every tensor fits.

    vLLM applies an adapter's tensors by module name and passes over a name the model lacks
    without a word, so an adapter pushed to the wrong module would leave the engine serving
    the base model while the trainer trains the adapter (verl-project/verl#7495). Caught
    here: a name not of peft's form, a module outside ``lora.target_modules``, one the base
    lacks, and a shape that does not fit the module at ``lora.rank``. A tensor moved to
    another module of the very same shape is not."""
    for name in sorted(tensors):
        match = _ADAPTER_NAME.fullmatch(name)
        if match is None:
            return f"adapter tensor {name!r} is not named base_model.model.<module>.lora_A/B.weight"
        module, part = match.groups()
        if module.rsplit(".", 1)[-1] not in lora.target_modules:
            return (
                f"adapter tensor {name!r} adapts {module}, which is not one of "
                f"train.lora.target_modules ({', '.join(lora.target_modules)})"
            )
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            return (
                f"adapter tensor {name!r} adapts {module}, which the base model has no linear "
                "weight for"
            )
        out_features, in_features = weight
        want = (lora.rank, in_features) if part == "A" else (out_features, lora.rank)
        if tuple(tensors[name].shape) != want:
            return (
                f"adapter tensor {name!r} has shape {tuple(tensors[name].shape)}, but {module} "
                f"({out_features}x{in_features}) takes {want} at rank {lora.rank}"
            )
    return None


def adapter_config_json(lora: LoraConfig, base: str) -> bytes:
    """``adapter_config.json`` for ``lora`` over ``base``, as peft writes it."""
    config = peft_config(lora, base).to_dict()
    return json.dumps(config, indent=2, sort_keys=True, default=sorted).encode()


def write_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base: str
) -> None:
    """Write an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
    that peft and vLLM load; each file is replaced whole (written beside, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (
        (ADAPTER_CONFIG, adapter_config_json(lora, base)),
        (ADAPTER_FILE, tensors_to_bytes(tensors)),
    ):
        part = folder / f".{name}.part"
        part.write_bytes(data)
        os.replace(part, folder / name)


def read_adapter(folder: Path) -> tuple[str, LoraConfig]:
    """An adapter folder's base model folder and its LoRA settings (``adapter_config.json``,
    as ``write_adapter`` or peft wrote it)."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        lora = LoraConfig(
            rank=config["r"],
            alpha=config["lora_alpha"],
            dropout=config.get("lora_dropout", 0.0),
            target_modules=sorted(config["target_modules"]),
        )
        base = str(config["base_model_name_or_path"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder} is not a LoRA adapter folder peft wrote: {err}") from err
    if not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"the adapter in {folder} adapts the model folder {base}, which is not on this "
            "machine: copy the base there, or export the policy with train.lora.merged_export"
        )
    return base, lora


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def vllm_max_rank(rank: int) -> int:
    """The smallest adapter rank vLLM reserves room for that holds ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)
