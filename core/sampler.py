"""Token sampling: greedy, temperature, top-k, top-p, with per-request reproducible seeds.

The random draw for a request's i-th output token depends only on (seed, i), so a seeded
request gives the same tokens whatever else shares its batch and even after preemption.
"""

from __future__ import annotations

import torch

from .frame import RowSampling

MIX = 0x9E3779B97F4A7C15


def draw_seed(seed: int, position: int) -> int:
    return (seed * MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] already divided by the temperature."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """The distribution a row samples from (also what verification compares drafts against)."""
    return filter_logits(logits.float() / s.temperature, s.top_k, s.top_p).softmax(-1)


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    """logits: [R, V] float32, one row per sampling request."""
    return sample_on_device(logits, rows).tolist()


def sample_on_device(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Like `sample`, leaving the [R] token tensor on the device."""
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    out = logits.argmax(-1)
    for i, s in enumerate(rows):
        if s.temperature == 0.0:
            continue
        probs = target_probs(logits[i], s)
        gen = torch.Generator(device=logits.device).manual_seed(draw_seed(s.seed, s.position))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[i] = (probs / noise).argmax()
    return out
