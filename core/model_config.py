"""Shape and numerics of a Llama-family target: what the kernel, the ops and every speculator
read about the model (filled from GGUF metadata or a config.json by the loaders)."""

from __future__ import annotations

import msgspec


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    kind: str = "default"
    """default, linear, dynamic, llama3 or yarn."""
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Qwen2 puts biases on q, k and v."""
    qk_norm: bool = False
    """Qwen3 normalises each head of q and k."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
