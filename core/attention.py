"""The attention-backend contract: how a model's attention writes and reads the paged KV cache.

A backend turns a step's chunks into metadata once per step (`prepare`) and runs attention
for every layer from it (`forward`). The metadata carries the backend that made it, so the
model calls `meta.backend.forward(...)` and never knows which backend runs; the platform
picks the backend (`Platform.attention_backend`). The backends themselves live in
`speckernel.ops.paged_attention`.

Cache layout, shared by every backend: one layer's cache is [2, slots, kv_heads, head_dim]
(K then V), and position p of a sequence with block table `block_ids` lives in slot
block_ids[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the contract imports without torch
    import numpy as np
    import torch

Chunk = tuple[int, int, Sequence[int]]
"""(start_pos, num_new_tokens, block_ids) of one sequence in a step."""


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
    """One step's attention plan, made by `backend.prepare` and valid until its next call.

    Every tensor is a view of the backend's one persistent device buffer, at offsets that
    depend only on the padded sizes: a device graph captured on one step's metadata reads the
    next step's numbers of the same sizes."""

    positions: torch.Tensor
    """[T] position of each new token (0 for padding tokens)."""
    slot_mapping: torch.Tensor
    """[T] flat cache slot where each new token's K/V is written; -1 for padding tokens."""
    token_rows: torch.Tensor
    """[T] row of each token (padding tokens: the last row)."""
    query_start: torch.Tensor
    """[R + 1] offset of each row's first token; a padding row has none."""
    seq_lens: torch.Tensor
    """[R] context length of each row after this step (0 for padding rows)."""
    block_tables: torch.Tensor
    """[R, max_blocks] block ids of each row (0 past its table)."""
    max_query_len: int
    """Upper bound of any row's new tokens (sizes kernel grids)."""
    backend: AttentionBackend
    """The backend that made this metadata and runs attention from it."""
    row_extra: torch.Tensor | None = None
    """[R, E] int64 numbers the caller rode along on the same copy (the runner's per-row plan)."""
    row_floats: torch.Tensor | None = None
    """[F, R] float32 numbers the caller rode along on the same copy, one row per field (the
    plan's float columns, each contiguous)."""
    tail: torch.Tensor | None = None
    """[N] int64 numbers the caller rode along after everything else (host-known tokens)."""
    groups: list[AttentionGroup] = field(default_factory=list)
    """TorchPagedAttention's plan: decode-like rows share one padded group; each long prefill
    chunk is a group of its own, so attention costs what the sequences need, not (all
    queries) x (all contexts)."""


@runtime_checkable
class AttentionBackend(Protocol):
    block_size: int
    supports_padding: bool
    """Steps may pad to fixed token and row counts (slot -1 tokens, empty rows): what device
    graphs need. A backend that plans groups on the host cannot."""
    device_planned: bool
    """forward() reads nothing but the plan buffer, so the runner may move a row's positions,
    cache slots and context length on the device after prepare() (run-ahead), and variable-width
    drafts can be padded there instead of copied to the host."""
    buffer: torch.Tensor
    """The device buffer every metadata tensor is a view of; graphs replay on it, so it must not
    move once they are captured."""

    def reserve(self, num_tokens: int, num_rows: int, row_fields: int, tail: int, row_floats: int = 0) -> None:
        """Grows `buffer` now to fit any step up to these sizes, so it never moves later."""
        ...

    def prepare(self, chunks: Sequence[Chunk], *, num_tokens: int = 0, num_rows: int = 0,
                row_extra: np.ndarray | None = None, row_floats: np.ndarray | None = None,
                tail: np.ndarray | None = None, max_query_len: int = 0) -> AttentionMetadata:
        """chunks: (start_pos, num_new_tokens, block_ids) per sequence, in batch order;
        num_tokens / num_rows / max_query_len pad the step to those sizes (device graphs);
        row_extra [rows, E] int64, row_floats [F, rows] float32 and tail [N] int64 ride along on
        the same host-to-device copy."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, written: bool = False) -> torch.Tensor:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim], already roped; kv is one
        layer's cache. Writes k, v into meta.slot_mapping, then attends; returns [T, heads, head_dim].
        written: the caller already put k and v into the cache at meta.slot_mapping (a projection
        kernel that writes them as it makes them), so the backend only attends."""
        ...

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] into one layer's cache at slot_mapping [N]; slots < 0 are
        skipped. Reads only device tensors (a drafter's pass inside a captured step)."""
        ...

    def warm_up(self, kv: torch.Tensor, num_heads: int) -> int:
        """Builds every kernel variant a step can launch on this cache (one layer's) for queries of
        `num_heads` heads, so none is built while serving; returns the launches made (0 where the
        backend's kernels need no building)."""
        ...

    def attend(self, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Each query q[n] [N, heads, head_dim] attends to the first seq_lens[n] positions of the
        sequence with block table block_tables[n] [N, max_blocks]: a drafter's queries (one per
        row, or one per block position with the table repeated), planned on the device only."""
        ...


