"""CausalCascade: a block drafter that reads the target's own KV cache instead of keeping one.

One pass drafts a block: `[embed(anchor), mask x k]` at positions a0..a0+k, where the anchor
is the row's newest token (the bonus, at a0 = seq_len - 1). Each cascade layer runs causal
self-attention within the block (at most 16 tokens: dense, in plain torch, no cache), then
cross-attention from the block's queries to the target's KV rows of one chosen target layer at
positions < a0 (those rows are confirmed and were written by the target itself), then an MLP.
The final norm feeds the target's own head. Nothing is written anywhere, so there is no draft
KV, no lookahead slot and nothing to do in the K=0 pass.

Training (`CascadeModule.loss`) computes the same thing over many anchors per sequence at once:
one masked cross-attention of every block query to its sequence's target K/V before its anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from speckernel.plugin import (
    DeviceStates,
    Drafts,
    InvalidInputError,
    ModelConfig,
    SpeculatorCapabilities,
    SpeculatorContext,
    TrainBatch,
)
from speckernel.speculators import learned
from speckernel.speculators.learned import (
    MLP,
    DrafterConfig,
    Norm,
    Rope,
    SelfAttention,
    causal_mask,
    draft_probability,
    masked_attention,
    rope,
    trim,
)

INTERMEDIATE_SIZE = 768
"""MLP width at the defaults: with 1024 a SmolLM2-135M drafter is 6.64M parameters (13.3 MB in
bf16), over the 12 MB budget; 768 gives 5.76M (11.5 MB)."""
MAX_ANCHORS = 64
"""Anchors (blocks) trained per sequence and batch."""
DECAY = 4.0
"""Loss weight of block position j is exp(-(j - 1) / DECAY): later drafts matter less, since a
draft only counts when every one before it was accepted."""

CrossAttend = Callable[[int, torch.Tensor], torch.Tensor]
"""(cascade layer, roped queries [N, Bk, heads, D]) -> attention over the target's KV, same shape."""


class CrossAttention(nn.Module):
    """Queries only: keys and values are the target's own cache rows (roped, normed if qk_norm),
    so the query heads and head size are the target's."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.nh, self.hd = cfg.target.num_heads, cfg.target.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.scale = self.hd**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        lead = x.shape[:-1]
        q = rope(self.q_proj(x).view(*lead, self.nh, self.hd), cos, sin)
        return self.o_proj(attend(q).reshape(*lead, self.nh * self.hd))


class CascadeLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, cfg.hidden_size)
        self.cross_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn = CrossAttention(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, ...], mask: torch.Tensor,
                cross: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [N, Bk, H]; rot: (cos, sin) for the self-attention, then for the cross-attention."""
        scale = self.self_attn.scale

        def within_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return masked_attention(q, k, v, mask, scale)

        x = x + self.self_attn(self.input_layernorm(x), rot[0], rot[1], within_block)
        x = x + self.cross_attn(self.cross_layernorm(x), rot[2], rot[3], cross)
        return x + self.mlp(self.post_attention_layernorm(x))


