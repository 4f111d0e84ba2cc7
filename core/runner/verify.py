"""Draft verification: greedy and rejection sampling, one acceptance rule for both, batched on the device.

Per row and draft position i the rule is: accept draft x_i while u_i * q_i(x_i) <= p_i(x_i)
and x_i >= 0 (a -1 is never accepted). The first rejected position takes the recovered token;
when every draft is accepted, the bonus token is a sample of p at the next position.

Deterministic drafts (no draft_probs: ngram, the learned drafters, and draft_model, which draws
its sampled drafts with the target's own noise) are verified by coupling:
every position's token is t_i, exactly what plain sampling draws for that output token (the
argmax for greedy rows), and a draft is kept while x_i == t_i (p_i = [x_i == t_i], q = u = 1).
That is rejection sampling with q one-hot: x_i is kept with probability p_i(x_i), and a rejected
position emits t_i given t_i != x_i, a sample of the residual. Its tokens do not depend on the
drafts at all, so a seeded request emits the same tokens with or without a speculator, and
however batching, K=0 steps or preemption change which drafts it is offered.

Sampled drafts (draft_probs q, from a speculator that declares sampled_drafts) take min(1, p/q)
with an acceptance uniform u_i (entry 0 of the stream (seed ^ DRAFT_SALT, n) for output token n)
and a residual sample of max(p - q, 0): the distribution is the target's, and a seeded request
repeats its tokens when offered the same drafts.

All rows and positions go through one fixed sequence of kernels (no loop over rows, no host
sync, fixed shapes), so a step that verifies can be captured in a CUDA graph. Position j of a
row samples with exactly the noise `sampler.sample_on_device` uses for that row's output token
position + j, so a row without drafts samples what plain sampling samples, whatever else is in
the batch.

Penalties (`penalties`) change the logits of every position before all of this: position j counts
the row's output plus drafts 0..j-1, which it is only reached with when they were accepted, i.e.
when they are the tokens plain decoding emitted there. So speculation stays lossless under them.

The acceptance step and the race that samples each position have Triton kernels for GPUs
(use_triton) and torch paths elsewhere; both give the same tokens and are checked against each
other (Triton also runs on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling_params import RowSampling
from .penalties import TokenCounts
from .sampler import SamplingTensors, apply_token_bitmask, as_sampling_tensors, probs_on_device, race, uniform

DRAFT_SALT = 0x5EED
ACCEPT_ROWS = 16
"""Rows per program of the Triton accept kernel."""


def accept_torch(
    draft_ids: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids, p_x, q_x, u: [R, K]; final: [R, K+1] candidate token at each stop position.
    Returns (tokens [R, K+1] padded with -1, num_accepted [R])."""
    ok = (draft_ids >= 0) & (u * q_x <= p_x)
    num_accepted = ok.int().cumprod(dim=1).sum(dim=1)
    k = draft_ids.shape[1]
    cols = torch.arange(k + 1, device=draft_ids.device)[None, :]
    padded = torch.cat([draft_ids, draft_ids.new_full((draft_ids.shape[0], 1), -1)], dim=1)  # K = 0 too
    acc = num_accepted[:, None]
    tokens = torch.where(cols < acc, padded, torch.where(cols == acc, final, torch.full_like(final, -1)))
    return tokens, num_accepted


_TRITON_KERNEL = None


