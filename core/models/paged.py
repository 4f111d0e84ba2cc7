"""Paged-attention metadata for a batch of sequences: shared by the target and draft models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .llama import AttentionGroup, AttentionMetadata

SHORT_QUERY = 16
"""Rows with at most this many new tokens (decode, verify) are batched in one padded group."""


def _group(rows: list[tuple[int, int, int, np.ndarray]], block_size: int,
           device: torch.device) -> AttentionGroup:
    """rows: (offset of the first new token in the step, start_pos, num_new, block table)."""
    q_len = max(n for _, _, n, _ in rows)
    ctx_len = max(start + n for _, start, n, _ in rows)
    r = len(rows)
    q_index = np.zeros((r, q_len), np.int64)
    k_slots = np.zeros((r, ctx_len), np.int64)
    mask = np.zeros((r, q_len, ctx_len), bool)
    valid = np.zeros((r, q_len), bool)
    ctx = np.arange(ctx_len)
    for i, (offset, start, n, table) in enumerate(rows):
        end = start + n
        q_index[i, :n] = offset + np.arange(n)
        q_index[i, n:] = offset + n - 1
        k_slots[i, :end] = table[ctx[:end] // block_size] * block_size + ctx[:end] % block_size
        q_pos = np.minimum(start + np.arange(q_len), end - 1)  # padding queries copy the last one
        mask[i] = ctx[None, :] <= q_pos[:, None]
        valid[i, :n] = True

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return AttentionGroup(q_index=dev(q_index), k_slots=dev(k_slots), mask=dev(mask), valid=dev(valid),
                          out_index=dev(q_index[valid]))


def build_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """chunks: (start_pos, num_new_tokens, block_ids) per sequence, in batch order."""
    positions, slots, short, long = [], [], [], []
    offset = 0
    for start, n, block_ids in chunks:
        table = np.asarray(block_ids, dtype=np.int64)
        pos = np.arange(start, start + n)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        (short if n <= SHORT_QUERY else long).append((offset, start, n, table))
        offset += n
    groups = [_group(short, block_size, device)] if short else []
    groups += [_group([row], block_size, device) for row in long]
    return AttentionMetadata(
        positions=torch.from_numpy(np.concatenate(positions)).to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device, non_blocking=True),
        groups=groups,
    )


def new_kv_cache(model_cfg, num_blocks: int, block_size: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                 device: torch.device) -> torch.Tensor:
    return torch.zeros(model_cfg.num_layers, 2, num_blocks * block_size, model_cfg.num_kv_heads,
                       model_cfg.head_dim, dtype=dtype, device=device)


def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:  # type: ignore[no-untyped-def]
    elem = torch.empty((), dtype=dtype).element_size()
    return model_cfg.num_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
