"""Projections fused with their elementwise neighbours, for steps of at most MAX_ROWS token rows.

At decode and verification sizes (1 + K tokens per request, a few requests) a layer's GEMMs run
at M <= 16, where a library GEMM costs several times its bytes and every norm, rope and
activation between them is one more launch. Here each projection is one launch that streams
its weight once and does the work around it in the same program:

- `norm_qkv_rope`: RMSNorm prologue, QKV (+ bias), q/k norm, rope epilogue, K and V into the
  paged cache at the step's slot mapping; returns q, k, v for the attention backend.
- `linear_residual`: o-proj or down with the residual add as epilogue: the new residual stream.
- `norm_gate_up`: RMSNorm prologue, gate_up, SwiGLU epilogue.
- `linear`: a plain projection (the LM head, its logits written in float32).

A decoder layer is then four launches plus attention, against ten or eleven on the fused path.

**Tiles.** A program computes acc[BLOCK_N, 16] = W[BLOCK_N, K] @ x[16, K]^T over a loop on K:
the weight is the dot's wide side and the token rows its narrow one (padded to 16, the smallest
`tl.dot` tile), so M = 1..16 share one compiled kernel with M a runtime argument that is never
specialised: a new row count builds nothing while serving. A paired epilogue's tile holds the
columns it combines, BLOCK_N rows then their partners: rope's rows d of one head's first half and
d + head_dim / 2 of its second, SwiGLU's gate columns j and up columns j.

**Split over N only.** Every epilogue but the residual add needs complete sums (rope mixes two
columns, SwiGLU multiplies them, the q/k norm sums a head), and a split-K reduction means a
second launch (what this module removes) or partials that the last program to arrive sums
behind an atomic counter (fragile ordering inside device graphs, and a result whose summation
order changes with timing unless made to wait). Tiles of 16 weight rows give enough programs
where it matters: Llama-3-8B's QKV, o, gate_up and down make 192, 256, 896 and 256 programs at
the smallest tiles; SmolLM2-135M's 30 to 96 programs each read 18-49 KB, where a step is bound by
latency, not by the share of SMs that stream. `TILES` holds the configurations, swept on the
device by `speckernel bench kernels --sweep`.

**Norm prologue.** The output is split over programs, so each one needs the rms of whole rows:
it reads its M rows of x once, in the same K loop as the weight, accumulating sum(x^2) beside the
dot of x * norm_weight with W, and scales its accumulators by rsqrt(mean + eps) at the end. That
re-reads x [M, K] once per program (M / BLOCK_N of the weight's bytes, from L2), where two passes
(the rms first) would read it twice. Rounding: torch rounds x * rstd to the dtype before the
norm weight; here x * norm_weight is rounded (the dot's input) and rstd applied in float32 after:
equal to rounding in half precision, to float32 rounding in float32.

Every result is rounded to the model's dtype where the unfused path rounds it (each projection's
output, the silu before its product, the residual sum), with float32 math between.

Triton runs for CUDA tensors and for CPU tensors under its interpreter (TRITON_INTERPRET=1), as
`fused_ops`; the kernels are defined on first use, so the module imports without Triton.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from .fused_ops import use_triton

MAX_ROWS = 16
"""Most token rows of a step these kernels serve: the dot's narrow side (BLOCK_M)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("rope", "silu", "residual", "plain")
"""The kernel's epilogues: norm_qkv_rope, norm_gate_up, linear_residual, linear."""


