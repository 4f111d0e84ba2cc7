"""The paged attention backends: one persistent plan buffer per backend, then torch SDPA over
gathered slots (anywhere) or the project's Triton kernels (where Triton runs).

Their contract, and the cache layout they share, is `speckernel.attention`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionGroup, AttentionMetadata, Chunk
from .staging import StagingRing

ALIGN = 2
"""int64 elements per 16 bytes: where each view of the plan buffer starts."""


def _words(n: int) -> int:
    """int64 elements that hold n float32 numbers."""
    return -(-n // 2)


class _Layout(NamedTuple):
    """A step's sizes placed in the plan buffer (`PagedAttention._layout`)."""

    total: int
    spans: list[tuple[int, int]]
    """[start, end) of positions, slots, token rows, query starts, context lengths, extras, floats,
    block tables and the tail."""
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """positions, slot_mapping, token_rows, query_start, seq_lens, block_tables on the device."""
    extra: torch.Tensor | None
    floats: torch.Tensor | None
    tail: torch.Tensor | None


MAX_LAYOUTS = 512
"""Layouts a backend keeps (prefill chunks of every length would grow them without bound)."""

SHORT_QUERY = 16
"""Rows with at most this many new tokens (decode, verify) are batched in one padded group."""


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


class PagedAttention:
    """What every paged backend shares: the step's plan in one persistent device buffer.

    A step costs one host-to-device copy, with no device allocation: the host packs positions,
    slots, token rows, query offsets, context lengths, block tables and the caller's extras (its
    int64 and float32 per-row numbers, each in a section of its own dtype) in one staging array.
    The next `prepare` overwrites them: prepare() and forward() of consecutive steps must be
    issued in order on one stream (one thread on the CPU), where a step's metadata is consumed
    before the next is written. A second model (a drafter) takes a
    backend of its own, so its prepare() never clobbers the target's metadata mid-step.

    With `pin_host`, each step stages its numbers in a `StagingRing` of STAGING_RING pinned host
    buffers and copies without blocking.

    `max_blocks` fixes the width of the block tables (so offsets depend only on the padded
    token and row counts, as device graphs need); 0 sizes them to each step's longest table.

    `batch_invariant`: each query token's output is bit for bit the same whatever else is in
    the step (other rows, its row's other queries: decode, verification and prefill chunks
    alike); see each backend for how.
    """

    supports_padding = True
    """Padding tokens (slot -1) are skipped by forward()."""
    device_planned = True
    """forward() reads nothing but the plan buffer, so the runner may move a row's positions,
    cache slots and context length on the device (run-ahead) after prepare()."""
    STAGING_RING = 4

    def __init__(self, block_size: int, max_tokens: int, device: torch.device, pin_host: bool = False,
                 max_rows: int = 1, max_blocks: int = 0, batch_invariant: bool = False) -> None:
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        self.device = device
        self.pin_host = pin_host
        self.max_blocks = max_blocks
        self.buffer = torch.empty(0, dtype=torch.int64, device=device)
        """The latest step's plan; grows (doubling) for a bigger one."""
        self._layouts: dict[tuple[int | bool, ...], _Layout] = {}
        self.reserve(max(1, max_tokens), max(1, max_rows), 0, 0)
        self.staging = StagingRing(device, torch.int64, pin_host, self.STAGING_RING)

    @property
    def capacity(self) -> int:
        """Elements a step's plan may take before the buffer grows."""
        return self.buffer.numel()

    def reserve(self, num_tokens: int, num_rows: int, row_fields: int, tail: int, row_floats: int = 0) -> None:
        """Grows the buffer now to fit any step up to these sizes, so it never moves later
        (device graphs read it where it was when they were captured)."""
        width = max(1, self.max_blocks)
        need = (3 * num_tokens + (num_rows + 1) + num_rows * (1 + row_fields + width) + tail
                + _words(num_rows * row_floats) + ALIGN * 9)
        if need > self.capacity:
            self._grow(need)

    def prepare(self, chunks: Sequence[Chunk], *, num_tokens: int = 0, num_rows: int = 0,
                row_extra: np.ndarray | None = None, row_floats: np.ndarray | None = None,
                tail: np.ndarray | None = None, max_query_len: int = 0) -> AttentionMetadata:
        lens = np.fromiter((n for _, n, _ in chunks), np.int64, len(chunks))
        starts = np.fromiter((s for s, _, _ in chunks), np.int64, len(chunks))
        real_t, real_r = int(lens.sum()), len(chunks)
        t, r = max(num_tokens, real_t), max(num_rows, real_r)
        if (t > real_t or r > real_r) and not self.supports_padding:
            raise ValueError(f"{type(self).__name__} cannot pad a step")
        width = self.max_blocks or max((len(b) for _, _, b in chunks), default=1) or 1
        e = 0 if row_extra is None else row_extra.shape[1]
        f = 0 if row_floats is None else row_floats.shape[0]
        n_tail = 0 if tail is None else len(tail)
        layout = self._layout(t, r, e, f, width, n_tail, row_extra is not None, row_floats is not None,
                              tail is not None)
        staging = self.staging.take(layout.total, self.capacity)
        host = staging.numpy()
        positions, slots, token_rows, query_start, seq_lens, extra, floats, tables, tail_view = (
            host[a:b] for a, b in layout.spans)
        query_start[0] = 0
        np.cumsum(lens, out=query_start[1 : real_r + 1])
        query_start[real_r + 1 :] = real_t
        rows_of = np.repeat(np.arange(real_r), lens)
        positions[:real_t] = np.arange(real_t) - query_start[rows_of] + starts[rows_of]
        positions[real_t:] = 0
        token_rows[:real_t] = rows_of
        token_rows[real_t:] = r - 1
        seq_lens[:real_r] = starts + lens
        seq_lens[real_r:] = 0
        table2d = tables.reshape(r, width)
        table2d[:] = 0
        for i, (_, _, block_ids) in enumerate(chunks):
            table2d[i, : len(block_ids)] = block_ids
        slots[:real_t] = (table2d[rows_of, positions[:real_t] // self.block_size] * self.block_size
                          + positions[:real_t] % self.block_size)
        slots[real_t:] = -1
        if row_extra is not None:
            extra.reshape(r, e)[:] = 0
            extra.reshape(r, e)[: len(row_extra)] = row_extra
        if row_floats is not None:
            float_rows = floats.view(np.float32)[: f * r].reshape(f, r)
            float_rows[:] = 0
            float_rows[:, : row_floats.shape[1]] = row_floats
        if tail is not None:
            tail_view[:] = tail
        self.buffer[: layout.total].copy_(staging, non_blocking=self.pin_host)
        self.staging.copied()
        d_positions, d_slots, d_rows, d_starts, d_lens, d_tables = layout.views
        meta = AttentionMetadata(
            positions=d_positions, slot_mapping=d_slots, token_rows=d_rows, query_start=d_starts, seq_lens=d_lens,
            block_tables=d_tables, max_query_len=max(int(lens.max(initial=0)), max_query_len), backend=self,
            row_extra=layout.extra, tail=layout.tail, row_floats=layout.floats)
        self.plan(meta, chunks, starts, lens, table2d)
        return meta

    def _layout(self, t: int, r: int, e: int, f: int, width: int, n_tail: int, *has: bool) -> _Layout:
        """Where each part of a step of these sizes lies in the buffer, with its device views: the
        same sizes (every replay of one captured shape) find them made, sparing a dozen tensor
        views a step."""
        key = (t, r, e, f, width, n_tail, *has)
        if (layout := self._layouts.get(key)) is not None:
            return layout
        sizes = [t, t, t, r + 1, r, r * e, _words(f * r), r * width, n_tail]  # the tail last: only it varies
        # Every view starts 16-byte aligned: Triton compiles a kernel variant per pointer
        # alignment, and offsets that moved with the token count would compile new ones mid-serving.
        offsets = [0, *itertools.accumulate(-(-n // ALIGN) * ALIGN for n in sizes)]
        total = offsets[-1]
        if total > self.capacity:
            self._grow(max(total, 2 * self.capacity))
        if len(self._layouts) >= MAX_LAYOUTS:
            self._layouts.clear()
        spans = [(offsets[i], offsets[i] + sizes[i]) for i in range(len(sizes))]
        views = [self.buffer[a:b] for a, b in spans]
        has_extra, has_floats, has_tail = has
        layout = _Layout(
            total, spans, (views[0], views[1], views[2], views[3], views[4], views[7].view(r, width)),
            views[5].view(r, e) if has_extra else None,
            views[6].view(torch.float32)[: f * r].view(f, r) if has_floats else None,
            views[8] if has_tail else None)
        self._layouts[key] = layout
        return layout

    def _grow(self, size: int) -> None:
        """A bigger plan buffer; the layouts kept go with the old one (their views read it)."""
        self.buffer = torch.empty(size, dtype=torch.int64, device=self.device)
        self._layouts.clear()

    def plan(self, meta: AttentionMetadata, chunks: Sequence[Chunk], starts: np.ndarray, lens: np.ndarray,
             tables: np.ndarray) -> None:
        """Backend-specific host planning on top of the shared buffer (none by default)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, written: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # A boolean index waits for the device: fine where steps are planned on the host anyway
        # (the Triton backend skips negative slots inside its kernel).
        keep = slot_mapping >= 0
        kv[0][slot_mapping[keep]] = k[keep].to(kv.dtype)
        kv[1][slot_mapping[keep]] = v[keep].to(kv.dtype)

    def warm_up(self, kv: torch.Tensor, num_heads: int) -> int:
        """torch's kernels need no building."""
        return 0

    def attend(self, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        _n, width = block_tables.shape
        ctx = torch.arange(width * self.block_size, device=q.device)
        slots = block_tables[:, ctx // self.block_size] * self.block_size + ctx % self.block_size
        mask = ctx[None, :] < seq_lens[:, None]
        attended = F.scaled_dot_product_attention(
            q[:, :, None], kv[0][slots].transpose(1, 2), kv[1][slots].transpose(1, 2),
            attn_mask=mask[:, None, None], scale=scale, enable_gqa=True)
        return attended[:, :, 0]


class TorchPagedAttention(PagedAttention):
    """Grouped SDPA over each sequence's gathered context slots: runs wherever torch runs.

    Its groups are planned on the host (index and mask tensors per group), so device graphs run
    on a backend whose kernels read the block tables themselves (`device_planned`). A padded
    step is fine eagerly: padding tokens write no KV and attend to nothing (their outputs are 0).

    Batch-invariant, every query token is a group of its own over exactly the keys it sees:
    the SDPA call's shapes depend on its position alone, never on the step."""

    supports_padding = True
    device_planned = False

    def plan(self, meta: AttentionMetadata, chunks: Sequence[Chunk], starts: np.ndarray, lens: np.ndarray,
             tables: np.ndarray) -> None:
        if self.batch_invariant:
            meta.groups = self._per_query(chunks, tables)
            return
        short: list[tuple[int, int, int, np.ndarray]] = []
        long: list[tuple[int, int, int, np.ndarray]] = []
        offset = 0
        for i, (start, n, block_ids) in enumerate(chunks):
            row = (offset, start, n, tables[i, : len(block_ids)])
            (short if n <= SHORT_QUERY else long).append(row)
            offset += n
        groups = [_group(short, self.block_size, self.device)] if short else []
        groups += [_group([row], self.block_size, self.device) for row in long]
        meta.groups = groups

    def _per_query(self, chunks: Sequence[Chunk], tables: np.ndarray) -> list[AttentionGroup]:
        """One group per query token: one row, one query, its context up to its own position."""
        groups = []
        offset = 0
        for i, (start, n, block_ids) in enumerate(chunks):
            table = tables[i, : len(block_ids)]
            groups += [_group([(offset + j, start + j, 1, table)], self.block_size, self.device) for j in range(n)]
            offset += n
        return groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, written: bool = False) -> torch.Tensor:
        k_cache, v_cache = kv[0], kv[1]
        if not written:
            self.write(k, v, kv, meta.slot_mapping)
        out = torch.zeros_like(q)
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


class TritonPagedAttention(PagedAttention):
    """The project's Triton kernels: the cache write and a paged attention that reads only each
    row's live KV through its block table, for decode, verification and prefill chunks alike.
    Nothing is planned on the host beyond the shared buffer, so steps pad freely and a device
    graph captured on one step replays for the next.

    Batch-invariant, every step runs one tile configuration without KV splits, and every KV
    tile through the masked code path (`triton_attention.paged_attention(invariant=True)`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, written: bool = False) -> torch.Tensor:
        from .triton_attention import paged_attention, write_kv  # triton is optional (Linux x86-64)

        if not written:
            write_kv(k, v, kv, meta.slot_mapping)
        return paged_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start, meta.max_query_len,
                               scale, self.block_size, invariant=self.batch_invariant)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from .triton_attention import write_kv  # triton is optional (Linux x86-64)

        write_kv(k, v, kv, slot_mapping.contiguous())

    def warm_up(self, kv: torch.Tensor, num_heads: int) -> int:
        from .triton_attention import warm_up  # triton is optional (Linux x86-64)

        return warm_up(kv, num_heads, self.block_size, invariant=self.batch_invariant)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        from .triton_attention import paged_attention  # triton is optional (Linux x86-64)

        # The kernels index lengths and slots as dense arrays: a caller's expanded view (one row's
        # length repeated per query is a stride-0 view when there is one row) must be copied.
        query_start = torch.arange(q.shape[0] + 1, device=q.device)
        return paged_attention(q.contiguous(), kv, block_tables.contiguous(), seq_lens.contiguous(), query_start, 1,
                               scale, self.block_size)
