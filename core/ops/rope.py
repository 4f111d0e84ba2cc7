"""Rotary position embedding tables for every scaling variant config files use."""

from __future__ import annotations

import math

import torch

from ..model_config import ModelConfig


def inv_frequencies(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq, attention_scale) in float64 for precision, on the host (also inside a meta
    device context: there arange runs through torch._refs, whose import of torch._dynamo costs
    seconds)."""
    dim, base, rs = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    exps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    inv: torch.Tensor = 1.0 / (base**exps)
    orig = rs.original_max_position or cfg.max_position
    if rs.kind in ("default", "none"):
        return inv, 1.0
    if rs.kind == "linear":
        return inv / rs.factor, 1.0
    if rs.kind == "dynamic":
        # Static NTK: the base is stretched once for the longest context the engine will serve.
        if max_len > orig:
            stretch = (rs.factor * max_len / orig) - (rs.factor - 1)
            base = base * stretch ** (dim / (dim - 2))
            inv = 1.0 / (base**exps)
        return inv, 1.0
    if rs.kind == "llama3":
        low_wl, high_wl = orig / rs.low_freq_factor, orig / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rs.factor, inv)
        smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if rs.kind == "yarn":
        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(rs.beta_fast)), 0)
        high: float = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / rs.factor) * (1 - extrapolation) + inv * extrapolation
        scale = rs.attention_factor or (0.1 * math.log(rs.factor) + 1.0)
        return inv, scale
    raise ValueError(f"unsupported rope scaling {rs.kind!r}")


def cos_sin_table(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv, scale = inv_frequencies(cfg, max_len)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64, device="cpu"), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).float(), (emb.sin() * scale).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
