import json

import pytest
import torch
from safetensors.torch import load as load_safetensors

from engines.policy import build_model, build_tokenizer, save_policy
from engines.protocols import TrainEngine
from engines.torch_trainer import TorchTrainer
from engines.vllm_rollout import VLLMRolloutEngine
from rl.batching import Sample
from rl.config import PolicyConfig


def _trainer(folder, **overrides):
    args = {
        "lr": 1e-2,
        "clip_eps": 0.2,
        "grad_clip": 1.0,
        "micro_batch": 2,
        "threads": 1,
        "seed": 0,
        **overrides,
    }
    return TorchTrainer(str(folder), **args)


@pytest.fixture
def trainer(tmp_path):
    tok = build_tokenizer()
    cfg = PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64)
    save_policy(build_model(cfg, len(tok), seed=0), tok, tmp_path)
    return _trainer(tmp_path)


def _samples(trainer, advantages):
    prompt, response = [1, 20, 21], [22, 23, 2]
    base = Sample(prompt, response, [0.0] * 3, 0.0)
    logprobs = trainer.logprobs([base])[0]
    return [Sample(prompt, response, logprobs, a) for a in advantages]


def test_step_raises_logprob_of_rewarded_response(trainer):
    samples = _samples(trainer, [1.0, 1.0, 1.0])
    before = sum(trainer.logprobs(samples[:1])[0])
    metrics = trainer.step(samples)
    after = sum(trainer.logprobs(samples[:1])[0])
    assert after > before
    assert trainer.version() == 1
    assert metrics["tokens"] == 9
    # on-policy: behaviour log-probs equal the trainer's, so k3 KL is 0
    assert metrics["kl_behaviour"] == pytest.approx(0.0, abs=1e-6)


def test_micro_batches_give_the_same_step_as_one_batch(tmp_path, trainer):
    samples = _samples(trainer, [1.0, -0.5, 0.25])
    whole = _trainer(trainer._model_dir, micro_batch=64)
    trainer.step(samples)  # micro_batch=2: two passes
    whole.step(samples)
    for name, tensor in whole.model.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], tensor, atol=1e-6, rtol=1e-5)


def test_weights_blob_round_trips(trainer):
    blob = trainer.weights()
    tensors = load_safetensors(blob)
    assert set(tensors) == set(trainer.model.state_dict())


def test_save_writes_a_loadable_folder(trainer, tmp_path):
    out = tmp_path / "saved"
    trainer.save(str(out))
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()


def test_warmup_ramps_the_learning_rate(tmp_path, trainer):
    warm = _trainer(trainer._model_dir, micro_batch=8, warmup_steps=3)
    samples = _samples(warm, [1.0, -1.0])
    lrs = [warm.step(samples)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([0.25e-2, 0.5e-2, 0.75e-2, 1e-2, 1e-2])


def test_entropy_bonus_raises_entropy(trainer):
    bonus = _trainer(trainer._model_dir, micro_batch=8, entropy_coef=1.0)
    samples = _samples(bonus, [0.0, 0.0])  # no policy-gradient signal: only the bonus acts
    first = bonus.step(samples)["entropy"]
    later = [bonus.step(samples)["entropy"] for _ in range(5)]
    assert later[-1] > first


def test_trainer_implements_the_train_engine_protocol(trainer):
    assert isinstance(trainer, TrainEngine)


def test_vllm_engine_has_every_rollout_engine_method():
    # Building a vLLM engine takes seconds; the integration tests drive a real one.
    missing = [
        name
        for name in ("generate", "prompt_ids", "load_weights", "version")
        if not callable(getattr(VLLMRolloutEngine, name, None))
    ]
    assert not missing


def test_checkpoint_resumes_the_same_trajectory(trainer):
    """Restore into a fresh trainer: the next step lands on the very same weights."""
    samples = _samples(trainer, [1.0, -0.5, 0.25])
    fresh = _trainer(trainer._model_dir, warmup_steps=4)
    original = _trainer(trainer._model_dir, warmup_steps=4)
    original.step(samples)
    original.step(samples)
    files, counters = original.checkpoint_files()
    assert json.loads(json.dumps(counters)) == counters  # plain JSON for the manifest
    original.step(samples)
    fresh.load_checkpoint(files, counters)
    assert fresh.version() == 2
    metrics = fresh.step(samples)
    assert metrics["lr"] == pytest.approx(original._schedule.get_last_lr()[0] * 3 / 4)
    for name, tensor in original.model.state_dict().items():
        torch.testing.assert_close(fresh.model.state_dict()[name], tensor, atol=0, rtol=0)
