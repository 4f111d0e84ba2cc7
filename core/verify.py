"""Draft verification: greedy and rejection sampling, one acceptance rule for both.

Per row and draft position i the rule is: accept draft x_i while u_i * q_i(x_i) <= p_i(x_i)
and x_i >= 0 (a -1 is never accepted). Greedy is the special case p = [x_i == argmax],
q = u = 1. The first rejected position takes the recovered token (a sample of the residual
max(p - q, 0), or the argmax for greedy); when every draft is accepted, the bonus token is a
sample of p at the next position.

The acceptance step has a Triton kernel for GPUs and a torch path elsewhere; both are
checked against each other (Triton also runs on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from .frame import RowSampling
from .sampler import draw_seed, target_probs

DRAFT_SALT = 0x5EED


def accept_torch(
    draft_ids: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids, p_x, q_x, u: [R, K]; final: [R, K+1] candidate token at each stop position.
    Returns (tokens [R, K+1] padded with -1, num_accepted [R])."""
    ok = (draft_ids >= 0) & (u * q_x <= p_x)
    num_accepted = ok.int().cumprod(dim=1).sum(dim=1)
    k = draft_ids.shape[1]
    cols = torch.arange(k + 1, device=draft_ids.device)[None, :]
    padded = torch.cat([draft_ids, torch.full_like(draft_ids[:, :1], -1)], dim=1)
    acc = num_accepted[:, None]
    tokens = torch.where(cols < acc, padded, torch.where(cols == acc, final, torch.full_like(final, -1)))
    return tokens, num_accepted


_TRITON_KERNEL = None


def _triton_kernel():  # type: ignore[no-untyped-def]
    global _TRITON_KERNEL
    if _TRITON_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def accept_kernel(draft_ptr, px_ptr, qx_ptr, u_ptr, final_ptr, out_ptr, nacc_ptr,
                          K: tl.constexpr, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            in_k = cols < K
            draft = tl.load(draft_ptr + row * K + cols, mask=in_k, other=-1)
            p = tl.load(px_ptr + row * K + cols, mask=in_k, other=0.0)
            q = tl.load(qx_ptr + row * K + cols, mask=in_k, other=1.0)
            u = tl.load(u_ptr + row * K + cols, mask=in_k, other=1.0)
            ok = (draft >= 0) & (u * q <= p) & in_k
            # accepted = length of the leading run of accepted drafts
            first_bad = tl.min(tl.where(ok, BLOCK, cols), axis=0)
            acc = tl.minimum(first_bad, K)
            final = tl.load(final_ptr + row * (K + 1) + cols, mask=cols < K + 1, other=-1)
            out = tl.where(cols < acc, draft, tl.where(cols == acc, final, -1))
            tl.store(out_ptr + row * (K + 1) + cols, out, mask=cols < K + 1)
            tl.store(nacc_ptr + row, acc)

        _TRITON_KERNEL = accept_kernel
    return _TRITON_KERNEL


def accept_triton(
    draft_ids: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    r, k = draft_ids.shape
    out = torch.empty((r, k + 1), dtype=torch.int64, device=draft_ids.device)
    nacc = torch.empty(r, dtype=torch.int32, device=draft_ids.device)
    if r:
        _triton_kernel()[(r,)](
            draft_ids.contiguous(), p_x.float().contiguous(), q_x.float().contiguous(),
            u.float().contiguous(), final.contiguous(), out, nacc,
            K=k, BLOCK=triton.next_power_of_2(k + 1),
        )
    return out, nacc.long()


def accept(draft_ids, p_x, q_x, u, final, use_triton: bool):  # type: ignore[no-untyped-def]
    return (accept_triton if use_triton else accept_torch)(draft_ids, p_x, q_x, u, final)


def verify(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    sampling: list[RowSampling],
    draft_probs: torch.Tensor | None = None,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [R, K+1, V] target logits at each row's last host token and its K drafts;
    draft_ids: [R, K] (-1 padded). Returns (tokens [R, K+1] -1 padded, num_accepted [R])."""
    r, k1, _ = logits.shape
    k = k1 - 1
    device = logits.device
    p_x = torch.zeros(r, k, device=device)
    q_x = torch.ones(r, k, device=device)
    u = torch.ones(r, k, device=device)
    final = logits.argmax(-1)
    safe_ids = draft_ids.clamp(min=0)
    p_x[:] = (final[:, :k] == draft_ids).float()  # greedy rows; sampled rows are overwritten below
    for i, s in enumerate(sampling):
        if s.temperature == 0.0:
            continue
        p = torch.stack([target_probs(logits[i, j], s) for j in range(k1)])  # [K+1, V]
        gen = torch.Generator(device=device).manual_seed(draw_seed(s.seed ^ DRAFT_SALT, s.position))
        u[i] = torch.rand(k, generator=gen, device=device)
        # Position j draws the same noise as plain sampling would, so a row without drafts
        # samples exactly what `sampler.sample` samples, whatever else is in the batch.
        noise = torch.stack([
            torch.empty_like(p[j]).exponential_(
                generator=torch.Generator(device=device).manual_seed(draw_seed(s.seed, s.position + j)))
            for j in range(k1)])
        q = None
        if draft_probs is not None:
            q = draft_probs[i].float()
            q_x[i] = q.gather(-1, safe_ids[i][:, None])[:, 0]
        else:  # a deterministic proposal: q is one-hot at the draft
            q = torch.zeros_like(p[:k]).scatter_(-1, safe_ids[i][:, None], 1.0)
        p_x[i] = p[:k].gather(-1, safe_ids[i][:, None])[:, 0]
        residual = (p[:k] - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
        has_draft = (draft_ids[i] >= 0)[:, None]
        stop_dist = torch.cat([torch.where(has_draft, residual, p[:k]), p[k:]])
        final[i] = (stop_dist / noise).argmax(-1)
    return accept(draft_ids, p_x, q_x, u, final, use_triton)
