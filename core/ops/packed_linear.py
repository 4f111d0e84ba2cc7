"""Linear layers on weights packed once for oneDNN, where the platform asks for them (the CPU).

Why: torch's CPU linear hands every call to the BLAS with the weight as stored, and at the
small row counts of decoding (1 to a few dozen tokens a step) the BLAS re-lays the weight out
each time, or runs a slow path: on one core SmolLM2's LM head takes 36 ms at 3 rows against
10 ms at one. oneDNN's weight packed once in its own blocked layout serves every row count from
one layout: the head at 3 rows takes 7 ms, and the model's linears at 3 rows take a third of
their time on torch's path, at 20 rows two thirds. Results equal torch's to float32 rounding
(the reduction order differs), so a test of the CPU engine against HF keeps its tolerance. In
bf16 (where the CPU has it) a row at a time takes a third of torch's gemv: the batch-invariant
mode's linears, which run a row at a time, use it too.

The packed copy sits beside the plain weight (the embedding, the batch-invariant mode, a
drafter's handles and the state dict read that one), so packing costs the linear weights' bytes
once more: `worth_packing` refuses where that would crowd the host's free memory.
"""

from __future__ import annotations

import functools

import torch


def available() -> bool:
    """oneDNN is built into this torch and offers the packed linear."""
    mkldnn = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """float32, and bf16 where the CPU computes it natively (emulated, it would cost more), where a
    probe gives the exact product: a torch that offers the ops on a CPU its oneDNN cannot serve
    keeps torch's linear instead of failing at the first step."""
    if not available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        out = linear(torch.ones(3, 64, dtype=dtype), pack(torch.ones(16, 64, dtype=dtype)))
    except RuntimeError:
        return False
    return out.shape == (3, 16) and bool((out == 64).all())


def worth_packing(weights: list[torch.Tensor], free_bytes: int) -> bool:
    """Every weight in a packable dtype on the CPU, and their second copy within a quarter of the
    free memory (the KV cache takes at most another quarter)."""
    size = sum(w.numel() * w.element_size() for w in weights)
    return (bool(weights) and all(w.device.type == "cpu" and packs(w.dtype) for w in weights)
            and size <= free_bytes // 4)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in oneDNN's blocked layout, for any number of rows (no row-count hint)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def usable(packed: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """`packed` where it may serve x: not where autograd records x, since oneDNN's packed linear
    has no backward and would cut the gradient silently (a drafter trained through the target's
    head takes torch's linear on the plain weight)."""
    return None if packed is None or (x.requires_grad and torch.is_grad_enabled()) else packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) over x [..., K], `packed` = pack(weight) of weight [N, K]."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
