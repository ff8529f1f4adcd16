"""A tiny llama written as a GGUF file with the ``gguf`` package, for the conversion tests:
the same layout and tokenizer metadata as SmolLM2's (byte-level BPE, ChatML template, tied
embeddings), at a few thousand parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A 2-layer llama with grouped-query attention (4 heads, 2 KV heads), its weights
    quantized as SmolLM2's are (Q8_0 embedding, Q4_1 projections, F32 norms)."""
    rng = np.random.default_rng(seed)
    tokens = [*SPECIAL, *byte_tokens(), "12"]
    vocab, heads, kv_heads, ffn = len(tokens), 4, 2, 128
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL] * len(SPECIAL) + [TokenType.NORMAL] * (vocab - len(SPECIAL))
    )
    writer.add_token_merges(["1 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weight(name: str, rows: int, cols: int, kind: GGMLQuantizationType) -> None:
        data = rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32)
        writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)

    head_dim = hidden // heads
    weight("token_embd.weight", vocab, hidden, GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        q4 = GGMLQuantizationType.Q4_1
        weight(f"blk.{i}.attn_q.weight", hidden, hidden, q4)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, q4)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, q4)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden, q4)
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden, q4)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden, q4)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn, q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
