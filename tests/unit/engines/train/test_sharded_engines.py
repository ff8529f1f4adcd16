"""The sharded engines (DeepSpeed ZeRO, torch FSDP2) against the torch engine: same
weights, same batch, same step; checkpoints each resumes from the others' (a world of one
rank here; two ranks: tests/integration/test_train_ranks.py)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.config.tree import TrainConfig
from sluice.engines.protocols import TrainEngine
from sluice.engines.train.ddp import DataParallel
from sluice.engines.train.fsdp import FullyShard
from sluice.engines.train.parallel import Optimisation
from sluice.engines.train.zero import Zero, deepspeed_config
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore
from tests.support.trainers import checkpoint, make_trainer, step

# Both engines run in float32, but DeepSpeed sums gradients and their norm over flat buffers,
# in another order than torch: they agree to rounding, not to the bit. Measured after three
# steps at lr 1e-2: weights within 4e-7 (ZeRO-1/2) and 4e-6 (ZeRO-3), metrics within 2e-6.
# adam_eps 1e-5: at torch's 1e-8 AdamW moves a weight by about lr * sign(g) however small g
# is, so a gradient within rounding of zero (a packed step's, on AVX-512) flipped one
# weight's update by 2e-5; at 1e-5 an update is continuous in its gradient.
ATOL, RTOL = 1e-5, 1e-4
SETTINGS = {
    "lr": 1e-2,
    "clip_eps": 0.2,
    "grad_clip": 0.2,  # low enough that clipping acts on these steps
    "micro_batch": 2,
    "micro_batch_tokens": 64,
    "warmup_steps": 2,
    "loss": "decoupled_ppo",
    "entropy_coef": 0.01,
    "weight_decay": 0.01,
    "betas": (0.8, 0.99),
    "adam_eps": 1e-5,
    "threads": 1,
    "seed": 0,
}


@pytest.fixture
def policy_dir(tiny_policy):
    return tiny_policy


def _samples() -> list[Sample]:
    """Five off-policy samples of different lengths: several micro-batches, clipped ratios."""
    rows = []
    for i, advantage in enumerate([1.0, -0.5, 0.25, 2.0, -1.5]):
        prompt = [1, 20 + i, 21]
        response = [22 + j % 7 for j in range(3 + 2 * i)] + [2]
        behaviour = [-4.0 + 0.3 * j for j in range(len(response))]
        rows.append(Sample(prompt, response, behaviour, advantage))
    return rows


def _assert_same_weights(a, b, atol, rtol):
    sa, sb = a.state(), b.state()
    assert set(sa) == set(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], atol=atol, rtol=rtol, msg=name)


def _assert_same_step(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key


@pytest.mark.parametrize(
    "make",
    [
        lambda p: make_trainer(str(p), engine="deepspeed", zero_stage=1, **SETTINGS),
        lambda p: make_trainer(str(p), engine="deepspeed", zero_stage=2, **SETTINGS),
        lambda p: make_trainer(str(p), engine="deepspeed", zero_stage=3, **SETTINGS),
        lambda p: make_trainer(str(p), engine="fsdp", packing=True, **SETTINGS),
    ],
    ids=["zero1", "zero2", "zero3", "fsdp-packed"],
)
def test_a_sharded_step_equals_the_torch_step(policy_dir, make):
    reference = make_trainer(str(policy_dir), **SETTINGS)
    engine = make(policy_dir)
    _assert_same_weights(reference, engine, atol=0, rtol=0)
    samples = _samples()
    for _ in range(3):
        want, got = step(reference, samples), step(engine, samples)
        _assert_same_step(got, want)
        _assert_same_weights(reference, engine, ATOL, RTOL)
    assert want["grad_norm"] > SETTINGS["grad_clip"]  # the clip was exercised
    assert engine.version() == 3


def test_fsdp_checkpoints_every_units_optimiser_state_after_a_forward_only_pass(policy_dir):
    # A forward with no backward (the packing check, a log-prob check) leaves FSDP2's root
    # unit (embeddings, final norm, head) gathered: its parameters were then not the tensors
    # AdamW holds state for, and a checkpoint lost their moments.
    engine = make_trainer(str(policy_dir), engine="fsdp", packing=True, **SETTINGS)
    samples = _samples()
    step(engine, samples)
    engine.logprobs(samples)
    reference = make_trainer(str(policy_dir), **SETTINGS)
    reference.load_checkpoint(*checkpoint(engine))
    _assert_same_step(step(reference, samples), step(engine, samples))
    _assert_same_weights(reference, engine, ATOL, RTOL)


def test_a_packed_zero3_step_equals_the_padded_torch_step(policy_dir):
    reference = make_trainer(str(policy_dir), **SETTINGS)
    engine = make_trainer(
        str(policy_dir), engine="deepspeed", zero_stage=3, packing=True, **SETTINGS
    )
    samples = _samples()
    for _ in range(2):
        _assert_same_step(step(engine, samples), step(reference, samples))
        _assert_same_weights(reference, engine, ATOL, RTOL)


def test_fsdp_checkpoints_resume_bit_identically_and_cross_engines(policy_dir, tmp_path):
    samples = _samples()
    original = make_trainer(str(policy_dir), engine="fsdp", **SETTINGS)
    step(original, samples)
    files, counters = original.checkpoint_files()
    CheckpointStore(tmp_path.as_uri()).save(1, files, counters)
    want = step(original, samples)
    loaded = CheckpointStore(tmp_path.as_uri()).load_latest()
    fresh = make_trainer(str(policy_dir), engine="fsdp", **{**SETTINGS, "seed": 7})
    fresh.load_checkpoint(loaded.files, loaded.meta)
    assert fresh.version() == 1
    assert step(fresh, samples) == want
    _assert_same_weights(original, fresh, atol=0, rtol=0)
    # FSDP -> torch -> DeepSpeed -> FSDP, each going on as the torch engine would.
    reference = make_trainer(str(policy_dir), **SETTINGS)
    reference.load_checkpoint(loaded.files, loaded.meta)
    step(reference, samples)
    zero = make_trainer(str(policy_dir), engine="deepspeed", zero_stage=3, **SETTINGS)
    zero.load_checkpoint(*checkpoint(reference))
    back = make_trainer(str(policy_dir), engine="fsdp", **SETTINGS)
    back.load_checkpoint(*checkpoint(zero))
    _assert_same_step(step(back, samples), step(reference, samples))
    _assert_same_weights(reference, back, ATOL, RTOL)


@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
def test_checkpoint_resumes_bit_identically(policy_dir, tmp_path, stage):
    """Save after two steps through the checkpoint store, restore into a fresh engine: its
    next step lands on the very weights and metrics of the engine that went on."""
    samples = _samples()
    original = make_trainer(str(policy_dir), engine="deepspeed", zero_stage=stage, **SETTINGS)
    step(original, samples)
    step(original, samples)
    files, counters = original.checkpoint_files()
    store = CheckpointStore(tmp_path.as_uri())
    store.save(2, files, counters)
    assert not any(name.endswith((".pt", ".bin", ".pkl")) for name in files)
    want = step(original, samples)

    fresh = make_trainer(
        str(policy_dir), engine="deepspeed", zero_stage=stage, **{**SETTINGS, "seed": 7}
    )
    loaded = store.load_latest()
    fresh.load_checkpoint(loaded.files, loaded.meta)
    assert fresh.version() == 2
    got = step(fresh, samples)
    assert got == want
    _assert_same_weights(original, fresh, atol=0, rtol=0)


def test_a_zero3_resume_gathers_one_parameter_at_a_time(policy_dir, monkeypatch):
    """Loading a checkpoint's weights into ZeRO-3 never gathers the whole model on a rank:
    each parameter is gathered alone while its stored tensor is copied in."""
    import sluice.engines.train.zero_state as zero_state

    source = make_trainer(str(policy_dir), **SETTINGS)
    step(source, _samples())
    engine = make_trainer(str(policy_dir), engine="deepspeed", zero_stage=3, **SETTINGS)
    gathered: list[int] = []
    real = zero_state.GatheredParameters

    def counted(params, *args, **kwargs):
        gathered.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(zero_state, "GatheredParameters", counted)
    engine.load_checkpoint(*checkpoint(source))
    assert gathered and set(gathered) == {1}
    assert len(gathered) == len(list(engine.model.parameters()))
    _assert_same_weights(source, engine, ATOL, RTOL)


def test_a_torch_checkpoint_resumes_under_deepspeed(policy_dir):
    """Both engines store AdamW's state in one layout: a run may change engines on resume,
    and then goes on as the torch engine would (to rounding, as in the step test)."""
    samples = _samples()
    reference = make_trainer(str(policy_dir), **SETTINGS)
    step(reference, samples)
    engine = make_trainer(str(policy_dir), engine="deepspeed", zero_stage=2, **SETTINGS)
    engine.load_checkpoint(*checkpoint(reference))
    assert engine.version() == 1
    _assert_same_step(step(engine, samples), step(reference, samples))
    _assert_same_weights(reference, engine, ATOL, RTOL)
    back = make_trainer(str(policy_dir), **SETTINGS)
    back.load_checkpoint(*checkpoint(engine))
    _assert_same_step(step(back, samples), step(reference, samples))
    _assert_same_weights(reference, back, ATOL, RTOL)


@pytest.mark.parametrize("engine", ["torch", "fsdp", "deepspeed"])
def test_a_non_finite_gradient_skips_the_step(policy_dir, engine):
    trainer = make_trainer(policy_dir, engine=engine, **SETTINGS)
    before = {k: v.clone() for k, v in trainer.state().items()}
    poisoned = [
        Sample(s.prompt_ids, s.response_ids, s.behaviour_logprobs, math.nan) for s in _samples()
    ]
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at version 0"):
        step(trainer, poisoned)
    assert trainer.version() == 0
    for name, tensor in trainer.state().items():
        torch.testing.assert_close(tensor, before[name], atol=0, rtol=0)
    metrics = step(trainer, _samples())  # and the next batch trains normally
    assert math.isfinite(metrics["grad_norm"]) and trainer.version() == 1


def test_zero_stage_5_is_refused():
    with pytest.raises(ValueError, match=r"zero_stage 5 is not supported; allowed: 1, 2, 3"):
        Zero(5)


def test_config_carries_sluices_settings():
    opt = Optimisation(lr=3e-4, grad_clip=0.7, betas=(0.85, 0.95), weight_decay=0.1)
    config = deepspeed_config(opt, micro_batch=8, zero_stage=1, world_size=2)
    assert config["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.85, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
        "adam_w_mode": True,
    }
    assert config["gradient_clipping"] == 0.7
    assert config["zero_optimization"] == {"stage": 1}
    assert config["train_batch_size"] == 16
    assert config["bf16"] == {"enabled": False} and "torch_autocast" not in config
    half = deepspeed_config(opt, micro_batch=8, zero_stage=3, world_size=2, dtype="bfloat16")
    assert half["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": [],  # gradients reduced in float32
    }
    assert half["bf16"] == {"enabled": False}  # float32 weights, as the other engines'
    assert half["zero_optimization"] == {"stage": 3}


def test_a_stage_3_forward_keeps_at_most_the_largest_tensor_gathered():
    opt = Optimisation(lr=3e-4, grad_clip=1.0)
    three = deepspeed_config(opt, micro_batch=8, zero_stage=3, world_size=2, largest_tensor=1234)
    assert three["zero_optimization"] == {"stage": 3, "stage3_max_live_parameters": 1234}
    two = deepspeed_config(opt, micro_batch=8, zero_stage=2, world_size=2, largest_tensor=1234)
    assert two["zero_optimization"] == {"stage": 2}  # nothing is gathered below stage 3


def test_engine_serves_the_train_engine_protocol(policy_dir, tmp_path):
    engine = make_trainer(str(policy_dir), engine="deepspeed", zero_stage=3, **SETTINGS)
    assert isinstance(engine, TrainEngine)
    largest = max(p.ds_numel for p in engine.model.parameters())
    assert engine.parallel._engine.zero_max_live_parameters() == largest
    step(engine, _samples())
    engine.save(str(tmp_path / "saved"))
    saved = make_trainer(str(tmp_path / "saved"), **SETTINGS)
    _assert_same_weights(engine, saved, atol=0, rtol=0)
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    assert engine.logprobs(_samples()[:1]) == saved.logprobs(_samples()[:1])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: make_trainer(str(p), engine="fsdp", **SETTINGS),
        lambda p: make_trainer(str(p), engine="deepspeed", zero_stage=3, **SETTINGS),
    ],
    ids=["fsdp", "zero3"],
)
def test_a_sharded_engine_gathers_for_publishing_one_tensor_at_a_time(policy_dir, make):
    """What the trainer publishes from a sharded engine (``layout``, then ``gathered``) is
    the full weights ``state`` gathers, each tensor handed over alone."""
    engine = make(policy_dir)
    step(engine, _samples())
    assert engine.sharded
    want = engine.state()
    layout = engine.layout()
    assert {k: (v.shape, v.dtype) for k, v in layout.items()} == {
        k: (v.shape, v.dtype) for k, v in want.items()
    }
    got = {name: tensor.clone() for name, tensor in engine.gathered()}
    assert list(got) == list(layout)  # in the layout's order: publish_from cuts buckets by it
    _assert_same_weights_dicts(got, want)


def _assert_same_weights_dicts(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name], atol=0, rtol=0, msg=name)


def test_each_engine_loads_only_what_it_will_own(policy_dir):
    """FSDP2 builds on the meta device and reads its shards once sharded (``attach``);
    ZeRO-3 builds under DeepSpeed's partitioned init; one torch rank reads it whole."""
    train = TrainConfig(micro_batch=2)
    meta = FullyShard().load(policy_dir, torch.device("cpu"), train)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    partitioned = Zero(3).load(policy_dir, torch.device("cpu"), train)
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in partitioned.parameters())
    whole = DataParallel().load(policy_dir, torch.device("cpu"), train)
    assert all(p.numel() > 0 and p.device.type == "cpu" for p in whole.parameters())


