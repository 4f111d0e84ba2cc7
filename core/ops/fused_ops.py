"""Fused elementwise kernels for the decoder layer, each beside the torch path it must match.

At decode sizes a layer's norms, rotary embedding and SiLU-gate are memory-bound launches of
a few microseconds each; fusing add+norm, q+k rope and silu*up removes about half of them and
the intermediate tensors. The torch paths (`*_torch`) are the definitions: the Triton ones
compute the same thing in the same precision (fp32 math, results rounded to the input dtype).

Triton is used for CUDA tensors, and for CPU tensors when Triton's interpreter is on
(TRITON_INTERPRET=1, as the tests set it); without Triton every op is its torch path.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace
from typing import overload

import torch
import torch.nn.functional as F

from .rope import apply_rope

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton path can run on x's device."""
    return HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built
    import triton.language as tl

    # The row count is only the grid, and every integer argument is a stride (or 0) fixed by the
    # model's shapes, so Triton's specialisation of integers (== 1, multiples of 16) sees nothing
    # that changes per step: a new batch size reuses the compiled kernels, no do_not_specialize.
    # An integer argument that varies per step (a row or token count) would need one.
    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                        stride_x, stride_r, stride_o, stride_s,
                        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < HIDDEN
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's add
            tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
        normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # One program per token rotates all its q heads then all its k heads, reading cos/sin once.
        # (Kernels are closures here, so no @jit helper: the q and k passes are one loop.)
        t = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_HALF)
        d_mask = offs_d < HALF
        cos1 = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + t * stride_cos + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + t * stride_sin + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        offs_h = tl.arange(0, BLOCK_H)
        for is_k in tl.static_range(2):
            src = k_ptr if is_k else q_ptr
            dst = ko_ptr if is_k else qo_ptr
            heads = K_HEADS if is_k else Q_HEADS
            src_row = src + t * (stride_kt if is_k else stride_qt)
            stride_h = stride_kh if is_k else stride_qh
            mask = (offs_h < heads)[:, None] & d_mask[None, :]
            ptrs = src_row + offs_h[:, None] * stride_h + offs_d[None, :]
            x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
            out = dst + (t * heads + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
            tl.store(out, (x1 * cos1 - x2 * sin1).to(dst.dtype.element_ty), mask=mask)
            tl.store(out + HALF, (x2 * cos2 + x1 * sin2).to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INTER
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
        # silu is rounded to the dtype before the product, as torch's silu(gate) * up is.
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(rms_norm=rms_norm_kernel, rope=rope_kernel, silu_mul=silu_mul_kernel)


# ---- RMSNorm, optionally fused with the residual add ---------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * normalize(x), the model's RMSNorm; with residual, normalizes s = x + residual
    and returns (normed, s), s being the residual stream the next layer adds to."""
    s = x if residual is None else x + residual
    x32 = s.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(s.dtype)
    return out if residual is None else (out, s)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    t, hidden = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((t, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        s = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t:
        _kernels().rms_norm[(t,)](
            x, x if residual is None else residual, weight, out, out if s is None else s, eps,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), 0 if s is None else s.stride(0),
            HIDDEN=hidden, BLOCK=_next_pow2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=4 if hidden <= 2048 else 8,
        )
    return out if s is None else (out, s)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H]: weight * normalize(x), or with residual (weight * normalize(x + residual), x + residual)."""
    return (rms_norm_triton if use_triton(x) else rms_norm_torch)(x, weight, eps, residual)


# ---- rotary embedding for q and k -----------------------------------------------------------


def rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rope of q [T, nh, D] and k [T, nkv, D] with cos/sin [T, D]: fp32 math, results in q's dtype."""
    return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, nh, d = q.shape
    nkv = k.shape[1]
    assert d % 2 == 0 and k.shape[2] == d and q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    q_out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, nkv, d), dtype=k.dtype, device=k.device)
    if t:
        _kernels().rope[(t,)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            Q_HEADS=nh, K_HEADS=nkv, HALF=d // 2, BLOCK_H=_next_pow2(max(nh, nkv)),
            BLOCK_HALF=_next_pow2(d // 2),
        )
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k rotated by the rows' positions (cos/sin [T, D], rotate-half layout); new tensors."""
    return (rope_triton if use_triton(q) else rope_torch)(q, k, cos, sin)


# ---- SiLU-gated MLP activation --------------------------------------------------------------


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_i = gate_up.shape
    inter = two_i // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _next_pow2(inter))
    if t:
        _kernels().silu_mul[(t, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                     INTER=inter, BLOCK=block)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate the first half): [T, I]."""
    return (silu_mul_triton if use_triton(gate_up) else silu_mul_torch)(gate_up)