class CascadeModule(learned.DrafterModule):
    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__()
        if len(cfg.kv_layers) != cfg.num_layers:
            raise ValueError(f"causal_cascade: {cfg.num_layers} layers need as many kv_layers, got {cfg.kv_layers}")
        self.config = cfg
        self.max_len = max_len
        """Positions the rope tables cover: a block must end before it."""
        self.layers = nn.ModuleList(CascadeLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(cfg.hidden_size) * 0.02)
        self.rope = Rope(target, cfg.head_dim, max_len)
        self.cross_rope = self.rope if cfg.head_dim == target.head_dim else Rope(target, target.head_dim, max_len)

    def block_input(self, anchor_embeds: torch.Tensor, n: int) -> torch.Tensor:
        """[..., H] anchor embeddings -> [..., 1 + n, H] blocks: the anchor, then n masks."""
        me = self.mask_embedding
        masks = me.expand(*anchor_embeds.shape[:-1], n, me.shape[0])
        return torch.cat([anchor_embeds.to(me.dtype).unsqueeze(-2), masks], dim=-2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cross: CrossAttend) -> torch.Tensor:
        """Blocks x [N, Bk, H] at positions [N, Bk] -> final-normed hidden states [N, Bk, H]."""
        rot = (*self.rope(positions), *self.cross_rope(positions))
        mask = causal_mask(x.shape[1], x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, rot, mask, lambda q, i=i: cross(i, q))
        return self.norm(x)

    def train_hidden(self, batch: TrainBatch, anchors: torch.Tensor) -> torch.Tensor:
        """Full blocks at anchors [B, n] (positions >= 1), each attending to its sequence's
        target K/V before its anchor -> [B, n, block_size, H]."""
        cfg = self.config
        b, n = anchors.shape
        bk, t = cfg.block_size, batch.tokens.shape[1]
        dev = anchors.device
        assert batch.target.embed is not None
        x = self.block_input(batch.target.embed(batch.tokens.gather(1, anchors).clamp(min=0)), bk - 1).flatten(0, 1)
        positions = (anchors[..., None] + torch.arange(bk, device=dev)).clamp(max=self.max_len - 1).flatten(0, 1)
        # Block queries of anchor a see keys < a (an empty context would be a row of NaNs: >= 1).
        before = torch.arange(t, device=dev) < anchors.clamp(min=1)[..., None]  # [B, n, T]
        mask = before.repeat_interleave(bk, dim=1)  # [B, n * bk, T]

        def cross(i: int, q: torch.Tensor) -> torch.Tensor:
            k, v = batch.kv[cfg.kv_layers[i]]
            scale = q.shape[-1] ** -0.5
            out = masked_attention(q.reshape(b, n * bk, *q.shape[2:]), k.to(q.dtype), v.to(q.dtype), mask, scale)
            return out.view_as(q)

        return self(x, positions, cross).view(b, n, bk, -1)

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted cross-entropy of block position j (1..B-1) of an anchor a against
        labels[a + j - 1], over up to MAX_ANCHORS random anchors per sequence. The head runs on
        every block position, a label that does not count weighted 0: anchors are drawn where
        labels count, so nearly all do, and selecting them would read the device back."""
        bk = self.config.block_size
        tokens, labels, mask = batch.tokens, batch.labels, batch.mask.bool()
        b, t = tokens.shape
        dev = tokens.device
        pos = torch.arange(t, device=dev)
        n = min(MAX_ANCHORS, t)
        score = torch.rand(b, t, device=dev).masked_fill(~(mask & (pos >= 1)), -1.0)
        top, anchors = score.topk(n, dim=1)
        hidden = self.train_hidden(batch, anchors)[:, :, 1:]  # [B, n, bk - 1, H]
        j = torch.arange(1, bk, device=dev)
        at = anchors[..., None] + j - 1  # [B, n, bk - 1]: the label each block position predicts
        inside = at < t
        flat = at.clamp(max=t - 1).flatten(1)
        want = labels.gather(1, flat).view_as(at)
        valid = (top >= 0)[..., None] & inside & mask.gather(1, flat).view_as(at)
        assert batch.target.head is not None
        logits = batch.target.head(hidden.reshape(-1, hidden.shape[-1])).view(*at.shape, -1)
        weight = torch.exp(-(j - 1).float() / DECAY) * valid
        ce = F.cross_entropy(logits.flatten(0, -2).float(), want.flatten(), reduction="none").view_as(at)
        loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        with torch.no_grad():
            hit = (logits.argmax(-1) == want) & valid
            acc = hit.sum() / valid.sum().clamp(min=1)
            acc1 = hit[..., 0].sum() / valid[..., 0].sum().clamp(min=1)
        return loss, {"acc": acc, "acc_pos1": acc1}


def runnable(seq_lens: torch.Tensor, samples: torch.Tensor, k: int, max_len: int) -> torch.Tensor:
    """[R] bool: rows that can draft: they sample, have context before the anchor a0 =
    seq_len - 1, and their block a0..a0+k stays inside the rope table."""
    anchor = seq_lens.to(torch.int64) - 1
    return samples.to(torch.bool) & (anchor >= 1) & (anchor + k < max_len)


def pick_drafts(logits: torch.Tensor, ok: torch.Tensor, min_prob: float) -> torch.Tensor:
    """Greedy drafts [R, k] from logits [R, k, V]; rows not `ok`, and everything from the first
    draft whose probability is below min_prob on, are -1."""
    drafts = logits.argmax(-1)
    keep = ok[:, None].expand_as(drafts)
    if min_prob > 0:
        keep = keep & (draft_probability(logits) >= min_prob)
    return trim(drafts, keep)


class CausalCascadeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min_prob: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """A draft whose probability is below this ends the row's drafts."""


