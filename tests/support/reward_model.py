"""A tiny sequence-classification reward model built in the test: the character tokenizer
of the tiny policy and a two-layer Llama with one label, saved as a folder the served
reward model loads (safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from sluice.policy.starting import BOS_ID, EOS_ID, PAD_ID, build_tokenizer


def build_reward_model(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        num_labels=1,
        dtype="float32",
    )
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
