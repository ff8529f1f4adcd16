"""LoRA end to end on the real pieces: a torch trainer with peft adapters publishes only the
adapter, vLLM (in this process, as in a rollout actor) reloads it in place, and then
samples with the trainer's very log-probs, also for a request that was running when the
adapter changed (partial rollout: its later tokens come from the new adapter)."""

from __future__ import annotations

import gc

import pytest
import torch

from sluice.config.tree import LoraConfig
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.engines.train.lora import ADAPTER_FILE, load_adapter_state, read_adapter
from sluice.engines.train.trainer import PolicyTrainer
from sluice.rl.batching import Sample
from sluice.storage.params import ParameterError, ParameterService
from tests.support.trainers import make_trainer, step

pytestmark = pytest.mark.integration

PROMPTS = ["12+34=", "7+85=", "3 5 7>22:", "99+1="]
LORA = LoraConfig(
    rank=16,
    alpha=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)
# float32 on both sides: a weight push matched the trainer within 1e-6 (ENVIRONMENT.md).
TOLERANCE = 1e-4


def _trainer(policy) -> PolicyTrainer:
    return make_trainer(
        str(policy), lr=5e-2, clip_eps=0.2, grad_clip=10.0, micro_batch=64, threads=1, seed=0,
        lora=LORA,
    )  # fmt: skip


def _samples(engine, groups, advantages) -> list[Sample]:
    prompt_ids = engine.prompt_ids(PROMPTS)
    return [
        Sample(ids, c.token_ids, c.logprobs, adv)
        for ids, group, adv in zip(prompt_ids, groups, advantages, strict=True)
        for c in group
    ]


def _gap(samples: list[Sample], trainer: PolicyTrainer) -> float:
    theirs = trainer.logprobs(samples)
    return max(
        abs(x - y)
        for s, row in zip(samples, theirs, strict=True)
        for x, y in zip(s.behaviour_logprobs, row, strict=True)
    )


def _move(trainer: PolicyTrainer, samples: list[Sample]) -> None:
    """Steps until the trainer's log-probs are well away from the samples'."""
    start = trainer.version()
    while _gap(samples, trainer) < 10 * TOLERANCE:
        assert trainer.version() < start + 10, "ten steps did not move the adapter"
        step(trainer, samples)


@pytest.fixture
def engine(tiny_policy, in_process_vllm):
    engine = VLLMRolloutEngine(
        str(tiny_policy), seed=0, kv_cache_gib=0.1, max_model_len=128, lora=LORA
    )
    yield engine
    del engine


def test_the_trainer_publishes_the_adapter_alone(tiny_policy):
    trainer = _trainer(tiny_policy)
    state = trainer.state()
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(trainable) == len(state)  # every adapter tensor, nothing of the base
    files, _ = trainer.checkpoint_files()
    assert ADAPTER_FILE in files and "model.safetensors" not in files


def test_adapter_pushes_through_the_parameter_service_match_the_trainer(tiny_policy, engine):
    trainer = _trainer(tiny_policy)
    params = ParameterService.create(relays=1, bucket_bytes=64 << 10, dtype="float32")
    try:
        groups = engine.generate(PROMPTS, 2, 8, 1.0, seed=0)
        before = _samples(engine, groups, [(-1.0) ** i for i in range(len(PROMPTS))])
        # Adapters start at B = 0: the wrapped model is the base model vLLM serves.
        assert _gap(before, trainer) < TOLERANCE
        current = before
        for _ in range(2):  # the first push adds the adapter, the second replaces it in place
            _move(trainer, current)
            params.publish(trainer.version(), trainer.state())
            params.flush()  # relay 0 holds the version
            pulled = params.pull(after=engine.version(), timeout=60.0)
            assert pulled is not None and pulled.version == trainer.version()
            engine.load_weights(pulled, pulled.version)
            groups = engine.generate(PROMPTS, 2, 8, 1.0, seed=trainer.version())
            current = _samples(engine, groups, [(-1.0) ** i for i in range(len(PROMPTS))])
            gap = _gap(current, trainer)
            assert gap < TOLERANCE, f"vLLM and the trainer differ by {gap:.2e} after the push"
    finally:
        params.shutdown()


