"""Batch-invariant kernels: one row's result never depends on the other rows, its position in the
batch or how many rows (query tokens) the call has.

Why: a verification step runs the target's matmuls on 1+K query tokens per row where a decode
step runs one, and BLAS libraries (and cuBLAS) pick their tiles, split-K and reduction order by
the shape, so the same token's logits differ in the last bits and, in bf16, near-ties flip.
With these kernels a token's hidden states, KV and logits are bit for bit what they are in any
other batch, so speculative greedy output equals plain greedy output token for token.

- `linear`: on CUDA a Triton matmul with one fixed tile configuration for every M (the K loop
  runs in one order, no split-K), the bias added to the float32 accumulator; elsewhere each row
  is its own M=1 call of the same shape (on the packed weight where the platform packs), which
  is invariant whatever the library does.
- `rms_norm`, `silu_mul`: on CUDA the fused Triton kernels (one program per row, a block fixed
  by the hidden size); elsewhere a loop over rows, each row a [1, H] call.

The Triton matmul takes M as a runtime argument that is never specialised, so one compiled
kernel per weight shape serves every batch size (graph capture and the eager warm-up build it).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from . import fused_ops, packed_linear

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
"""The one tile of the invariant matmul, whatever M is."""
NUM_WARPS, NUM_STAGES = 4, 3


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built
    import triton.language as tl

    # M (the token count) changes every step: not specialised, so a new batch size builds nothing.
    @triton.jit(do_not_specialize=["M"])
    def matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                      stride_am, stride_wn, stride_cm,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
        # c = a @ w.T (+ bias): every output element reduces over K in BLOCK_K steps, in order,
        # with the same MMA shape, whichever M tile its row falls in.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_valid = offs_m < M
        n_valid = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_valid = kk < K
            a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + kk[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                        mask=n_valid[None, :] & k_valid[:, None], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])

    return SimpleNamespace(matmul=matmul_kernel)


def matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) with one tile configuration for every M."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight [N, K] with K contiguous"
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    _kernels().matmul[grid](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32,
        # Triton's interpreter multiplies bf16 bit patterns as integers in tl.dot: widen there.
        DOT_FP32=x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def matmul_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), one call per row: every call has the same shape, and each row
    is copied to its own (aligned) buffer, so nothing about the batch reaches the library. With the
    weight packed for oneDNN (`packed_linear.pack(weight)`) each row is an M=1 call on it (a third
    of a gemv's time in bf16); otherwise a gemv (half an M=1 gemm's time in bf16)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    for i in range(x.shape[0]):
        alone = x[i : i + 1].clone()
        row = torch.mv(weight, alone[0]) if packed is None else packed_linear.linear(alone, packed)[0]
        out[i] = row if bias is None else row + bias
    return out


def _triton_here(x: torch.Tensor) -> bool:
    return fused_ops.HAS_TRITON and x.is_cuda


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) over x [..., K], batch-invariant; `packed`: the weight packed for
    oneDNN, which the CPU's rows use where given."""
    rows = x.reshape(-1, x.shape[-1])
    out = matmul_triton(rows, weight, bias) if _triton_here(x) else matmul_rows(rows, weight, bias, packed)
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm over the last dim of x [..., H], batch-invariant."""
    rows = x.reshape(-1, x.shape[-1])
    if _triton_here(x):
        normed = fused_ops.rms_norm_triton(rows.contiguous(), weight, eps)
        assert isinstance(normed, torch.Tensor)  # no residual: one tensor
        return normed.view(x.shape)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    for i in range(rows.shape[0]):
        out[i] = fused_ops.rms_norm_torch(rows[i : i + 1].clone(), weight, eps)[0]
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I], batch-invariant: torch's vectorised exp and its scalar
    tail may differ in the last bit, and where a row's elements fall between them depends on the
    tensor's size, so on the CPU each row is its own call."""
    if _triton_here(gate_up):
        return fused_ops.silu_mul_triton(gate_up)
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    for i in range(gate_up.shape[0]):
        out[i] = fused_ops.silu_mul_torch(gate_up[i : i + 1].clone())[0]
    return out
