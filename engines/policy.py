"""The starting policy: Sluice's own tiny character-level llama, built offline, or a local folder.

``prepare_policy`` returns a Hugging Face model folder (config.json, model.safetensors,
tokenizer files) that transformers and vLLM both load. With no ``policy.path`` it builds a
small llama with a character tokenizer, warm-starts it by supervised learning on the
environment's own reference answers until held-out greedy accuracy reaches
``policy.warmstart_target`` (so RL starts from a base that is right sometimes), and caches
the folder under ``<cache>/policies/<key>``: a second run with the same settings reuses it.
No hub is ever contacted.
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
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sluice.envs import ALPHABET, Environment, Problem
from sluice.envs.scoring import Scorer, VerifierScorer
from sluice.rl.config import PolicyConfig

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Bump when the way a policy is built changes, so stale cache entries are not reused.
POLICY_FORMAT = 1
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


def _policy_key(cfg: PolicyConfig, env_signature: str, seed: int) -> str:
    blob = json.dumps(
        {"policy": cfg.model_dump(), "env": env_signature, "seed": seed, "format": POLICY_FORMAT},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_policy(
    cfg: PolicyConfig,
    env: Environment,
    env_signature: str,
    seed: int,
    cache_dir: Path,
    scorer: Scorer | None = None,
) -> Path:
    """The starting policy's folder: ``cfg.path`` as given, or a cached tiny policy,
    warm-started on ``env``'s reference answers until ``scorer`` (default: ``env``'s
    verifier) finds it right often enough. ``env_signature`` must name the scorer too."""
    if cfg.path:
        folder = Path(cfg.path).expanduser().resolve()
        check_policy_folder(folder)
        return folder
    folder = cache_dir / "policies" / _policy_key(cfg, env_signature, seed)
    if (folder / WARMSTART_FILE).is_file():
        log.info("reusing cached policy %s", folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        report = _build_and_warm_start(cfg, env, scorer or VerifierScorer(env), seed, staging)
        (staging / WARMSTART_FILE).write_text(json.dumps(report, indent=2))
        # Rename is atomic: a crash mid-build never leaves a half-written policy behind.
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _encode(tokenizer: PreTrainedTokenizerFast, problem: Problem) -> tuple[list[int], int]:
    prompt_ids = tokenizer(problem.prompt)["input_ids"]
    answer_ids = tokenizer(problem.answer, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids + [EOS_ID], len(prompt_ids)


def _sft_batch(
    rows: list[tuple[list[int], int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, prompt_len) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return input_ids, attention, labels


@torch.no_grad()
def greedy_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    scorer: Scorer,
    problems: list[Problem],
    max_new_tokens: int,
) -> float:
    """Fraction of ``problems`` the model solves with greedy decoding (HF generate)."""
    model.eval()
    tokenizer.padding_side = "left"
    encoded = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(
        **encoded,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    generated = out[:, encoded["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    lengths = (generated != PAD_ID).sum(dim=1).tolist()
    model.train()
    results = scorer.score(problems, [[t] for t in texts], [[n] for n in lengths])
    return sum(r[0].correct for r in results) / len(problems)


def _build_and_warm_start(
    cfg: PolicyConfig, env: Environment, scorer: Scorer, seed: int, out: Path
) -> dict:
    tokenizer = build_tokenizer()
    model = build_model(cfg, vocab_size=len(tokenizer), seed=seed)
    params = sum(p.numel() for p in model.parameters())
    train = env.problems("train", 20000, seed)
    heldout = env.problems("heldout", 128, seed + 1)
    max_new = max(len(p.answer) for p in heldout) + 4
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0)
    log.info(
        "warm start: %.2fM parameters, target held-out accuracy %.0f%%",
        params / 1e6,
        100 * cfg.warmstart_target,
    )
    start = time.monotonic()
    accuracy, step = greedy_accuracy(model, tokenizer, scorer, heldout, max_new), 0
    while accuracy < cfg.warmstart_target and step < cfg.warmstart_max_steps:
        batch = _sft_batch([_encode(tokenizer, p) for p in rng.sample(train, cfg.warmstart_batch)])
        loss = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % cfg.warmstart_eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, scorer, heldout, max_new)
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
    }
