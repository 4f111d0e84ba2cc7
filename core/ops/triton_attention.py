"""Triton kernels for the paged KV cache: the per-step cache write and a varlen paged attention.

One attention kernel serves decode, verification (1+K queries) and chunked prefill, so a mixed
step is one launch per layer and a CUDA graph captures it with a fixed grid. It reads only the
live KV through the block tables, never a gathered copy. Short-query steps may split each row's
KV over several programs to fill the GPU at small batch: the split count is a runtime argument
(batch sizes share one compiled kernel), and each row uses only the splits its context fills at
MIN_SPLIT_KEYS keys or more each, so a short row is one program that writes its output directly.

Cache layout (shared with `speckernel.ops.paged_attention`): one layer's cache is [2, slots, kv_heads,
head_dim], K then V; position p of a sequence with block table `bt` lives in slot
bt[p // block_size] * block_size + p % block_size.

The kernels are defined on first use, so this module imports without Triton, and Triton's
interpreter (TRITON_INTERPRET=1, read when a kernel is defined) works when it is set after import.
"""

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace

import torch

LOG2E = 1.4426950408889634


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built
    import triton.language as tl

    @triton.jit
    def write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_kvx, stride_kvs, stride_kvh,
                        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        if slot < 0:  # padding token (CUDA-graph batches): nothing to write
            return
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = kv_ptr + slot * stride_kvs + offs_h[:, None] * stride_kvh + offs_d[None, :]
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_kvx, v.to(kv_ptr.dtype.element_ty), mask=mask)

    # num_splits is the grid's split count, a runtime argument (not specialised on 1 or
    # multiples of 16), so the split count never multiplies compiled variants.
    # The block-table width moves with the context where a backend does not fix it (a
    # speculator's own attention): specialized on it, each multiple of 16 would build a variant
    # mid-serving.
    @triton.jit(do_not_specialize=["num_splits", "stride_btr"])
    def paged_attention_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
        q_ptr, kv_ptr, out_ptr, bt_ptr, seq_lens_ptr, qstart_ptr, part_acc_ptr, part_ml_ptr, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kvx, stride_kvs, stride_kvh, stride_btr, stride_btc, num_splits,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
        MIN_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, DOT_FP32: tl.constexpr, ALL_MASKED: tl.constexpr,
    ):
        # M packs (query token, head of the GQA group): m = token * GROUP + head_in_group, so one
        # program loads each K/V tile once for all query heads that share the kv head.
        # Axis 2 is the M block, or with SPLIT (all of a row's M in one block) the KV split: a row
        # uses as many splits as its context needs (see MIN_SPLIT_KEYS); with one, that split writes
        # the output, with more each writes an unnormalized partial that combine_kernel merges.
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        if SPLIT:
            m_start = 0
        else:
            m_start = tl.program_id(2) * BLOCK_M
        q_lo = tl.load(qstart_ptr + row)
        n_q = tl.load(qstart_ptr + row + 1) - q_lo
        if m_start >= n_q * GROUP:  # past this row's queries (or a padding row): nothing to do
            return
        seq_len = tl.load(seq_lens_ptr + row)
        first_pos = seq_len - n_q  # position of the row's first query
        # Keys up to this program's last query position; later ones are masked for all its queries.
        # (With SPLIT the program holds all the row's queries: kv_end = seq_len.)
        last_tok = tl.minimum(n_q - 1, (m_start + BLOCK_M - 1) // GROUP)
        kv_end = first_pos + last_tok + 1
        lo = kv_end * 0
        hi = kv_end
        used = 1
        if SPLIT:
            # Same arithmetic as combine_kernel's. Every used split starts below kv_end.
            per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits) * BLOCK_N, MIN_SPLIT)
            used = tl.cdiv(kv_end, per_split)
            lo = tl.program_id(2) * per_split
            hi = tl.minimum(lo + per_split, kv_end)
        if lo >= hi:  # a split past the row's used ones (never without SPLIT: kv_end >= 1)
            return
        offs_m = m_start + tl.arange(0, BLOCK_M)
        tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        m_valid = offs_m < n_q * GROUP
        q_pos = first_pos + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        io_mask = m_valid[:, None] & d_valid[None, :]
        q = tl.load(q_ptr + (q_lo + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        # Keys below full_end are visible to every query of the program: those tiles skip masking.
        # ALL_MASKED (batch-invariant) runs every tile through the masked code, so a query's tile
        # is computed by the same instructions whichever queries share its program.
        if ALL_MASKED:
            full_end = lo
        else:
            full_end = (first_pos + m_start // GROUP + 1) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = kv_ptr + kvh * stride_kvh
        bt_row = bt_ptr + row * stride_btr
        for masked in tl.static_range(2):
            if masked:
                loop_lo = tl.maximum(lo, full_end)
                loop_hi = hi
            else:
                loop_lo = lo
                loop_hi = tl.minimum(hi, full_end)
            for start in range(loop_lo, loop_hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_valid = offs_n < kv_end
                if masked:
                    block = tl.load(bt_row + (offs_n // PAGE) * stride_btc, mask=n_valid, other=0)
                    kv_mask = n_valid[:, None] & d_valid[None, :]
                else:
                    block = tl.load(bt_row + (offs_n // PAGE) * stride_btc)
                    kv_mask = d_valid[None, :]
                slot = block.to(tl.int64) * PAGE + offs_n % PAGE
                kv_off = slot[:, None] * stride_kvs + offs_d[None, :]
                k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
                if DOT_FP32:
                    k = k.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale_log2
                if masked:
                    # Key 0 is visible to every row (padding rows too), so in the program holding it
                    # the running max is finite and fully masked rows of later tiles add exp2(-inf) = 0.
                    s = tl.where(n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = m_new
                if masked and SPLIT:
                    # A later split can hold no key that a query sees: keep its row at exp2(-inf) = 0, not NaN.
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_ref)
                p = tl.exp2(s - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(k_base + stride_kvx + kv_off, mask=kv_mask, other=0.0)
                if DOT_FP32:
                    v = v.to(tl.float32)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        if used == 1:  # the only program over these keys (l > 0: key 0 is visible to every row)
            acc = acc / l_i[:, None]
            tl.store(out_ptr + (q_lo + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # A query that sees no key of this split leaves m = -inf, l = 0, acc = 0: weight 0 in the combine.
            part = ((row * tl.num_programs(1) + kvh) * num_splits + tl.program_id(2)) * BLOCK_M
            rows = part + tl.arange(0, BLOCK_M)
            tl.store(part_acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], acc)
            tl.store(part_ml_ptr + 2 * rows, m_i)
            tl.store(part_ml_ptr + 2 * rows + 1, l_i)

    @triton.jit(do_not_specialize=["num_splits"])
    def combine_kernel(out_ptr, seq_lens_ptr, qstart_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                       num_splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MIN_SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       MAX_SPLITS: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        q_lo = tl.load(qstart_ptr + row)
        n_q = tl.load(qstart_ptr + row + 1) - q_lo
        seq_len = tl.load(seq_lens_ptr + row)
        # The row's used splits, as paged_attention_kernel counts them (its kv_end is seq_len).
        per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N, MIN_SPLIT)
        used = tl.cdiv(seq_len, per_split)
        if (n_q == 0) | (used <= 1):  # a padding row, or one split that wrote the output itself
            return
        base = (row * tl.num_programs(1) + kvh) * num_splits * BLOCK_M
        offs_s = tl.arange(0, MAX_SPLITS)
        offs_m = tl.arange(0, BLOCK_M)
        ml = part_ml_ptr + 2 * (base + offs_s[:, None] * BLOCK_M + offs_m[None, :])
        m_all = tl.load(ml, mask=(offs_s < used)[:, None], other=float("-inf"))
        l_all = tl.load(ml + 1, mask=(offs_s < used)[:, None], other=0.0)
        m_max = tl.max(m_all, 0)  # finite: split 0 always holds key 0
        l_sum = tl.sum(tl.exp2(m_all - m_max[None, :]) * l_all, 0)
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(used):
            rows = base + split * BLOCK_M + offs_m
            weight = tl.exp2(tl.load(part_ml_ptr + 2 * rows) - m_max)
            acc += weight[:, None] * tl.load(part_acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :])
        acc = acc / l_sum[:, None]
        tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        mask = (offs_m < n_q * GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(out_ptr + (q_lo + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(write_kv=write_kv_kernel, paged_attention=paged_attention_kernel,
                           combine=combine_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into kv [2, slots, kv_heads, D] at slot_mapping [T]; slots < 0 are skipped.

    One launch for K and V (torch's two index_put_ calls are two launches plus index checks)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    assert v.shape == k.shape and kv.shape[0] == 2 and kv.shape[2:] == (kvh, d)
    assert slot_mapping.is_contiguous(), "slots are read as a dense array"
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv.stride(3) == 1, "head_dim must be contiguous"
    _kernels().write_kv[(t,)](
        k, v, kv, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2),
        KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=_next_pow2(kvh), BLOCK_D=_next_pow2(d),
    )


def _config(rows_m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a program's M rows (queries x group heads).

    Short queries (decode, verify) take one program per (row, kv head) with M padded to >= 16,
    the minimum tl.dot tile, and long KV tiles to keep many bytes in flight; long queries take
    flash-attention-sized tiles."""
    # Picked by sweeps on an H200 (Llama-3-8B heads, bf16): decode, verify with 16 queries, 2k prefill.
    if rows_m <= 16:
        return 16, 128, 4, 2
    if rows_m <= SHORT_ROWS:
        return _next_pow2(rows_m), 64, 4, 3
    return 128, 64, 4, 3


INVARIANT_CONFIG = (16, 128, 4, 2)
"""The batch-invariant mode's one (BLOCK_M, BLOCK_N, num_warps, num_stages), for every query
length: decode's tiles, so decode and verification cost what they do by default."""
SHORT_ROWS = 64
"""Rows of M (queries x GQA group) up to which a row is one program, which may split its KV."""
MAX_SPLITS = 16
"""Most KV splits of a row (the combine kernel's split block)."""
MIN_SPLIT_KEYS = 256
"""Fewest keys a used KV split covers (rounded up to whole BLOCK_N tiles). Each row takes
max(its share of the context, this) keys per split and so uses ceil(kv_len / that) splits: a
context up to this long is one split, which writes the output itself with no combine work."""


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_splits(programs: int, device: torch.device) -> int:
    """KV splits so that short-query steps fill the GPU: (rows x kv heads) programs alone leave
    most SMs idle at small batch (1 x 8 kv heads = 8 programs on 132 SMs). Context lengths live
    on the device (CUDA graphs), so this looks at the grid only: it is the most splits a row
    may use. Each row uses only as many as its context fills at MIN_SPLIT_KEYS keys or more
    each; the programs of the splits it leaves unused return at once, and a row in one split
    skips the combine. About one program per SM measured best (H200: 16 splits for 8 programs,
    4 for 64, none from 256)."""
    if device.type != "cuda":
        return 1
    want = -(-_num_sms(device) // programs)
    return 1 if want <= 1 else min(MAX_SPLITS, _next_pow2(want))


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_size: int,
    out: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal attention of each row's new queries over its paged context.

    q [T, H, D]; kv [2, slots, KVH, D]; block_tables [R, MB]; seq_lens [R] (context length after
    this step, new tokens already in the cache); query_start [R+1] (row r's queries are
    q[query_start[r]:query_start[r+1]], at the last positions of its context). max_query_len
    only sizes the grid, so a CUDA graph can pass a fixed bound. Tokens past query_start[R]
    are left as they are in `out`. num_kv_splits (short queries only, 1 to MAX_SPLITS; default:
    by the grid's size on the GPU) is the most programs a row's KV is split over; above 1 a
    combine launch follows. A row uses ceil(seq_len / per_split) of them, per_split being
    max(its share of the splits, MIN_SPLIT_KEYS) keys; with one it gets no combine work.

    invariant: batch-invariant, each query's output independent of the step: one tile
    configuration (INVARIANT_CONFIG) whatever the query length, no KV splits, and every tile
    masked. A query then reads the same KV tiles in the same order with the same instructions in
    a decode, a verification or a prefill step (the extra keys of a longer program are masked to
    exp2(-inf) = 0, which adds exactly nothing)."""
    t, h, d = q.shape
    kvh = kv.shape[2]
    assert h % kvh == 0, "query heads must be a multiple of kv heads"
    assert kv.shape[0] == 2 and kv.shape[3] == d
    assert q.stride(2) == 1 and kv.stride(3) == 1, "head_dim must be contiguous"
    assert seq_lens.is_contiguous() and query_start.is_contiguous(), "lengths are read as dense arrays"
    if out is None:
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    r = block_tables.shape[0]
    group = h // kvh
    if r == 0 or max_query_len <= 0 or t == 0:
        return out
    rows_m = max_query_len * group
    block_m, block_n, num_warps, num_stages = INVARIANT_CONFIG if invariant else _config(rows_m)
    block_d = _next_pow2(d)
    splits = 1
    if invariant:
        assert num_kv_splits in (None, 1), "batch-invariant attention does not split KV"
    elif rows_m <= SHORT_ROWS:
        splits = _default_splits(r * kvh, q.device) if num_kv_splits is None else num_kv_splits
    assert 1 <= splits <= MAX_SPLITS, f"num_kv_splits must be 1 to {MAX_SPLITS}"
    min_split = max(1, -(-MIN_SPLIT_KEYS // block_n)) * block_n
    if splits > 1:
        grid = (r, kvh, splits)
        part_acc = torch.empty((r * kvh * splits * block_m, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((r * kvh * splits * block_m, 2), dtype=torch.float32, device=q.device)
    else:
        grid = (r, kvh, math.ceil(rows_m / block_m))
        part_acc = part_ml = out  # unused
    kernels = _kernels()
    kernels.paged_attention[grid](
        q, kv, out, block_tables, seq_lens, query_start, part_acc, part_ml, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), block_tables.stride(0), block_tables.stride(1), splits,
        GROUP=group, HEAD_DIM=d, PAGE=block_size, SPLIT=splits > 1, MIN_SPLIT=min_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
        # Triton's interpreter multiplies bf16 bit patterns as integers in tl.dot: widen there.
        DOT_FP32=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1", ALL_MASKED=invariant,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        kernels.combine[(r, kvh)](
            out, seq_lens, query_start, part_acc, part_ml, out.stride(0), out.stride(1), splits,
            GROUP=group, HEAD_DIM=d, MIN_SPLIT=min_split, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, MAX_SPLITS=MAX_SPLITS, num_warps=4,
        )
    return out


def warm_up(kv: torch.Tensor, num_heads: int, block_size: int, invariant: bool = False) -> int:
    """Builds every variant of the attention kernels a step can launch with this cache: one per
    tile configuration a query length leads to (`_config`), with and without KV splits where the
    device splits; batch-invariant, the one variant every step launches. Steps the device graphs
    capture build theirs anyway; eager steps (several prompts, a chunk beside decode rows) would
    otherwise build the rest while serving, each a stall of up to a second for every request in
    flight. Returns the launches made."""
    kvh, d = kv.shape[2], kv.shape[3]
    group = num_heads // kvh
    if invariant:
        q = torch.zeros((1, num_heads, d), dtype=kv.dtype, device=kv.device)
        tables = torch.zeros((1, 1), dtype=torch.int64, device=kv.device)
        lens = torch.tensor([1], dtype=torch.int64, device=kv.device)
        query_start = torch.tensor([0, 1], dtype=torch.int64, device=kv.device)
        paged_attention(q, kv, tables, lens, query_start, 1, 1.0, block_size, invariant=True)
        return 1
    seen: set[tuple[int, int, int, int]] = set()
    query_lens = []
    for n in range(1, 4 * SHORT_ROWS + 1):  # up to past the long-query tiles
        config = _config(n * group)
        if config not in seen:
            seen.add(config)
            query_lens.append(n)
    splits = (1, 2) if kv.device.type == "cuda" else (1,)
    launches = 0
    for n in query_lens:
        q = torch.zeros((n, num_heads, d), dtype=kv.dtype, device=kv.device)
        tables = torch.zeros((1, -(-n // block_size)), dtype=torch.int64, device=kv.device)
        seq_lens = torch.tensor([n], dtype=torch.int64, device=kv.device)
        query_start = torch.tensor([0, n], dtype=torch.int64, device=kv.device)
        for s in splits if n * group <= SHORT_ROWS else (1,):
            paged_attention(q, kv, tables, seq_lens, query_start, n, 1.0, block_size, num_kv_splits=s)
            launches += 1
    return launches
