"""The trainer applies the output head itself, to the trained positions only: the same
log-probs and entropy as the model's own logits, and a model that changes its logits after
the head (Gemma 2's soft-capping) keeps the whole-logits path."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from sluice.config.tree import PolicyConfig
from sluice.engines.train.output_head import OutputHead
from sluice.policy.starting import build_model, build_tokenizer, save_policy
from sluice.rl.batching import Sample, collate
from tests.support.trainers import make_trainer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    tok = build_tokenizer()
    save_policy(
        build_model(PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64), len(tok), seed=0),
        tok,
        out,
    )
    return out


def _trainer(folder, **kw):
    args = {"lr": 1e-2, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 8, "threads": 1}
    return make_trainer(str(folder), seed=0, **{**args, **kw})


def test_the_bypassed_forward_gives_hidden_states_the_head_turns_into_the_logits(folder):
    trainer = _trainer(folder)
    head = trainer._head
    assert head is not None and head.module is trainer.model.lm_head
    ids = torch.tensor([[1, 20, 21, 22]])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits
        with head.bypassed():
            hidden = trainer.model(input_ids=ids).logits
    assert hidden.shape[-1] == trainer.model.config.hidden_size
    torch.testing.assert_close(head.module(hidden), logits)
    assert trainer.model.lm_head is head.module  # put back


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_and_whole_logits_give_the_same_logprobs_and_step(folder, temperature):
    chunked = _trainer(folder, logits_chunk_tokens=16, temperature=temperature)
    whole = _trainer(folder, temperature=temperature)
    whole._head = None
    samples = [  # 41 response tokens: three chunks of 16
        Sample([1, 20, 21], [22 + i % 9 for i in range(20)] + [2], [-3.0] * 21, 1.0),
        Sample([1, 20], [24 + i % 7 for i in range(19)] + [2], [-3.0] * 20, -1.0),
    ]
    for a, b in zip(chunked.logprobs(samples), whole.logprobs(samples), strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
    # The gradients, not the weights after AdamW: its update divides by the gradient's
    # size, so a weight whose gradient is ~0 moves by rounding noise times the rate.
    sums = []
    for trainer in (chunked, whole):
        step, _ = trainer._passes(collate(samples, trainer.pad_id))
        sums.append(step.sums)
    assert sums[0]["entropy"] == pytest.approx(sums[1]["entropy"], rel=1e-5)
    assert sums[0]["loss"] == pytest.approx(sums[1]["loss"], rel=1e-5)
    for (name, p), q in zip(
        chunked.model.named_parameters(), whole.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_model_that_soft_caps_its_logits_keeps_them_whole():
    config = Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=3.0,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config)
    assert OutputHead.of(model, torch.device("cpu")) is None
    config.final_logit_softcapping = None
    assert OutputHead.of(Gemma2ForCausalLM(config), torch.device("cpu")) is not None
