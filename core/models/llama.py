"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2/3 shapes) over a paged KV cache.

Weights use fused projections (qkv, gate_up) so a layer is few kernels. Attention writes the
step's new K/V into the cache slots the block manager assigned, then attends over the gathered
context slots of every sequence at once with a block-diagonal causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import apply_rope, cos_sin_table


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to a common query and context length."""

    q_index: torch.Tensor
    """[R, Q] index into the step's tokens of each (padded) query."""
    k_slots: torch.Tensor
    """[R, L] flat cache slots of each sequence's context (padded)."""
    mask: torch.Tensor
    """[R, Q, L] True where a query may attend a context slot."""
    valid: torch.Tensor
    """[R, Q] True for real (not padding) queries."""
    out_index: torch.Tensor
    """[T_group] step token index of each real query, in `valid` order."""


@dataclass
class AttentionMetadata:
    positions: torch.Tensor
    """[T] position of each new token."""
    slot_mapping: torch.Tensor
    """[T] flat cache slot where each new token's K/V is written."""
    groups: list[AttentionGroup]
    """Decode-like rows share one padded group; each long prefill chunk is a group of its own,
    so attention costs what the sequences need, not (all queries) x (all contexts)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin).to(x.dtype), apply_rope(k, cos, sin).to(x.dtype)
        k_cache, v_cache = kv[0], kv[1]
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
        out = torch.empty_like(q)
        for g in meta.groups:
            attended = F.scaled_dot_product_attention(
                q[g.q_index].transpose(1, 2),
                k_cache[g.k_slots].transpose(1, 2),
                v_cache[g.k_slots].transpose(1, 2),
                attn_mask=g.mask[:, None],
                scale=self.scale,
                enable_gqa=True,
            )
            out[g.out_index] = attended.transpose(1, 2)[g.valid]
        return self.o(out.reshape(t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.input_norm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = cos_sin_table(cfg, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final-norm hidden states [T, H]; kv_cache is [layers, 2, slots, kv_heads, head_dim]."""
        x = self.embed(input_ids)
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
