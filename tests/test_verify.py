"""Verification: the acceptance rule, Triton against torch, and lossless rejection sampling."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from speckernel.frame import RowSampling
from speckernel.verify import accept_torch, accept_triton, verify

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(rows: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, 50, (rows, k), generator=g)
    drafts[torch.rand(rows, k, generator=g) < 0.15] = -1
    p_x = torch.rand(rows, k, generator=g)
    q_x = torch.rand(rows, k, generator=g) + 0.01
    u = torch.rand(rows, k, generator=g)
    final = torch.randint(0, 50, (rows, k + 1), generator=g)
    return tuple(t.to(DEVICE) for t in (drafts, p_x, q_x, u, final))


@pytest.mark.parametrize(("rows", "k"), [(1, 1), (7, 3), (33, 4), (5, 8), (3, 13)])
def test_triton_kernel_equals_torch_path(rows: int, k: int) -> None:
    for seed in range(5):
        case = random_case(rows, k, seed)
        want = accept_torch(*case)
        got = accept_triton(*case)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_greedy_accepts_the_matching_prefix_and_never_a_minus_one() -> None:
    v = 10
    target = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6], [1, 1, 1, 1]])  # argmax per position
    logits = torch.nn.functional.one_hot(target, v).float()[:, :, :] * 10
    drafts = torch.tensor([[3, 4, 5], [3, 4, 5], [-1, -1, -1]])
    greedy = [RowSampling(0.0, 0, 1.0, 0, 0)] * 3
    for use_triton in (False, True):
        tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), greedy, use_triton=use_triton)
        assert nacc.tolist() == [3, 1, 0]
        assert tokens.tolist() == [[3, 4, 5, 6], [3, 9, -1, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_reproduces_the_target_distribution(use_triton: bool, with_q: bool) -> None:
    """Drafts drawn from q (or a fixed draft, q one-hot), verified against p: the first emitted
    token must be distributed as p, whatever q is."""
    v, k, n = 6, 2, 2500
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(k + 1, v, generator=g) * 1.5
    q = torch.softmax(torch.randn(k, v, generator=g), -1)
    p0 = torch.softmax(p_logits[0], -1)
    logits = p_logits.expand(n, -1, -1).contiguous()
    if with_q:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
        probs = q.expand(n, -1, -1).contiguous()
    else:
        drafts = torch.tensor([[int(q[0].argmax()), int(q[1].argmax())]]).expand(n, -1).contiguous()
        probs = None
    rows = [RowSampling(1.0, 0, 1.0, seed=s, position=0) for s in range(n)]
    tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), rows,
                          None if probs is None else probs.to(DEVICE), use_triton=use_triton)
    first = tokens[:, 0].cpu().numpy()
    counts = np.bincount(first, minlength=v)
    expected = p0.numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (counts, expected)  # 99.99% quantile of chi-square, 5 dof, is about 25.7
    assert (tokens >= 0).sum(1).tolist() == (nacc + 1).tolist()


def test_bonus_token_when_every_draft_is_accepted() -> None:
    v = 5
    logits = torch.full((1, 3, v), -20.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 20.0  # p is (almost) one-hot
    drafts = torch.tensor([[1, 2]])
    q = torch.nn.functional.one_hot(drafts, v).float()
    tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), [RowSampling(1.0, 0, 1.0, 1, 0)], q.to(DEVICE))
    assert nacc.tolist() == [2] and tokens.tolist() == [[1, 2, 3]]