def _triton_kernel():  # type: ignore[no-untyped-def]
    global _TRITON_KERNEL
    if _TRITON_KERNEL is None:
        import triton  # triton is optional (Linux x86-64): imported where its kernels are built
        import triton.language as tl

        @triton.jit(do_not_specialize=["R"])  # a new row count compiles nothing
        def accept_kernel(draft_ptr, px_ptr, qx_ptr, u_ptr, final_ptr, out_ptr, nacc_ptr, R,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                          K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
            # ROWS rows per program: a [ROWS, BLOCK] tile, one row per line.
            row_ids = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            rows = row_ids[:, None]
            cols = tl.arange(0, BLOCK)[None, :]
            in_k = (cols < K) & (rows < R)
            in_k1 = (cols < K + 1) & (rows < R)
            draft = tl.load(draft_ptr + rows * K + cols, mask=in_k, other=-1)
            p = tl.load(px_ptr + rows * K + cols, mask=in_k, other=0.0)
            q = tl.load(qx_ptr + rows * K + cols, mask=in_k, other=1.0)
            u = tl.load(u_ptr + rows * K + cols, mask=in_k, other=1.0)
            ok = (draft >= 0) & (u * q <= p) & in_k
            # accepted = length of the leading run of accepted drafts
            first_bad = tl.min(tl.where(ok, BLOCK, cols), axis=1)
            acc = tl.minimum(first_bad, K)[:, None]
            final = tl.load(final_ptr + rows * (K + 1) + cols, mask=in_k1, other=-1)
            out = tl.where(cols < acc, draft, tl.where(cols == acc, final, -1))
            tl.store(out_ptr + rows * (K + 1) + cols, out, mask=in_k1)
            tl.store(nacc_ptr + row_ids, tl.minimum(first_bad, K), mask=row_ids < R)

        _TRITON_KERNEL = accept_kernel
    return _TRITON_KERNEL


def accept_triton(
    draft_ids: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built

    r, k = draft_ids.shape
    out = torch.empty((r, k + 1), dtype=torch.int64, device=draft_ids.device)
    nacc = torch.empty(r, dtype=torch.int32, device=draft_ids.device)
    if r:
        _triton_kernel()[(triton.cdiv(r, ACCEPT_ROWS),)](
            draft_ids.contiguous(), p_x.float().contiguous(), q_x.float().contiguous(),
            u.float().contiguous(), final.contiguous(), out, nacc, r,
            K=k, BLOCK=triton.next_power_of_2(k + 1), ROWS=ACCEPT_ROWS,
        )
    return out, nacc.long()


def accept(draft_ids: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, final: torch.Tensor,
           use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (accept_triton if use_triton else accept_torch)(draft_ids, p_x, q_x, u, final)


def drafted_counts(draft_ids: torch.Tensor) -> torch.Tensor:
    """[R, K] draft ids -> [R] the drafts each row really has: those before its first -1. A
    variable-width drafter pads its short rows with -1 where drafts stay on the device; the host
    path trims them at the same place. The acceptance counters count these, not the K slots a
    row verified, so an acceptance rate means one thing on every path. Graph-capturable."""
    return (draft_ids >= 0).long().cumprod(dim=1).sum(dim=1)


def verify(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    st: SamplingTensors | Sequence[RowSampling],
    draft_probs: torch.Tensor | None = None,
    use_triton: bool = False,
    bitmask: torch.Tensor | None = None,
    counts: TokenCounts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [R, K+1, V] target logits at each row's last host token and its K drafts;
    draft_ids: [R, K] int64 (-1: no draft there); draft_probs: [R, K, V] the proposal q, or None
    for a deterministic drafter (q one-hot at the draft); bitmask [R, K+1, W]: the tokens each
    position's grammar allows given the drafts before it (structured output); counts: [R] rows of
    what each row said before its drafts (needed when st.any_penalty: position j is penalized for
    drafts 0..j-1 too). Returns (tokens [R, K+1] -1 padded, num_accepted [R]). Graph-capturable
    when st is SamplingTensors."""
    r, k1, v = logits.shape
    k = k1 - 1
    st = as_sampling_tensors(st, logits.device)
    if st.any_penalty:
        if counts is None:
            raise ValueError("verifying a step with penalties needs the token counts")
        logits = st.columns(k1).penalize(logits.reshape(r * k1, v), counts.with_drafts(draft_ids)).view(r, k1, v)
    logits = apply_token_bitmask(logits, bitmask)
    best = logits.argmax(-1)  # [R, K+1]: greedy rows' tokens
    greedy_px = (best[:, :k] == draft_ids).float()
    ones = torch.ones_like(greedy_px)
    if st.all_greedy:
        return accept(draft_ids, greedy_px, ones, ones, best, use_triton)

    cols = st.columns(k1)  # row r, position j -> flat row r * (K+1) + j, output token position + j
    p = probs_on_device(logits.reshape(r * k1, v), cols).view(r, k1, v)
    if draft_probs is None:  # coupled: each position emits plain sampling's token, drafts kept while equal
        plain = torch.where(st.greedy[:, None], best, race(p.view(r * k1, v), cols, use_triton).view(r, k1))
        return accept(draft_ids, (plain[:, :k] == draft_ids).float(), ones, ones, plain, use_triton)

    safe_ids = draft_ids.clamp(min=0)[..., None]
    p_x = p[:, :k].gather(-1, safe_ids)[..., 0]
    q = draft_probs.float()
    q_x = q.gather(-1, safe_ids)[..., 0]
    residual = (p[:, :k] - q).clamp_(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :k])
    # Where a row stops: the residual after a rejected draft, p where there was no draft and at K.
    stop = torch.cat([torch.where((draft_ids >= 0)[..., None], residual, p[:, :k]), p[:, k:]], dim=1)
    sampled = race(stop.view(r * k1, v), cols, use_triton).view(r, k1)
    u = uniform(st.seed[:, None], cols.position.view(r, k1)[:, :k], DRAFT_SALT)

    greedy = st.greedy[:, None]
    final = torch.where(greedy, best, sampled)
    p_x = torch.where(greedy, greedy_px, p_x)
    q_x = torch.where(greedy, 1.0, q_x)
    u = torch.where(greedy, 1.0, u)
    return accept(draft_ids, p_x, q_x, u, final, use_triton)
