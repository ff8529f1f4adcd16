import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sluice.config.tree import PolicyConfig
from sluice.engines.agents.chat_template import TurnFormat
from sluice.engines.rollout.episodes import EpisodeSteps, StepSpec
from sluice.envs import ALPHABET, AdditionEnv
from sluice.envs.guessing import GuessingEnv
from sluice.policy.starting import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    build_model,
    build_platform,
    build_tokenizer,
    chat_prompt,
    check_policy_folder,
    prepare_policy,
    save_policy,
)

TINY = PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64, warmstart_max_steps=0)


@pytest.mark.parametrize(
    "text",
    ["47+385=", "7+5=12,4+8+1=13,0+3+1=4|432", "3 5 7>22: (3*5)+7", ALPHABET, "  a  b  "],
    ids=["addition", "scratch", "countdown", "alphabet", "spaces"],
)
def test_tokenizer_round_trip_one_token_per_char(text):
    tok = build_tokenizer()
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID
    assert len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_unknown_char_maps_to_unk():
    tok = build_tokenizer()
    assert tok("é")["input_ids"][1] == tok.unk_token_id


def test_saved_policy_round_trips_through_transformers(tmp_path):
    tok = build_tokenizer()
    model = build_model(TINY, vocab_size=len(tok), seed=0)
    save_policy(model, tok, tmp_path)
    check_policy_folder(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded_tok("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    assert loaded.config.eos_token_id == EOS_ID
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_model_is_deterministic_from_seed():
    a = build_model(TINY, vocab_size=99, seed=3).state_dict()
    b = build_model(TINY, vocab_size=99, seed=3).state_dict()
    c = build_model(TINY, vocab_size=99, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_check_policy_folder_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_policy_folder(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        check_policy_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        check_policy_folder(tmp_path)


def test_prepare_policy_builds_once_then_reuses(tmp_path):
    env = AdditionEnv(digits=2)
    cfg = TINY.model_copy(update={"warmstart_max_steps": 2, "warmstart_eval_every": 1})
    first = prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    report = json.loads((first / "warmstart.json").read_text())
    assert report["steps"] == 2
    again = prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    other = prepare_policy(cfg, env, "sig", seed=1, cache_dir=tmp_path)
    assert other != first
    assert not list((tmp_path / "policies").glob(".building-*"))


def test_a_warm_start_is_the_same_bit_for_bit_whatever_the_callers_threads(tmp_path):
    """Same config and seed on one machine kind: the same weights and the same stopping
    step, built from a process on 1 thread and on 3 (the warm start fixes its own)."""
    env = AdditionEnv(digits=2)
    cfg = TINY.model_copy(update={"warmstart_max_steps": 12, "warmstart_eval_every": 4})
    before = torch.get_num_threads()
    folders = []
    try:
        for threads, cache in ((1, "a"), (3, "b")):
            torch.set_num_threads(threads)
            folders.append(prepare_policy(cfg, env, "sig", seed=5, cache_dir=tmp_path / cache))
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    first, second = ((f / "model.safetensors").read_bytes() for f in folders)
    assert first == second
    reports = [json.loads((f / "warmstart.json").read_text()) for f in folders]
    assert reports[0]["steps"] == reports[1]["steps"] == 12
    assert reports[0]["heldout_accuracy"] == reports[1]["heldout_accuracy"]
    assert reports[0]["platform"] == build_platform()


def test_the_cache_key_names_the_machine_kind(tmp_path, monkeypatch):
    """A policy built with other kernels (another CPU's vector instructions) is not reused."""
    env = AdditionEnv(digits=2)
    here = prepare_policy(TINY, env, "sig", seed=0, cache_dir=tmp_path)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")
    elsewhere = prepare_policy(TINY, env, "sig", seed=0, cache_dir=tmp_path)
    assert elsewhere != here


def test_prepare_policy_uses_a_given_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_policy(
            PolicyConfig(path=str(tmp_path / "missing")), AdditionEnv(), "s", 0, tmp_path
        )


def test_a_chat_policy_warm_starts_on_the_prompts_its_endpoint_renders(tmp_path):
    env = AdditionEnv(digits=2, scratch=False)
    cfg = TINY.model_copy(update={"warmstart_max_steps": 1, "warmstart_eval_every": 1})
    folder = prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path, chat=True)
    assert folder != prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    turns = TurnFormat(tokenizer)  # what the agent's chat sessions use
    prompt = env.problems("train", 1, seed=0)[0].prompt
    session = tokenizer(
        turns.first([{"role": "user", "content": prompt}]), add_special_tokens=False
    )
    warm_start = tokenizer(chat_prompt(tokenizer, prompt))
    assert session["input_ids"] == warm_start["input_ids"]
    assert warm_start["input_ids"][0] == BOS_ID and chat_prompt(tokenizer, prompt).endswith(
        f"user: {prompt} assistant: "
    )
    assert turns.after_turn([EOS_ID], [{"role": "user", "content": "Digits only."}]) == (
        " user: Digits only. assistant: "
    )
    with pytest.raises(ValueError, match="single-turn"):
        prepare_policy(cfg, GuessingEnv(), "sig", seed=0, cache_dir=tmp_path, chat=True)


def test_a_multi_turn_warm_start_plays_its_episodes_in_the_step_process(tmp_path):
    env = GuessingEnv()
    cfg = TINY.model_copy(update={"warmstart_max_steps": 1, "warmstart_eval_every": 1})
    with pytest.raises(ValueError, match="needs its steps"):
        prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path)
    steps = EpisodeSteps(StepSpec("guessing"), timeout_s=30)
    try:
        folder = prepare_policy(cfg, env, "sig", seed=0, cache_dir=tmp_path, steps=steps)
    finally:
        steps.close()
    report = json.loads((folder / "warmstart.json").read_text())
    assert report["steps"] == 1  # measured before and after the step, through the process
