"""A Hugging Face config.json onto ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import UnknownModelError
from ..model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling


def rope_scaling_from_hf(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type", raw.get("type", "default"))
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        original_max_position=raw.get("original_max_position_embeddings"),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        beta_fast=float(raw.get("beta_fast", 32.0)),
        beta_slow=float(raw.get("beta_slow", 1.0)),
        attention_factor=raw.get("attention_factor"),
    )


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnknownModelError(
            f"model_type {model_type!r} ({archs}) is not a supported Llama-family architecture; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests theta and scaling here
    rope_theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or rope),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
        qk_norm=model_type == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def hf_config(folder: Path) -> ModelConfig:
    return from_hf_config(json.loads((folder / "config.json").read_text()))
