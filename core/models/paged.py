"""Paged KV-cache allocation and sizing, shared by the target and draft models."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..attention import AttentionMetadata, TorchPagedAttention
from .config import ModelConfig


def build_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """One-off metadata from a fresh TorchPagedAttention, for callers not yet holding a backend
    of their own (`Platform.attention_backend`): it allocates its buffers on every call."""
    backend = TorchPagedAttention(block_size, sum(n for _, n, _ in chunks), device)
    return backend.prepare(chunks)


def new_kv_cache(model_cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """[layers, 2, slots, kv_heads, head_dim]; slot = block_id * block_size + offset."""
    return torch.zeros(model_cfg.num_layers, 2, num_blocks * block_size, model_cfg.num_kv_heads,
                       model_cfg.head_dim, dtype=dtype, device=device)


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model_cfg.num_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
