"""Paged KV-cache allocation and sizing, shared by the target and draft models."""

from __future__ import annotations

import math

import torch

from ..model_config import ModelConfig


def new_kv_cache(model_cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """[layers, 2, slots, kv_heads, head_dim]; slot = block_id * block_size + offset."""
    shape = (model_cfg.num_layers, 2, num_blocks * block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
    if torch.device(device).type == "cpu":  # calloc'd: zero pages the OS fills on first touch, not at start (~1 s/GiB)
        import numpy as np

        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model_cfg.num_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