class Tile(NamedTuple):
    """One launch configuration. block_n: output columns per program (at least 16, the smallest
    dot; a paired epilogue's tile holds twice as many weight rows, the columns and their
    partners); block_k: the K step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


ANY = 1 << 62
TILES: tuple[tuple[str, int, int, Tile], ...] = (
    # kind, K up to, N up to (N: the weight's rows), tile. First match wins. Measured on an H200
    # (`speckernel bench kernels --sweep`, bench-results/h200-kernels): the best of the sweep for
    # SmolLM2-135M's and Llama-3-8B's shapes, the latter's also serving any larger K.
    ("rope", 576, ANY, Tile(32, 256, 4, 3)),  # qkv K=576 N=960
    ("rope", ANY, ANY, Tile(32, 256, 4, 3)),  # qkv K=4096 N=6144
    ("silu", 576, ANY, Tile(32, 256, 4, 3)),  # gate_up K=576 N=3072
    ("silu", ANY, ANY, Tile(64, 128, 4, 3)),  # gate_up K=4096 N=28672
    ("residual", 576, ANY, Tile(16, 256, 4, 3)),  # o K=576 N=576
    ("residual", 1536, ANY, Tile(16, 128, 4, 5)),  # down K=1536 N=576
    ("residual", 4096, ANY, Tile(32, 512, 4, 3)),  # o K=4096 N=4096
    ("residual", ANY, ANY, Tile(32, 512, 4, 3)),  # down K=14336 N=4096
    ("plain", 576, ANY, Tile(128, 64, 4, 3)),  # head K=576 N=49152
    ("plain", ANY, ANY, Tile(128, 128, 4, 3)),  # head K=4096 N=128256
)


INTERPRETER_TILES: tuple[tuple[str, int, int, Tile], ...] = (
    ("rope", ANY, ANY, Tile(32, 1024, 4, 1)),
    ("silu", ANY, ANY, Tile(256, 1024, 4, 1)),
    ("residual", ANY, ANY, Tile(256, 2048, 4, 1)),
    ("plain", ANY, 512, Tile(512, 64, 4, 1)),
    ("plain", ANY, ANY, Tile(8192, 64, 4, 1)),
)
"""Under Triton's interpreter (TRITON_INTERPRET=1, no GPU) a launch costs by its programs, each
interpreted op by op, not by their size: the tiles that make the fewest programs (a tiny model's
projection is one program, SmolLM2-135M's LM head six, not 96). Tests of the kernels
themselves try the other tiles explicitly."""


def tile_for(kind: str, k: int, n: int) -> Tile:
    """The table's tile for a weight [n, k] under this epilogue."""
    table = INTERPRETER_TILES if os.environ.get("TRITON_INTERPRET") == "1" else TILES
    for row_kind, k_max, n_max, tile in table:
        if row_kind == kind and k <= k_max and n <= n_max:
            return tile
    raise KeyError(f"no tile for {kind} K={k} N={n}")


def runs_on(x: torch.Tensor) -> bool:
    """Whether these kernels can run a step of x [T, H] (T rows)."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in DTYPES and use_triton(x)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built
    import triton.language as tl

    # M (the step's token rows) is the only integer that changes between steps: never
    # specialised, so one build per weight shape serves every row count. Strides and shapes are
    # the model's (inputs are made contiguous), so they fix nothing new while serving.
    @triton.jit(do_not_specialize=["M"])
    def fused_linear_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
        x_ptr, g_ptr, w_ptr, b_ptr, res_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr, kv_ptr,
        M, eps, qk_eps,
        stride_xm, stride_wn, stride_rm, stride_om, stride_cos, stride_sin, stride_kvx, stride_kvs, stride_kvh,
        K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROPE: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, PAIRED: tl.constexpr, ROWS: tl.constexpr,
        HALF: tl.constexpr, PER_HEAD: tl.constexpr, Q_HEADS: tl.constexpr, ROPE_HEADS: tl.constexpr,
        QK_NORM: tl.constexpr, WRITE_KV: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
    ):
        # The program's BLOCK_N output rows d: rope, rows of head p // PER_HEAD's first half (each
        # with its partner d + HALF in the second); SwiGLU, gate columns d (each with up column d +
        # HALF, HALF being the intermediate size); otherwise columns d. The weight tile holds ROWS =
        # BLOCK_N rows, or 2 * BLOCK_N for a paired epilogue: the rows, then their partners.
        pid = tl.program_id(0)
        head = pid // PER_HEAD
        offs = tl.arange(0, ROWS)
        if ROPE:
            d_rows = (pid % PER_HEAD) * BLOCK_N + offs % BLOCK_N
            rows = head * (2 * HALF) + d_rows + (offs // BLOCK_N) * HALF
        else:
            d_rows = pid * BLOCK_N + offs % BLOCK_N
            rows = d_rows + (offs // BLOCK_N) * HALF
        if PAIRED:
            row_valid = d_rows < HALF
        else:
            row_valid = d_rows < N
        offs_m = tl.arange(0, BLOCK_M)
        m_valid = offs_m < M
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([ROWS, BLOCK_M], tl.float32)
        sumsq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x_mask = m_valid[None, :]
                w_mask = row_valid[:, None]
            else:
                k_valid = offs_k < K
                x_mask = k_valid[:, None] & m_valid[None, :]
                w_mask = row_valid[:, None] & k_valid[None, :]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=x_mask, other=0.0)
            xt = xt.to(tl.float32)  # [BLOCK_K, BLOCK_M]: x transposed
            if NORM:
                sumsq += tl.sum(xt * xt, 0)
                if EVEN_K:
                    g = tl.load(g_ptr + offs_k)
                else:
                    g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0)
                xt = xt * g.to(tl.float32)[:, None]
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            # Triton's interpreter multiplies bf16 bit patterns as integers in tl.dot: widen there.
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt.to(w_ptr.dtype.element_ty), acc)
        if NORM:
            acc = acc * tl.rsqrt(sumsq / K + eps)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)[:, None]
        dtype = w_ptr.dtype.element_ty
        y = acc.to(dtype).to(tl.float32)  # the projection's output, rounded as a GEMM's
        d = tl.arange(0, BLOCK_N)
        if PAIRED:  # [rows; partners] -> the two [BLOCK_N, BLOCK_M] halves
            ya, yb = tl.split(tl.permute(tl.reshape(y, [2, BLOCK_N, BLOCK_M]), (1, 2, 0)))
            if ROPE:
                d += (pid % PER_HEAD) * BLOCK_N
                cols_a = head * (2 * HALF) + d
            else:
                d += pid * BLOCK_N
                cols_a = d
            valid = d < HALF
        else:
            ya = y
            d += pid * BLOCK_N
            cols_a = d
            valid = d < N
        io_mask = valid[:, None] & m_valid[None, :]
        out_a = out_ptr + offs_m[None, :] * stride_om + cols_a[:, None]
        if ROPE:
            roped = head < ROPE_HEADS  # q and k heads; v heads pass through
            if QK_NORM:  # a program holds the whole head (PER_HEAD == 1): its rms is the tile's
                r = tl.rsqrt((tl.sum(ya * ya, 0) + tl.sum(yb * yb, 0)) / (2 * HALF) + qk_eps)
                is_q = head < Q_HEADS
                wna = tl.where(is_q, tl.load(qn_ptr + d, mask=valid, other=0.0),
                               tl.load(kn_ptr + d, mask=valid, other=0.0))
                wnb = tl.where(is_q, tl.load(qn_ptr + HALF + d, mask=valid, other=0.0),
                               tl.load(kn_ptr + HALF + d, mask=valid, other=0.0))
                na = (wna.to(tl.float32)[:, None] * (ya * r[None, :]).to(dtype).to(tl.float32)).to(dtype)
                nb = (wnb.to(tl.float32)[:, None] * (yb * r[None, :]).to(dtype).to(tl.float32)).to(dtype)
                ya = tl.where(roped, na.to(tl.float32), ya)
                yb = tl.where(roped, nb.to(tl.float32), yb)
            pos = tl.load(pos_ptr + offs_m, mask=m_valid, other=0)
            c_off = pos[None, :] * stride_cos + d[:, None]
            s_off = pos[None, :] * stride_sin + d[:, None]
            cos_a = tl.load(cos_ptr + c_off, mask=io_mask, other=0.0)
            cos_b = tl.load(cos_ptr + c_off + HALF, mask=io_mask, other=0.0)
            sin_a = tl.load(sin_ptr + s_off, mask=io_mask, other=0.0)
            sin_b = tl.load(sin_ptr + s_off + HALF, mask=io_mask, other=0.0)
            oa = tl.where(roped, ya * cos_a - yb * sin_a, ya)
            ob = tl.where(roped, yb * cos_b + ya * sin_b, yb)
            tl.store(out_a, oa.to(out_ptr.dtype.element_ty), mask=io_mask)
            tl.store(out_a + HALF, ob.to(out_ptr.dtype.element_ty), mask=io_mask)
            if WRITE_KV:
                if head >= Q_HEADS:  # a k or v head: into the cache, [2, slots, kv_heads, head_dim]
                    slot = tl.load(slot_ptr + offs_m, mask=m_valid, other=-1)
                    is_v = head >= ROPE_HEADS
                    kv_head = tl.where(is_v, head - ROPE_HEADS, head - Q_HEADS)
                    plane = tl.where(is_v, 1, 0)
                    dst = kv_ptr + plane * stride_kvx + slot.to(tl.int64)[None, :] * stride_kvs \
                        + kv_head * stride_kvh + d[:, None]
                    kv_mask = io_mask & (slot >= 0)[None, :]  # padding tokens (slot -1) write nothing
                    tl.store(dst, oa.to(kv_ptr.dtype.element_ty), mask=kv_mask)
                    tl.store(dst + HALF, ob.to(kv_ptr.dtype.element_ty), mask=kv_mask)
        elif SILU:
            # silu is rounded to the dtype before the product, as torch's silu(gate) * up is.
            act = (ya / (1.0 + tl.exp(-ya))).to(dtype).to(tl.float32)
            tl.store(out_a, (act * yb).to(out_ptr.dtype.element_ty), mask=io_mask)
        elif RESIDUAL:
            res = tl.load(res_ptr + offs_m[None, :] * stride_rm + cols_a[:, None], mask=io_mask, other=0.0)
            tl.store(out_a, (ya + res.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            tl.store(out_a, ya.to(out_ptr.dtype.element_ty), mask=io_mask)

    return SimpleNamespace(fused_linear=fused_linear_kernel)


class Launch(NamedTuple):
    """One launch of the kernel: its grid, positional arguments and constexprs with launch options."""

    grid: int
    args: tuple[Any, ...]
    meta: dict[str, Any]


def plan(kind: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: Tile | None, *,
         norm: tuple[torch.Tensor, float] | None = None, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
         heads: tuple[int, int, int] = (0, 0, 1), qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
         cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launch:
    """The launch for x [M, K] and w [N, K] (contiguous) under an epilogue (`KINDS`); heads (q heads,
    kv heads, head_dim) for rope; cache (one layer's kv [2, slots, kv_heads, head_dim], slot_mapping
    [T]). Reads shapes, strides and dtypes only (meta tensors plan too)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.is_contiguous() and w.is_contiguous(), (x.shape, w.shape)
    tile = tile or tile_for(kind, k, n)
    block_n, block_k = tile.block_n, tile.block_k
    nh, nkv, hd = heads
    paired = kind in ("rope", "silu")
    half = hd // 2 if kind == "rope" else n // 2 if kind == "silu" else 0
    per_head = 1
    if kind == "rope":
        # A program holds rows of one head; with the q/k norm it holds the whole head, in K steps
        # shortened to keep the tile's bytes (and shared memory) what the table planned.
        block_n = max(16, _next_pow2(half)) if qk_norm is not None else min(block_n, max(16, _next_pow2(half)))
        if block_n > tile.block_n:
            block_k = max(16, block_k * tile.block_n // block_n)
        per_head = -(-half // block_n)
        grid = (nh + 2 * nkv) * per_head
    elif kind == "silu":
        grid = -(-half // block_n)
    else:
        grid = -(-n // block_n)
    pos, cos, sin = rope if rope is not None else (x, x, x)
    qn, kn, qk_eps = qk_norm if qk_norm is not None else (x, x, 0.0)
    kv, slots = cache if cache is not None else (x, x)
    kv_strides = (kv.stride(0), kv.stride(1), kv.stride(2)) if cache is not None else (0, 0, 0)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    args = (x, x if norm is None else norm[0], w, x if bias is None else bias, x if residual is None else residual, out,
            pos, cos, sin, qn, kn, slots, kv,
            m, 0.0 if norm is None else norm[1], qk_eps,
            x.stride(0), w.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
            cos.stride(0) if rope is not None else 0, sin.stride(0) if rope is not None else 0, *kv_strides)
    return Launch(grid, args, dict(
        K=k, N=n, NORM=norm is not None, HAS_BIAS=bias is not None,
        ROPE=kind == "rope", SILU=kind == "silu", RESIDUAL=kind == "residual", PAIRED=paired,
        ROWS=2 * block_n if paired else block_n,
        HALF=half, PER_HEAD=per_head, Q_HEADS=nh, ROPE_HEADS=nh + nkv, QK_NORM=qk_norm is not None,
        WRITE_KV=cache is not None, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=MAX_ROWS,
        DOT_FP32=interpret and w.dtype != torch.float32, IEEE=w.dtype == torch.float32,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    ))


def _launch(kind: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: Tile | None,
            **epilogue: Any) -> None:
    """Plans and launches the kernel (see `plan`); nothing for zero rows."""
    launch = plan(kind, x, w, out, tile, **epilogue)
    if x.shape[0]:
        _kernels().fused_linear[(launch.grid,)](*launch.args, **launch.meta)


def norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads: tuple[int, int, int], *, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                  tile: Tile | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the residual stream x [T, H]: rope(qkv(rms_norm(x)) + bias), with the q/k norm
    (q_norm weight, k_norm weight, eps) before rope where given. positions [T] index the rotary
    tables cos/sin [max_len, head_dim]; heads is (q heads, kv heads, head_dim). With cache (one
    layer's kv, slot_mapping [T]), k and v are also written into the cache (slots < 0 skipped).
    q [T, heads, D], k and v [T, kv_heads, D] are views of one [T, (heads + 2 kv_heads) D] tensor."""
    t = x.shape[0]
    nh, nkv, hd = heads
    assert weight.shape[0] == (nh + 2 * nkv) * hd and hd % 2 == 0
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and positions.is_contiguous()
    if cache is not None:
        kv, slots = cache
        assert kv.shape[0] == 2 and kv.shape[2:] == (nkv, hd) and kv.stride(3) == 1 and slots.is_contiguous()
    out = torch.empty((t, weight.shape[0]), dtype=weight.dtype, device=x.device)
    _launch("rope", x.contiguous(), weight, out, tile, norm=(norm_weight, eps), bias=bias,
            rope=(positions, cos, sin), heads=heads, qk_norm=qk_norm, cache=cache)
    q, k, v = out.split([nh * hd, nkv * hd, nkv * hd], -1)
    return q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    tile: Tile | None = None) -> torch.Tensor:
    """residual + x @ weight.T, the projection rounded to the dtype before the add: the residual
    stream after an attention or MLP block ([T, N], a new tensor)."""
    assert residual.shape == (x.shape[0], weight.shape[0])
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch("residual", x.contiguous(), weight, out, tile, residual=residual.contiguous())
    return out


def norm_gate_up(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 tile: Tile | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up = rms_norm(x) @ weight.T (weight [2I, H], gate rows first): [T, I]."""
    assert weight.shape[0] % 2 == 0
    out = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=weight.dtype, device=x.device)
    _launch("silu", x.contiguous(), weight, out, tile, norm=(norm_weight, eps))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           tile: Tile | None = None) -> torch.Tensor:
    """x @ weight.T rounded to the weight's dtype, stored as out_dtype (float32 logits without a
    second launch)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or weight.dtype, device=x.device)
    _launch("plain", x.contiguous(), weight, out, tile)
    return out
