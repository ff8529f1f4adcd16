"""A small Hugging Face model folder with a subword tokenizer and a chat template, built here.

There is no model hub on these machines, so tests that need "a real model" get this: a
byte-level BPE tokenizer trained with ``tokenizers`` on a few thousand generated lines, a
ChatML template (``<|im_start|>role ... <|im_end|>``, with a generation prompt), an
end-of-turn token that the generation config names as EOS, and a randomly initialised
two-layer llama, saved as safetensors. ``policy.path`` points at it like at any model
folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# ChatML, as Qwen's and many other chat models' templates write it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["what", "is", "the", "sum", "of", "and", "answer", "user", "assistant", "plus"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(f"{rng.choice(words)} {a}+{b}={a + b} {' '.join(rng.sample(words, 3))}")
    return out


def build_bpe_policy(
    folder: Path, seed: int = 0, vocab_size: int = 384, tied: bool = False
) -> Path:
    """Write the model folder (config, safetensors weights, tokenizer, template) to ``folder``;
    ``tied``: the output head is the input embedding (as SmolLM2's)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        _corpus(4000, seed),
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=eos,
            pad_token_id=pad,
            tie_word_embeddings=tied,
            dtype="float32",
        )
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # As policy/starting.py's save_policy: vLLM picks its tokenizer class from this field.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
    return folder


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.bpe_policy FOLDER  (writes a tiny chat model)")
    print(f"wrote a tiny chat model folder to {build_bpe_policy(Path(sys.argv[1]))}")
