"""The vLLM engine in-process: requests are made with ``detokenize=False`` and the text is
decoded once at the end (``VLLMRolloutEngine.decode``); that text must be the very text
vLLM's own detokenizer builds, or the verifier would score something else. Streaming
requests report every ``STREAM_EVERY`` tokens; ``generated`` must count the ones between.
Weights loaded while requests run must not leave KV blocks cached under the old weights for
later requests."""

from __future__ import annotations

import gc

import pytest

from sluice.config.tree import PolicyConfig
from sluice.engines.rollout.vllm_engine import STREAM_EVERY, VLLMRolloutEngine
from sluice.policy.starting import build_model, build_tokenizer, save_policy

PROMPTS = ["12+34=", "7+8=", "100+250="]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    tok = build_tokenizer()
    # Untrained: it samples every character, spaces and special tokens included.
    save_policy(
        build_model(PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64), len(tok), seed=0),
        tok,
        folder,
    )
    return folder


@pytest.fixture(scope="module")
def engine(policy):
    # In this process, as in the rollout actors: no engine-core subprocess.
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    gc.collect()  # an engine another test left would tear down this one's parallel state
    # Room for a prompt that fills one KV block (128 tokens on CPU) and its answer.
    yield VLLMRolloutEngine(str(policy), seed=0, kv_cache_gib=0.1, max_model_len=256)
    patch.undo()
    gc.collect()


def _vllm_texts(engine, prompts, n, seed):
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=40, logprobs=0, seed=seed)
    outputs = engine._llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.text) for c in out.outputs] for out in outputs]


def test_batch_text_is_vllms_detokenized_text(engine):
    ours = engine.generate(PROMPTS, n=4, max_new_tokens=40, temperature=1.0, seed=3)
    theirs = _vllm_texts(engine, PROMPTS, n=4, seed=3)
    pairs = [
        (c, t)
        for row, trow in zip(ours, theirs, strict=True)
        for c, t in zip(row, trow, strict=True)
    ]
    assert len(pairs) == 12
    for completion, (token_ids, text) in pairs:
        assert completion.token_ids == token_ids
        assert completion.text == text
    assert any(c.text for c, _ in pairs)  # something was generated and decoded


def test_streamed_tokens_decode_to_vllms_text(engine):
    ids = engine.prompt_ids(PROMPTS)
    for i, prompt_ids in enumerate(ids):
        engine.start(f"r{i}", prompt_ids, 40, 1.0, seed=11 + i)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: set[str] = set()
    unreported: set[int] = set()
    # Where generated() reads the tokens in flight: the in-process engine core's scheduler.
    # The CPU platform turns async scheduling off, so there are none between steps here.
    llm_engine = engine._llm.llm_engine
    assert not llm_engine.vllm_config.scheduler_config.async_scheduling
    scheduler = llm_engine.engine_core.engine_core.scheduler
    while len(finished) < len(PROMPTS):
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            assert len(delta.logprobs) == len(delta.token_ids) <= STREAM_EVERY
            if delta.finished:
                finished.add(delta.request_id)
        for request, got in tokens.items():
            if request in finished:
                assert engine.generated(request) is None  # vLLM no longer holds it
                continue
            # Between reports vLLM has generated tokens step has not handed over yet.
            generated = engine.generated(request)
            assert generated is not None and 0 <= generated - len(got) < STREAM_EVERY
            for internal in llm_engine.output_processor.external_req_ids[request]:
                assert scheduler.requests[internal].num_output_placeholders == 0
            unreported.add(generated - len(got))
    assert max(unreported) > 0  # reports really come in chunks
    for i, prompt in enumerate(PROMPTS):
        [[(token_ids, text)]] = _vllm_texts(engine, [prompt], n=1, seed=11 + i)
        assert tokens[f"r{i}"] == token_ids
        assert engine.decode(token_ids) == text


def _cached_tokens(engine, request_id):
    """Step until ``request_id`` first reports; its count of prefix-cache hits."""
    while True:
        for out in engine._llm.llm_engine.step():
            if out.request_id == request_id:
                return out.num_cached_tokens


def test_no_request_reuses_kv_cached_under_older_weights(engine, policy):
    prompt = engine.prompt_ids(["12+34=" * 22])[0]
    assert len(prompt) > 128  # its first 128 tokens fill a KV block, which vLLM caches
    engine.start("long", prompt, 60, 1.0, seed=1)
    assert _cached_tokens(engine, "long") == 0
    engine.start("same-version", prompt, 60, 1.0, seed=2)
    assert _cached_tokens(engine, "same-version") >= 128  # the cache is on: a hit

    # New weights arrive while requests run, as they do for a streaming worker.
    blobs = [(policy / "model.safetensors").read_bytes()]
    engine.load_weights(blobs, engine.version() + 1)
    assert engine.running() > 0
    engine.start("new-version", prompt, 60, 1.0, seed=3)
    assert _cached_tokens(engine, "new-version") == 0
    engine.abort(["long", "same-version", "new-version"])


def test_many_long_seeded_prompts_at_once_do_not_crash_the_cpu_sampler(engine):
    """An episode's later turns reach vLLM as long prompts, many at once; chunked, their
    prefill would rewind each request's seeded generator, which a CPU one cannot do."""
    count, length = 64, 150  # 9600 prompt tokens: past one step's default budget of 8192
    for i in range(count):
        engine.start(f"long{i}", [1] + [40 + (i + k) % 50 for k in range(length)], 4, 1.0, i)
    finished = 0
    while finished < count:
        finished += sum(d.finished for d in engine.step())
    assert engine.running() == 0


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_are_the_trainers_at_the_sampling_temperature(engine, policy, temperature):
    """vLLM reports each sampled token's log-prob under the distribution it sampled from
    (after temperature), and the trainer's policy is that distribution: at 0.6 both are
    log softmax(logits / 0.6), not the raw logits' (they differ by ~0.5 nats per token)."""
    from sluice.rl.batching import Sample
    from tests.support.trainers import make_trainer

    trainer = make_trainer(
        str(policy), lr=1e-3, clip_eps=0.2, grad_clip=1.0, micro_batch=8, threads=1, seed=0,
        temperature=temperature,
    )  # fmt: skip
    groups = engine.generate(PROMPTS, 2, 24, temperature, seed=3)
    samples = [
        Sample(ids, c.token_ids, c.logprobs, 0.0)
        for ids, group in zip(engine.prompt_ids(PROMPTS), groups, strict=True)
        for c in group
    ]
    theirs = [lp for s in samples for lp in s.behaviour_logprobs]
    ours = [lp for row in trainer.logprobs(samples) for lp in row]
    assert len(ours) == len(theirs) > 20
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
