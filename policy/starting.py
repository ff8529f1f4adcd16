"""The starting policy: Sluice's own tiny character-level llama, built offline, or a local folder.

``prepare_policy`` returns a Hugging Face model folder (config.json, model.safetensors,
tokenizer files) that transformers and vLLM both load. With no ``policy.path`` it builds a
small llama with a character tokenizer, warm-starts it by supervised learning on the
environment's own reference answers until held-out greedy accuracy reaches
``policy.warmstart_target`` (so RL starts from a base that is right sometimes; for a
multi-turn environment, episodes played with its real observations), and caches
the folder under ``<cache>/policies/<key>``: a second run with the same settings reuses it.
The warm start is reproducible: seeded, on a fixed number of torch threads with
deterministic kernels, so the same config and seed give the same weights bit for bit on
machines of one kind; the cache key names what else decides them (torch and transformers
versions, the CPU's vector instructions), so a cached policy is never one another machine
kind would not have built.
For an agent (``env.agent``) the tiny policy is a chat model: its tokenizer carries
``CHAT_TEMPLATE`` and the warm start learns the answers as assistant replies to the prompts
as the template renders them. No hub is ever contacted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sluice.config.tree import PolicyConfig
from sluice.engines.rollout.episodes import EpisodeSteps, StepFailed
from sluice.envs import ALPHABET, Environment, Problem
from sluice.envs.multi_turn import EnvStep, is_multi_turn, reference_turns
from sluice.envs.scoring import Scorer, VerifierScorer

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Bump when the way a policy is built changes, so stale cache entries are not reused.
POLICY_FORMAT = 2
# torch threads of the warm start, whatever the machine's cores: a float sum's order
# depends on how many threads split it, so a fixed count gives the same weights on a
# 2-core and a 64-core machine of one CPU kind (two keep a 2-core machine busy).
WARMSTART_THREADS = 2
# The tiny policy's chat template, for agents: each message is its role and its text, an
# assistant's reply ends with EOS (the token a sampled turn stops at), and the generation
# prompt opens the assistant's turn. Printable ASCII only, as the character vocabulary is.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
WARMSTART_FILE = "warmstart.json"


def build_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus pad/BOS/EOS/unk; BOS is prepended."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_model(cfg: PolicyConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def save_policy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Write a folder that transformers and vLLM load: safetensors weights, tokenizer files."""
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # vLLM picks its tokenizer class from this field; the generic fast class encodes a
    # character vocabulary faithfully, where a model-specific class would not.
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2))


