"""``policy.path`` is checked before anything starts: a Hugging Face model folder with a
config, a tokenizer and safetensors weights. A folder with only pickled weights
(``pytorch_model.bin``) is refused by name: nothing is unpickled from storage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sluice.config.tree import ConfigError, load_config
from sluice.driver.environment import check_agent, check_model_folder


def _folder(tmp_path: Path, *files: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ((), "has no config.json"),
        (("config.json", "tokenizer.json"), r"has no \*\.safetensors weights$"),
        (
            ("config.json", "tokenizer.json", "pytorch_model.bin"),
            r"it has pytorch_model\.bin: pickled weights, which Sluice does not load; save the "
            r"model with save_pretrained\(\.\.\., safe_serialization=True\)",
        ),
        (("config.json", "model.safetensors"), "has no tokenizer"),
    ],
)
def test_a_model_folder_without_what_a_run_loads_is_refused_by_name(
    tmp_path: Path, files: tuple[str, ...], message: str
) -> None:
    folder = _folder(tmp_path, *files)
    cfg = load_config(None, [f"policy.path={folder}"])
    with pytest.raises(ConfigError, match=message):
        check_model_folder(cfg)


def test_a_missing_folder_and_a_complete_one(tmp_path: Path) -> None:
    cfg = load_config(None, [f"policy.path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="is not a folder"):
        check_model_folder(cfg)
    folder = _folder(tmp_path, "config.json", "tokenizer.json", "model.safetensors")
    check_model_folder(load_config(None, [f"policy.path={folder}"]))  # raises nothing


def test_the_tests_bpe_model_folder_passes(bpe_policy: Path) -> None:
    check_model_folder(load_config(None, [f"policy.path={bpe_policy}"]))


def _agent_config(folder: Path):
    return load_config(None, ["env.agent=tests.support.agents:two_turns", f"policy.path={folder}"])


def test_an_agent_needs_a_chat_template_that_opens_the_assistants_turn(
    bpe_policy: Path, tmp_path: Path
) -> None:
    check_agent(_agent_config(bpe_policy))  # ChatML with a generation prompt: fine
    copy = tmp_path / "model"
    shutil.copytree(bpe_policy, copy)
    template = copy / "chat_template.jinja"  # where save_pretrained writes it
    template.write_text(template.read_text().split("{% if add_generation_prompt")[0])
    with pytest.raises(ConfigError, match="has no generation prompt"):
        check_agent(_agent_config(copy))
    template.unlink()
    with pytest.raises(ConfigError, match="has no chat template"):
        check_agent(_agent_config(copy))


def test_an_agent_that_wants_what_a_run_does_not_pass_is_refused(bpe_policy: Path) -> None:
    cfg = load_config(None, ["env.agent=tests.support.agents:plain", f"policy.path={bpe_policy}"])
    check_agent(cfg)
    with pytest.raises(ConfigError, match="does not import"):
        check_agent(
            load_config(
                None, ["env.agent=tests.support.nowhere:agent", f"policy.path={bpe_policy}"]
            )
        )
    check_agent(load_config(None, ["env.agent=tests.support.agents:plain"]))  # tiny chat policy
    with pytest.raises(ConfigError, match=r"'guessing' is multi-turn; set policy\.path"):
        check_agent(
            load_config(None, ["env.agent=tests.support.agents:plain", "env.name=guessing"])
        )


def test_lora_is_checked_against_the_model_folder_before_anything_starts(
    tmp_path: Path, bpe_policy: Path
) -> None:
    """Target modules the model lacks are named with its own; an architecture vLLM serves
    no adapters for (GPT-2 in vLLM 0.32) is refused; a llama with the defaults passes."""
    from transformers import GPT2Config

    from sluice.driver.environment import check_lora

    lora = "train.lora={target_modules: [q_proj, c_attn]}"
    with pytest.raises(ConfigError, match=r"\['c_attn'\] are not linear modules of .*q_proj"):
        check_lora(load_config(None, [f"policy.path={bpe_policy}", lora]))
    check_lora(load_config(None, [f"policy.path={bpe_policy}", "train.lora={}"]))
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        gpt2
    )
    with pytest.raises(ConfigError, match="vLLM cannot load LoRA adapters into GPT2LMHeadModel"):
        check_lora(load_config(None, [f"policy.path={gpt2}", "train.lora={}"]))
