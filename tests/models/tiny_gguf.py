"""A tiny Llama GGUF file written with `gguf`'s own writer: Q4_1 and Q8_0 matrices, F32 norms
and a byte-level BPE vocabulary, so conversion runs end to end in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes: the byte-level BPE alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tokens = [*byte_tokens(), "<s>", "</s>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)

    def matrix(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        data = rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, HIDDEN)).astype(np.float32))

    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    matrix("token_embd.weight", vocab, HIDDEN, q80)
    norm("output_norm.weight")
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, q41)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, q41)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, q41)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, q41)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, q41)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, q41)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, q41)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