def check_policy_folder(folder: Path) -> None:
    """Raise a clear error when ``folder`` is not a loadable safetensors model folder."""
    if not folder.is_dir():
        raise FileNotFoundError(f"policy folder {folder} does not exist")
    missing = [
        name for name in ("config.json", "tokenizer_config.json") if not (folder / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(f"policy folder {folder} lacks {', '.join(missing)}")
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"policy folder {folder} has no *.safetensors weights (pickled .bin weights are "
            "never loaded)"
        )


def build_platform() -> dict[str, str]:
    """What besides the config and seed decides a warm start's weights: the libraries that
    compute it and the CPU's vector instructions (AVX2 and AVX-512 kernels round
    differently), so a policy built on one kind of machine is not reused on another."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _policy_key(cfg: PolicyConfig, env_signature: str, seed: int, chat: bool) -> str:
    blob = json.dumps(
        {
            "policy": cfg.model_dump(),
            "env": env_signature,
            "seed": seed,
            "format": POLICY_FORMAT,
            "platform": build_platform(),
            **({"chat": CHAT_TEMPLATE} if chat else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextmanager
def reproducible(threads: int = WARMSTART_THREADS) -> Iterator[None]:
    """torch on ``threads`` threads with deterministic kernels, restored afterwards."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


def prepare_policy(
    cfg: PolicyConfig,
    env: Environment,
    env_signature: str,
    seed: int,
    cache_dir: Path,
    scorer: Scorer | None = None,
    chat: bool = False,
    steps: EpisodeSteps | None = None,
) -> Path:
    """The starting policy's folder: ``cfg.path`` as given, or a cached tiny policy,
    warm-started on ``env``'s reference answers until ``scorer`` (default: ``env``'s
    verifier) finds it right often enough. ``env_signature`` must name the scorer too.
    ``chat``: the tiny policy is a chat model (``CHAT_TEMPLATE``), for a single-turn ``env``.
    ``steps``: a multi-turn ``env``'s steps, run isolated, for the warm start's episodes."""
    if cfg.path:
        folder = Path(cfg.path).expanduser().resolve()
        check_policy_folder(folder)
        return folder
    if chat and is_multi_turn(env):
        raise ValueError("the tiny chat policy is warm-started on single-turn environments only")
    folder = cache_dir / "policies" / _policy_key(cfg, env_signature, seed, chat)
    if (folder / WARMSTART_FILE).is_file():
        log.info("reusing cached policy %s", folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        verdicts = scorer or VerifierScorer(env)
        with reproducible():
            report = _build_and_warm_start(cfg, env, verdicts, seed, staging, chat, steps)
        (staging / WARMSTART_FILE).write_text(json.dumps(report, indent=2))
        # Rename is atomic: a crash mid-build never leaves a half-written policy behind.
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _encode(
    tokenizer: PreTrainedTokenizerFast, problem: Problem, prompt: str, episode: bool
) -> tuple[list[int], list[int]]:
    """A problem's prompt (as ``prompt`` writes it) and reference answer as token ids, and
    which of them are learned (the answer and its EOS). A multi-turn environment's reference
    episode: each model turn ends with EOS, as a sampled turn does, and the observations
    between are not learned."""
    ids = tokenizer(prompt)["input_ids"]
    learned = [0] * len(ids)
    turns = reference_turns(problem.answer) if episode else [problem.answer]
    for i, turn in enumerate(turns):
        turn_ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
        model = i % 2 == 0
        if model:
            turn_ids = [*turn_ids, EOS_ID]
        ids += turn_ids
        learned += [int(model)] * len(turn_ids)
    return ids, learned


def _sft_batch(
    rows: list[tuple[list[int], list[int]]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, learned) in enumerate(rows):
        row = torch.tensor(ids)
        input_ids[i, : len(ids)] = row
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(learned) == 1, row, -100)
    return input_ids, attention, labels


@torch.no_grad()
def greedy_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    scorer: Scorer,
    problems: list[Problem],
    max_new_tokens: int,
    prompts: list[str] | None = None,
) -> float:
    """Fraction of ``problems`` the model solves with greedy decoding (HF generate) from
    their prompts (or from ``prompts``, the same ones written another way)."""
    model.eval()
    tokenizer.padding_side = "left"
    texts = prompts if prompts is not None else [p.prompt for p in problems]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    pad = PAD_ID if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    eos = EOS_ID if tokenizer.eos_token_id is None else tokenizer.eos_token_id
    out = model.generate(
        **encoded,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    generated = out[:, encoded["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    # A reply's length: up to and with its end-of-sequence token (a model folder may pad
    # with its EOS, as SmolLM2 does).
    ended = (generated == eos).int()
    lengths = torch.where(
        ended.any(dim=1), ended.argmax(dim=1) + 1, torch.full_like(ended[:, 0], generated.shape[1])
    ).tolist()
    model.train()
    results = scorer.score(problems, [[t] for t in texts], [[n] for n in lengths])
    return sum(r[0].correct for r in results) / len(problems)


@torch.no_grad()
def greedy_episodes(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    steps: EpisodeSteps,
    problems: list[Problem],
    max_new_tokens: int,
    max_turns: int,
) -> float:
    """Fraction of ``problems`` whose greedy episode (HF generate, turn by turn, with the
    environment's real observations appended as tokens) the environment calls correct; a
    failed step ends its episode unsolved."""
    model.eval()
    sequences = [list(tokenizer(p.prompt)["input_ids"]) for p in problems]
    histories: list[list[str]] = [[] for _ in problems]
    correct = [False] * len(problems)
    active = list(range(len(problems)))
    for _ in range(max_turns):
        if not active:
            break
        width = max(len(sequences[i]) for i in active)
        input_ids = torch.full((len(active), width), PAD_ID, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, i in enumerate(active):  # left-padded
            input_ids[row, width - len(sequences[i]) :] = torch.tensor(sequences[i])
            attention[row, width - len(sequences[i]) :] = 1
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
        for row, i in enumerate(active):
            turn = out[row, width:].tolist()
            turn = turn[: turn.index(EOS_ID) + 1] if EOS_ID in turn else turn
            sequences[i] += turn
            histories[i].append(tokenizer.decode(turn, skip_special_tokens=True))
        going_on = []
        answers = [steps.submit(problems[i], list(histories[i])) for i in active]
        for i, answer in zip(active, answers, strict=True):
            step = answer.result().outcome
            if isinstance(step, StepFailed) or step.done:
                correct[i] = isinstance(step, EnvStep) and step.correct
                continue
            sequences[i] += tokenizer(step.observation, add_special_tokens=False)["input_ids"]
            histories[i].append(step.observation)
            going_on.append(i)
        active = going_on
    model.train()
    return sum(correct) / len(problems)


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """``prompt`` as the chat template renders it for a reply: the user's message, then the
    assistant's turn opened (without BOS, which tokenizing adds)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return str(text).removeprefix(tokenizer.bos_token)


def _build_and_warm_start(
    cfg: PolicyConfig,
    env: Environment,
    scorer: Scorer,
    seed: int,
    out: Path,
    chat: bool,
    steps: EpisodeSteps | None,
) -> dict:
    tokenizer = build_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model(cfg, vocab_size=len(tokenizer), seed=seed)
    params = sum(p.numel() for p in model.parameters())
    train = env.problems("train", 20000, seed)
    heldout = env.problems("heldout", 128, seed + 1)

    def prompt(problem: Problem) -> str:
        return chat_prompt(tokenizer, problem.prompt) if chat else problem.prompt

    max_new = max(len(p.answer) for p in heldout) + 4

    def measure() -> float:
        if not is_multi_turn(env):
            texts = [prompt(p) for p in heldout]
            return greedy_accuracy(model, tokenizer, scorer, heldout, max_new, texts)
        episodes = [reference_turns(p.answer) for p in heldout]
        turn_tokens = max(len(turn) for turns in episodes for turn in turns[::2]) + 4
        most = max((len(turns) + 1) // 2 for turns in episodes)
        if steps is None:
            raise ValueError(f"{env.name!r} is multi-turn: its warm start needs its steps")
        return greedy_episodes(model, tokenizer, steps, heldout, turn_tokens, most)

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0)
    log.info(
        "warm start: %.2fM parameters, target held-out accuracy %.0f%%",
        params / 1e6,
        100 * cfg.warmstart_target,
    )
    start = time.monotonic()
    accuracy, step = measure(), 0
    while accuracy < cfg.warmstart_target and step < cfg.warmstart_max_steps:
        sampled = rng.sample(train, cfg.warmstart_batch)
        batch = _sft_batch([_encode(tokenizer, p, prompt(p), is_multi_turn(env)) for p in sampled])
        loss = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % cfg.warmstart_eval_every == 0:
            accuracy = measure()
            log.info(
                "warm start step %d: loss %.3f, held-out accuracy %.1f%%",
                step,
                loss.item(),
                100 * accuracy,
            )
    if accuracy < cfg.warmstart_target:
        log.warning(
            "warm start stopped at %d steps with held-out accuracy %.1f%% (target %.0f%%)",
            step,
            100 * accuracy,
            100 * cfg.warmstart_target,
        )
    save_policy(model, tokenizer, out)
    return {
        "steps": step,
        "heldout_accuracy": accuracy,
        "parameters": params,
        "seconds": round(time.monotonic() - start, 1),
        "platform": build_platform(),
        "threads": torch.get_num_threads(),
    }
