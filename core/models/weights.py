"""Checkpoint tensors onto the model's names: Hugging Face safetensors names mapped to one set
of per-layer piece names (GGUF's are mapped in gguf.py), then fused into the model's qkv and
gate_up projections."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..model_config import ModelConfig

HF_PIECES = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
    "mlp.down_proj": "down", "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm", "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
}  # fmt: skip


HF_GLOBALS = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    for file in tqdm(files, desc="loading shards", unit="shard", leave=False, disable=None):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                mapped = map_hf_name(name)
                if mapped is not None:
                    yield mapped, f.get_tensor(name)


def map_hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in HF_GLOBALS:
        return f"{HF_GLOBALS[stem]}.{kind}"
    if stem.startswith("model.layers."):
        _, _, idx, rest = stem.split(".", 3)
        piece = HF_PIECES.get(rest)
        return None if piece is None else f"layers.{idx}.{piece}.{kind}"
    return None


FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


MODULE_OF = {"o": "attn.o", "down": "mlp.down", "q_norm": "attn.q_norm", "k_norm": "attn.k_norm",
             "input_norm": "input_norm", "post_norm": "post_norm"}  # fmt: skip


def assemble(pieces: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name in ("embed.weight", "norm.weight", "lm_head.weight"):
        if name in pieces:
            state[name] = pieces.pop(name)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for fused, parts in FUSED.items():
            owner = "attn" if fused == "qkv" else "mlp"
            for kind in ("weight", "bias"):
                if all(f"{p}{part}.{kind}" in pieces for part in parts):
                    state[f"{p}{owner}.{fused}.{kind}"] = torch.cat(
                        [pieces.pop(f"{p}{part}.{kind}") for part in parts]
                    )
        for piece, module in MODULE_OF.items():
            for kind in ("weight", "bias"):
                if f"{p}{piece}.{kind}" in pieces:
                    state[f"{p}{module}.{kind}"] = pieces.pop(f"{p}{piece}.{kind}")
    return state