def _tied_folder(folder: Path) -> Path:
    """A model whose output embedding is its input embedding: its file holds one of them."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    return folder


def test_fsdp_reads_a_tied_folder_shard_by_shard_into_the_torch_engines_weights(tmp_path):
    folder = _tied_folder(tmp_path / "tied")
    samples = [Sample([1, 5, 6], [7, 8, 9, 2], [-3.0] * 4, a) for a in (1.0, -1.0)]
    reference = make_trainer(folder, **SETTINGS)
    engine = make_trainer(folder, engine="fsdp", **SETTINGS)
    _assert_same_weights(reference, engine, atol=0, rtol=0)
    _assert_same_step(step(engine, samples), step(reference, samples))
    state = engine.state()
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_a_ddp_rank_other_than_0_ties_a_tied_models_weights_as_rank_0s_load_does(
    tmp_path, monkeypatch
):
    folder = _tied_folder(tmp_path / "tied")
    train = TrainConfig(micro_batch=2)
    first = DataParallel().load(folder, torch.device("cpu"), train)  # reads the folder
    monkeypatch.setattr("sluice.engines.train.ddp.rank_and_world", lambda: (1, 2))
    other = DataParallel().load(folder, torch.device("cpu"), train)  # makes room only
    assert [n for n, _ in other.named_parameters()] == [n for n, _ in first.named_parameters()]
    assert other.lm_head.weight is other.model.embed_tokens.weight


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_a_saved_tied_model_holds_its_embedding_once_and_loads_back(tmp_path, engine):
    """The saved folder is streamed tensor by tensor; as save_pretrained does, it leaves out
    the tied output embedding, and loads back as the weights the engine had."""
    folder = _tied_folder(tmp_path / "tied")
    trainer = make_trainer(folder, engine=engine, **SETTINGS)
    step(trainer, [Sample([1, 5, 6], [7, 8, 9, 2], [-3.0] * 4, 1.0)])
    trainer.save(str(tmp_path / "saved"))
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and f.metadata() == {"format": "pt"}
    _assert_same_weights(trainer, make_trainer(tmp_path / "saved", **SETTINGS), atol=0, rtol=0)


def test_a_folder_missing_a_tensor_is_refused_by_name(tmp_path, policy_dir):
    folder = tmp_path / "partial"
    shutil.copytree(policy_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no tensor for \['model.norm.weight'\]"):
        make_trainer(folder, engine="fsdp", **SETTINGS)