class CausalCascadeSpeculator(learned.LearnedSpeculator[CascadeModule, CausalCascadeOptions]):
    name = "causal_cascade"
    capabilities = SpeculatorCapabilities(
        draft_width="variable", supports_k0=True, max_k=15, lookahead_slots_per_draft=0,
        k0_pass="nothing: it reads the target's own KV when it drafts",
        uses_target_kv=True, uses_target_weights=True, trainable=True)
    Options = CausalCascadeOptions
    Module = CascadeModule

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        n = target.num_layers
        return DrafterConfig(
            method=cls.name, target=learned.TargetShape.of(target), hidden_size=target.hidden_size,
            intermediate_size=INTERMEDIATE_SIZE, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, num_layers=2, kv_layers=(n // 2, n - 1), block_size=8)

    @classmethod
    def draft_kv_layers(cls, cfg: DrafterConfig) -> int:
        return 0  # it reads the target's KV rows and writes nothing

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        folder, cfg = learned.checkpoint(cls.name, ctx)
        if len(cfg.kv_layers) != cfg.num_layers or not all(0 <= i < ctx.target.num_layers for i in cfg.kv_layers):
            raise InvalidInputError(f"causal_cascade: {folder} reads target layers {cfg.kv_layers} with "
                                    f"{cfg.num_layers} layers; the target has {ctx.target.num_layers}")
        if ctx.num_speculative_tokens > cfg.block_size - 1:
            raise InvalidInputError(f"causal_cascade: the drafter at {folder} has blocks of {cfg.block_size} "
                                    f"(at most {cfg.block_size - 1} drafts); got K={ctx.num_speculative_tokens}")

    def block_logits(self, states: DeviceStates, k: int) -> torch.Tensor:
        """[R, k, V] float32 logits of block positions 1..k of every row (garbage for rows that
        cannot run). Device tensors only, fixed shapes."""
        target, meta = states.target, states.attention
        assert target is not None and target.kv_cache is not None and target.embed is not None
        assert meta is not None
        m = self.module
        rows, bk = states.num_rows, k + 1
        width = states.tokens.shape[1]
        anchor = (states.seq_lens.to(torch.int64) - 1).clamp(min=0)
        ids = states.tokens[states.slot_index, anchor.clamp(max=width - 1)].clamp(min=0)
        x = m.block_input(target.embed(ids), k)  # [R, bk, H]
        positions = (anchor[:, None] + torch.arange(bk, device=anchor.device)).clamp(max=m.max_len - 1)
        tables = meta.block_tables[:rows]
        tables = tables[:, None].expand(rows, bk, tables.shape[1]).reshape(rows * bk, -1)
        # Context: positions < a0 (the anchor's own KV is written by the next step).
        lens = anchor.clamp(min=1)[:, None].expand(rows, bk).reshape(-1)

        target_kv = target.kv_cache

        def cross(i: int, q: torch.Tensor) -> torch.Tensor:
            kv = target_kv[m.config.kv_layers[i]]
            out = self.attention.attend(q.reshape(rows * bk, *q.shape[2:]), kv, tables, lens, q.shape[-1] ** -0.5)
            return out.view_as(q)

        hidden = m(x, positions, cross)[:, 1:]
        assert target.head is not None
        return target.head(hidden.reshape(rows * k, -1)).view(rows, k, -1)

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        ok = runnable(states.seq_lens, states.samples, k, self.module.max_len)
        if k == 0:
            return Drafts(torch.empty(states.num_rows, 0, dtype=torch.int64, device=ok.device))
        return Drafts(pick_drafts(self.block_logits(states, k), ok, self.options.min_prob))

    def sync(self, states: DeviceStates) -> None:
        return None  # no draft state: the target's own KV is the context
