"""Batch-invariant kernels (`speckernel.ops.invariant`, the attention backends' `batch_invariant`):
a token's result is bit for bit the same computed alone, inside a batch of other rows, or beside
more query tokens of its own row (decode vs verification vs prefill shapes).

Without a GPU the Triton kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so
their shapes stay tiny; the CPU paths run at the target's real sizes.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speckernel.ops import invariant, packed_linear
from speckernel.ops.paged_attention import PagedAttention, TorchPagedAttention, TritonPagedAttention

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rows_alone_and_batched(op, x: torch.Tensor, sizes: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    """op over the first m rows of x, for each m in sizes, gives every row exactly what op gives
    that row alone (its position in the batch differs, and so do its neighbours)."""
    alone = [op(x[i : i + 1]) for i in range(max(sizes))]
    for m in sizes:
        batched = op(x[:m])
        for i in range(m):
            assert torch.equal(batched[i : i + 1], alone[i]), f"row {i} of a batch of {m} differs from it alone"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_norm_and_activation_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """The target's shapes (SmolLM2-135M: hidden 576, MLP 1536) on the CPU paths: 1 row (decode),
    5 (a verification of K=4), 37 and 130 (prefill chunks; 130 rows take BLAS's blocked paths)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, 576, generator=gen).to(dtype)
    w = (torch.randn(1536, 576, generator=gen) / 24).to(dtype)
    b = torch.randn(1536, generator=gen).to(dtype)
    norm = torch.rand(576, generator=gen).to(dtype)
    sizes = (1, 5, 37, 130)
    rows_alone_and_batched(lambda t: invariant.linear(t, w), x, sizes)
    rows_alone_and_batched(lambda t: invariant.linear(t, w, b), x, sizes)
    if packed_linear.available() and packed_linear.packs(dtype):  # the CPU platform's rows, on the packed weight
        packed = packed_linear.pack(w)
        rows_alone_and_batched(lambda t: invariant.linear(t, w, b, packed), x, sizes)
        torch.testing.assert_close(invariant.linear(x, w, b, packed), invariant.linear(x, w, b),
                                   atol=0.1 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)
    rows_alone_and_batched(lambda t: invariant.rms_norm(t, norm, 1e-5), x, sizes)
    rows_alone_and_batched(lambda t: invariant.silu_mul(invariant.linear(t, w)), x, sizes)
    # They compute what the plain ops compute, to rounding.
    torch.testing.assert_close(invariant.linear(x, w, b).float(), F.linear(x.float(), w.float(), b.float()),
                               atol=0.1 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_invariant_matmul_is_correct_and_row_invariant(dtype: torch.dtype, bias: bool) -> None:
    """The CUDA kernel (in the interpreter without a GPU): K and N with tails, M across two tiles."""
    gen = torch.Generator().manual_seed(1)
    m, n, k = invariant.BLOCK_M + 6, 40, 100
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / 10).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    got = invariant.matmul_triton(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    for i in (0, 3, m - 3):  # the first tile and the second, alone and batched
        assert torch.equal(got[i : i + 1], invariant.matmul_triton(x[i : i + 1], w, b))
    assert torch.equal(got[:5], invariant.matmul_triton(x[:5], w, b))
    assert invariant.matmul_triton(x[:0], w, b).shape == (0, n)


BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
SEQS = {"x": (40, [3, 0, 5]), "y": (25, [1, 2]), "z": (12, [4]), "w": (600, list(range(44, 6, -1)))}
"""name: (length, block table): tables out of order, so slots are not positions. w is long enough
that a step padded to its context takes other SDPA blocking than x's own context."""


def backends() -> list[type[PagedAttention]]:
    return [TorchPagedAttention, TritonPagedAttention] if HAS_TRITON else [TorchPagedAttention]


def attend(cls: type[PagedAttention], steps: list[tuple[str, int, int]], qkv: dict[str, tuple[torch.Tensor, ...]],
           batch_invariant: bool = True) -> dict[tuple[str, int], torch.Tensor]:
    """One step of rows (sequence, start, new tokens) on a fresh cache holding each sequence's
    earlier keys; each new token's output, by (sequence, position)."""
    backend = cls(BLOCK, 128, DEVICE, max_rows=4, batch_invariant=batch_invariant)
    kv = torch.zeros(2, 45 * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)

    def slots(name: str, lo: int, hi: int) -> torch.Tensor:
        table = np.asarray(SEQS[name][1])
        pos = np.arange(lo, hi)
        return torch.from_numpy(table[pos // BLOCK] * BLOCK + pos % BLOCK).to(DEVICE)

    for name, start, _ in steps:
        _, k, v = qkv[name]
        backend.write(k[:start], v[:start], kv, slots(name, 0, start))
    meta = backend.prepare([(start, n, SEQS[name][1]) for name, start, n in steps])
    q, k, v = (torch.cat([qkv[name][i][start : start + n] for name, start, n in steps]) for i in range(3))
    out = backend.forward(q, k, v, kv, meta, HEAD_DIM**-0.5)
    at, t = {}, 0
    for name, start, n in steps:
        for j in range(n):
            at[name, start + j] = out[t]
            t += 1
    return at


@pytest.mark.parametrize("cls", backends(), ids=lambda c: c.__name__)
def test_attention_of_a_query_does_not_depend_on_the_step(cls: type[PagedAttention]) -> None:
    """Token 39 of x (and 36, 37): decoded alone, verified with 4 drafts, decoded beside other
    rows (a verification and a prompt chunk among them), and inside x's whole prompt."""
    gen = torch.Generator().manual_seed(2)
    qkv = {name: tuple(torch.randn(length, h, HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
           for name, (length, _) in SEQS.items()}
    decode = {p: attend(cls, [("x", p, 1)], qkv)["x", p] for p in (36, 37, 39)}
    verify = attend(cls, [("x", 35, 5)], qkv)
    batched = attend(cls, [("y", 20, 5), ("x", 39, 1), ("z", 0, 12), ("w", 599, 1)], qkv)
    beside = attend(cls, [("z", 11, 1), ("x", 36, 4), ("w", 596, 4)], qkv)
    prefill = attend(cls, [("x", 0, 40)], qkv)
    for p, want in decode.items():
        assert torch.equal(verify["x", p], want), f"position {p}: verification differs from decode"
        assert torch.equal(prefill["x", p], want), f"position {p}: prefill differs from decode"
    assert torch.equal(batched["x", 39], decode[39]), "decode beside other rows differs from decode alone"
    assert torch.equal(beside["x", 37], decode[37]) and torch.equal(beside["x", 39], decode[39])
    # and it is attention: the plain backend computes the same to rounding
    plain = attend(cls, [("x", 35, 5)], qkv, batch_invariant=False)
    torch.testing.assert_close(plain["x", 39].float(), decode[39].float(), atol=2e-2, rtol=2e-2)
