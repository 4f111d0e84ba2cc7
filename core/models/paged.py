"""Paged-attention metadata for a batch of sequences: shared by the target and draft models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .llama import AttentionMetadata


def build_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """chunks: (start_pos, num_new_tokens, block_ids) per sequence, in batch order."""
    positions, slots, ctx_slots, q_rows, k_rows, k_pos = [], [], [], [], [], []
    for r, (start, n, block_ids) in enumerate(chunks):
        end = start + n
        table = np.asarray(block_ids, dtype=np.int64)
        pos = np.arange(start, end)
        ctx = np.arange(end)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        ctx_slots.append(table[ctx // block_size] * block_size + ctx % block_size)
        q_rows.append(np.full(n, r))
        k_rows.append(np.full(end, r))
        k_pos.append(ctx)
    q_pos, kp = np.concatenate(positions), np.concatenate(k_pos)
    mask = (np.concatenate(q_rows)[:, None] == np.concatenate(k_rows)[None, :]) & (kp[None, :] <= q_pos[:, None])

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return AttentionMetadata(positions=dev(q_pos), slot_mapping=dev(np.concatenate(slots)),
                             context_slots=dev(np.concatenate(ctx_slots)), mask=dev(mask))


def new_kv_cache(model_cfg, num_blocks: int, block_size: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                 device: torch.device) -> torch.Tensor:
    return torch.zeros(model_cfg.num_layers, 2, num_blocks * block_size, model_cfg.num_kv_heads,
                       model_cfg.head_dim, dtype=dtype, device=device)


def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:  # type: ignore[no-untyped-def]
    elem = torch.empty((), dtype=dtype).element_size()
    return model_cfg.num_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