def _switched_logprobs(model, prompt, tokens, switch, first, second) -> torch.Tensor:
    """The log-prob of each response token as vLLM computes it when the adapter changes
    after ``switch`` tokens: the KV entries of every token fed before the change come from
    the first adapter, those of the rest (from the last token sampled before the change
    on) from the second, as with full weights loaded mid-request."""
    ids = torch.tensor([prompt + tokens])
    cut = len(prompt) + switch - 1  # the first input token the new adapter computes
    with torch.no_grad():
        load_adapter_state(model, first)
        head = model(input_ids=ids[:, :cut], use_cache=True)
        load_adapter_state(model, second)
        tail = model(input_ids=ids[:, cut:-1], past_key_values=head.past_key_values)
    logits = torch.cat([head.logits, tail.logits], dim=1)[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_running_request_goes_on_under_the_new_adapter(tiny_policy, engine):
    trainer = _trainer(tiny_policy)
    groups = engine.generate(PROMPTS, 2, 8, 1.0, seed=0)
    _move(trainer, _samples(engine, groups, [(-1.0) ** i for i in range(len(PROMPTS))]))
    first = {k: v.clone() for k, v in trainer.state().items()}
    engine.load_weights(iter(first.items()), 1)
    prompt = engine.prompt_ids(["12+34="])[0]
    engine.start("r", prompt, 40, 1.0, seed=3)
    tokens, logprobs = [], []
    while len(tokens) < 8:
        for delta in engine.step():
            tokens += delta.token_ids
            logprobs += delta.logprobs
    switch = len(tokens)
    _move(trainer, [Sample(prompt, tokens, logprobs, 1.0)])
    second = {k: v.clone() for k, v in trainer.state().items()}
    engine.load_weights(iter(second.items()), 2)
    done = False
    while not done:
        for delta in engine.step():
            tokens += delta.token_ids
            logprobs += delta.logprobs
            done = delta.finished
    assert len(tokens) > switch + 1, "the request ended at the switch"
    got = torch.tensor(logprobs)
    model = trainer.model.eval()
    want = _switched_logprobs(model, prompt, tokens, switch, first, second)
    assert (got - want).abs().max() < TOLERANCE
    # Had the request kept the first adapter, its later tokens would differ: the check sees it.
    kept = _switched_logprobs(model, prompt, tokens, switch, first, first)
    assert (got[switch:] - kept[switch:]).abs().max() > 10 * TOLERANCE


def test_a_saved_adapter_folder_serves_as_the_trainer_left_it(
    tiny_policy, tmp_path, in_process_vllm
):
    """What ``sluice eval --policy <adapter folder>`` starts: vLLM on the base the folder
    names, serving the folder's adapter."""
    trainer = _trainer(tiny_policy)
    probe = VLLMRolloutEngine(str(tiny_policy), seed=0, kv_cache_gib=0.1, max_model_len=128)
    groups = probe.generate(PROMPTS, 2, 8, 1.0, seed=0)
    _move(trainer, _samples(probe, groups, [(-1.0) ** i for i in range(len(PROMPTS))]))
    del probe
    gc.collect()
    trainer.save(str(tmp_path / "policy"))
    base, lora = read_adapter(tmp_path / "policy")
    assert base == str(tiny_policy) and lora.rank == LORA.rank
    engine = VLLMRolloutEngine(
        base,
        seed=0,
        kv_cache_gib=0.1,
        max_model_len=128,
        lora=lora,
        adapter=str(tmp_path / "policy"),
    )
    groups = engine.generate(PROMPTS, 2, 8, 1.0, seed=1)
    assert _gap(_samples(engine, groups, [0.0] * len(PROMPTS)), trainer) < TOLERANCE


def test_an_adapter_pushed_to_the_wrong_module_is_refused_before_vllm_sees_it(tiny_policy, engine):
    """vLLM applies adapter tensors by module name and passes over names its model lacks:
    an adapter renamed onto a layer the model does not have would leave it serving the
    base model while the trainer trains the adapter."""
    state = _trainer(tiny_policy).state()
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in state}
    wrong = max(layers) + 1
    moved = {k.replace(".layers.0.", f".layers.{wrong}."): v for k, v in state.items()}
    with pytest.raises(
        ParameterError,
        match=rf"adapts model\.layers\.{wrong}\.\S+, which the base model has no linear weight",
    ):
        engine.load_weights(iter(moved.items()), 1)
    assert engine.version() == 0
    engine.load_weights(iter(state.items()), 1)  # the right names load
    assert engine.version() == 1
