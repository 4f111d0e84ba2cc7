"""The attention-backend seam: how a model's attention writes and reads the paged KV cache.

A backend turns a step's chunks into metadata once per step (`prepare`) and runs attention
for every layer from it (`forward`). The metadata carries the backend that made it, so the
model calls `meta.backend.forward(...)` and never knows which backend runs; the platform
picks the backend (`Platform.attention_backend`).

Cache layout, shared by every backend: one layer's cache is [2, slots, kv_heads, head_dim]
(K then V), and position p of a sequence with block table `block_ids` lives in slot
block_ids[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

Chunk = tuple[int, int, Sequence[int]]
"""(start_pos, num_new_tokens, block_ids) of one sequence in a step."""

SHORT_QUERY = 16
"""Rows with at most this many new tokens (decode, verify) are batched in one padded group."""


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to a common query and context length."""

    q_index: torch.Tensor
    """[R, Q] index into the step's tokens of each (padded) query."""
    k_slots: torch.Tensor
    """[R, L] flat cache slots of each sequence's context (padded)."""
    mask: torch.Tensor
    """[R, Q, L] True where a query may attend a context slot."""
    valid: torch.Tensor
    """[R, Q] True for real (not padding) queries."""
    out_index: torch.Tensor
    """[T_group] step token index of each real query, in `valid` order."""
    valid_flat: torch.Tensor
    """[T_group] flat index into [R * Q] of each real query: an integer gather, where a boolean
    mask index would make the host wait for the device in every layer."""


@dataclass
class AttentionMetadata:
    """One step's attention plan, made by `backend.prepare` and valid until its next call."""

    positions: torch.Tensor
    """[T] position of each new token."""
    slot_mapping: torch.Tensor
    """[T] flat cache slot where each new token's K/V is written."""
    backend: AttentionBackend
    """The backend that made this metadata and runs attention from it."""
    groups: list[AttentionGroup] = field(default_factory=list)
    """TorchPagedAttention's plan: decode-like rows share one padded group; each long prefill
    chunk is a group of its own, so attention costs what the sequences need, not (all
    queries) x (all contexts)."""


@runtime_checkable
class AttentionBackend(Protocol):
    def prepare(self, chunks: Sequence[Chunk]) -> AttentionMetadata:
        """chunks: (start_pos, num_new_tokens, block_ids) per sequence, in batch order."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim], already roped; kv is one
        layer's cache. Writes k, v into meta.slot_mapping, then attends; returns [T, heads, head_dim]."""
        ...


def cache_slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[positions // block_size] * block_size + positions % block_size


def _group(rows: list[tuple[int, int, int, np.ndarray]], block_size: int, device: torch.device) -> AttentionGroup:
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
        k_slots[i, :end] = cache_slots(table, ctx[:end], block_size)
        q_pos = np.minimum(start + np.arange(q_len), end - 1)  # padding queries copy the last one
        mask[i] = ctx[None, :] <= q_pos[:, None]
        valid[i, :n] = True

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return AttentionGroup(q_index=dev(q_index), k_slots=dev(k_slots), mask=dev(mask), valid=dev(valid),
                          out_index=dev(q_index[valid]), valid_flat=dev(np.flatnonzero(valid)))


class TorchPagedAttention:
    """Grouped SDPA over each sequence's gathered context slots: runs wherever torch runs.

    `positions` and `slot_mapping` live in one persistent device buffer, so a step costs one
    host-to-device copy for both, with no allocation. The next `prepare` overwrites them:
    prepare() and forward() of consecutive steps must be issued in order on one stream (one
    thread on the CPU), where a step's metadata is consumed before the next is written. A
    second model (a drafter) takes a backend of its own, so its prepare() never clobbers the
    target's metadata mid-step.

    With `pin_host`, each step stages its numbers in pinned memory from torch's caching host
    allocator and copies without blocking. The staging is not one persistent host buffer on
    purpose: the host may prepare step N+1 while step N's copy still waits in the stream
    (behind a host gate, say), and the caching allocator never hands a pinned block out again
    before the copy that read it has run, where rewriting one buffer would race with it.
    """

    def __init__(self, block_size: int, max_tokens: int, device: torch.device, pin_host: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.pin_host = pin_host
        self.buffer = torch.empty(2 * max(1, max_tokens), dtype=torch.int64, device=device)
        """positions[:T] then slot_mapping[T:2T] of the latest step; grows (doubling) for a bigger one."""

    @property
    def capacity(self) -> int:
        """Tokens a step may have before the buffer grows."""
        return self.buffer.numel() // 2

    def prepare(self, chunks: Sequence[Chunk]) -> AttentionMetadata:
        num_tokens = sum(n for _, n, _ in chunks)
        staging = torch.empty(2 * num_tokens, dtype=torch.int64, pin_memory=self.pin_host)
        host = staging.numpy()
        positions, slots = host[:num_tokens], host[num_tokens:]
        short, long = [], []
        offset = 0
        for start, n, block_ids in chunks:
            table = np.asarray(block_ids, dtype=np.int64)
            pos = positions[offset : offset + n]
            pos[:] = np.arange(start, start + n)
            slots[offset : offset + n] = cache_slots(table, pos, self.block_size)
            (short if n <= SHORT_QUERY else long).append((offset, start, n, table))
            offset += n
        if num_tokens > self.capacity:
            self.buffer = torch.empty(2 * max(num_tokens, 2 * self.capacity), dtype=torch.int64, device=self.device)
        on_device = self.buffer[: 2 * num_tokens]
        on_device.copy_(staging, non_blocking=self.pin_host)
        groups = [_group(short, self.block_size, self.device)] if short else []
        groups += [_group([row], self.block_size, self.device) for row in long]
        return AttentionMetadata(positions=on_device[:num_tokens], slot_mapping=on_device[num_tokens:],
                                 backend=self, groups=groups)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv[0], kv[1]
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
        out = torch.empty_like(q)
        for g in meta.groups:
            attended = F.scaled_dot_product_attention(
                q[g.q_index].transpose(1, 2),
                k_cache[g.k_slots].transpose(1, 2),
                v_cache[g.k_slots].transpose(1, 2),
                attn_mask=g.mask[:, None],
                scale=scale,
                enable_gqa=True,
            )
            r, nh, q_len, hd = attended.shape
            out[g.out_index] = attended.transpose(1, 2).reshape(r * q_len, nh, hd)[g.valid_flat]
        return out
