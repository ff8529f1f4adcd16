"""The torch engine with LoRA adapters: only the adapters train; checkpoints hold the
adapter and resume to the bit; the saved policy is an adapter folder peft loads (and,
asked for, a merged model folder); bad targets and a checkpoint of the other kind are
refused with the fix named."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from sluice.config.tree import LoraConfig
from sluice.engines.train.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_misfit, weight_shapes
from sluice.engines.train.trainer import PolicyTrainer
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore
from tests.support.trainers import checkpoint, make_trainer, step

SETTINGS = {"lr": 5e-2, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 4, "threads": 1}
LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])


def _trainer(policy, seed=0, lora=LORA) -> PolicyTrainer:
    return make_trainer(str(policy), seed=seed, lora=lora, **SETTINGS)


def _samples() -> list[Sample]:
    return [
        Sample([1, 20 + i, 21], [22 + j % 5 for j in range(2 + i)] + [2], [-3.0] * (3 + i), adv)
        for i, adv in enumerate([1.0, -0.5, 2.0, -1.0])
    ]


def test_only_the_adapters_train(tiny_policy):
    trainer = _trainer(tiny_policy)
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    adapter = {k: v.clone() for k, v in trainer.state().items()}
    step(trainer, _samples())
    after = trainer.model.state_dict()
    for name, tensor in base.items():
        assert torch.equal(after[name], tensor), f"{name} (a base weight) changed"
    moved = [k for k, v in trainer.state().items() if not torch.equal(v, adapter[k])]
    assert any(".lora_B." in k for k in moved)


def test_a_bf16_run_holds_its_frozen_base_in_bf16_and_trains_float32_adapters(tiny_policy):
    trainer = make_trainer(
        str(tiny_policy), lora=LORA, dtype="bfloat16", **{**SETTINGS, "packing": True}
    )
    named = dict(trainer.model.named_parameters())
    base = {k: v for k, v in named.items() if "lora_" not in k}
    adapters = {k: v for k, v in named.items() if "lora_" in k}
    assert {v.dtype for v in base.values()} == {torch.bfloat16}
    assert {v.dtype for v in adapters.values()} == {torch.float32}
    assert all(v.requires_grad for v in adapters.values())
    frozen = {k: v.clone() for k, v in base.items()}
    before = {k: v.clone() for k, v in trainer.state().items()}
    metrics = step(trainer, _samples())
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(torch.equal(named[k], v) for k, v in frozen.items())
    assert any(not torch.equal(v, before[k]) for k, v in trainer.state().items())


def test_targets_the_model_lacks_are_named_with_the_models_own(tiny_policy):
    bad = LoraConfig(target_modules=["q_proj", "query_key_value"])
    with pytest.raises(ValueError, match=r"\['query_key_value'\] are not linear .*q_proj"):
        _trainer(tiny_policy, lora=bad)


def test_a_checkpoint_resumes_to_the_bit(tiny_policy, tmp_path):
    samples = _samples()
    original = _trainer(tiny_policy)
    step(original, samples)
    store = CheckpointStore(tmp_path.as_uri())
    store.save(1, *original.checkpoint_files())
    want = step(original, samples)
    fresh = _trainer(tiny_policy, seed=7)
    loaded = store.load_latest()
    assert loaded is not None and ADAPTER_FILE in loaded.files
    fresh.load_checkpoint(loaded.files, loaded.meta)
    assert step(fresh, samples) == want
    for name, tensor in original.state().items():
        assert torch.equal(fresh.state()[name], tensor), name


def test_a_checkpoint_of_the_other_kind_is_refused(tiny_policy):
    lora, full = _trainer(tiny_policy), _trainer(tiny_policy, lora=None)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter.*train\.lora set"):
        full.load_checkpoint(*checkpoint(lora))
    with pytest.raises(ValueError, match=r"holds full weights.*without train\.lora"):
        lora.load_checkpoint(*checkpoint(full))
    other = _trainer(tiny_policy, lora=LoraConfig(rank=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"does not fit train\.lora"):
        other.load_checkpoint(*checkpoint(lora))


def test_the_saved_policy_is_an_adapter_peft_loads_and_merges(tiny_policy, tmp_path):
    trainer = _trainer(tiny_policy, lora=LORA.model_copy(update={"merged_export": True}))
    step(trainer, _samples())
    trainer.save(str(tmp_path / "policy"))
    folder = tmp_path / "policy"
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(tiny_policy)
    assert (config["r"], sorted(config["target_modules"])) == (4, sorted(LORA.target_modules))
    assert not (folder / "model.safetensors").exists()  # the base is not copied

    ids = torch.tensor([[1, 20, 21, 22, 23, 2]])
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_policy), dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, str(folder)).eval()
        merged = AutoModelForCausalLM.from_pretrained(str(folder / "merged")).eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).eval()
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-4)


BASE = {
    "model.layers.0.self_attn.q_proj.weight": (64, 32),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.norm.weight": (32,),
}
FIT = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj"])


def _lora(module: str, a: tuple[int, int], b: tuple[int, int]) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.{module}"
    return {f"{prefix}.lora_A.weight": torch.zeros(a), f"{prefix}.lora_B.weight": torch.zeros(b)}


def test_an_adapter_that_fits_its_modules_passes():
    tensors = {
        **_lora("model.layers.0.self_attn.q_proj", (4, 32), (64, 4)),
        **_lora("model.layers.0.self_attn.k_proj", (4, 32), (16, 4)),
    }
    assert adapter_misfit(tensors, BASE, FIT) is None


@pytest.mark.parametrize(
    ("tensors", "why"),
    [
        (_lora("model.layers.7.self_attn.q_proj", (4, 32), (64, 4)),
         "adapts model.layers.7.self_attn.q_proj, which the base model has no linear weight"),
        (_lora("model.norm", (4, 32), (64, 4)), "model.norm, which is not one of train.lora"),
        (_lora("model.layers.0.self_attn.k_proj", (4, 32), (64, 4)),  # q_proj's, moved
         "has shape (64, 4), but model.layers.0.self_attn.k_proj (16x32) takes (16, 4)"),
        ({"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 32)},
         "is not named base_model.model.<module>.lora_A/B.weight"),
    ],
    ids=["missing-layer", "not-a-target", "wrong-shape", "not-peft-names"],
)  # fmt: skip
def test_an_adapter_pushed_to_the_wrong_module_says_which_tensor_and_why(tensors, why):
    misfit = adapter_misfit(tensors, BASE, FIT)
    assert misfit is not None and why in misfit


def test_weight_shapes_come_from_the_folders_safetensors_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(3, 5), "b": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert weight_shapes(tmp_path) == {"a.weight": (3, 5), "b": (2,)}


def test_the_reference_of_a_lora_policy_is_its_base_with_the_adapters_off(tiny_policy):
    """No second copy: the KL is 0 while the adapters are new (B = 0), and grows once they
    have moved the policy."""
    trainer = make_trainer(str(tiny_policy), lora=LORA, kl_coef=0.1, **SETTINGS)
    assert not hasattr(trainer._reference, "model")  # the trainer's own model, adapters off
    assert step(trainer, _samples())["kl_reference"] == pytest.approx(0.0, abs=1e-7)
    assert step(trainer, _samples())["kl_reference"] > 1e-6
