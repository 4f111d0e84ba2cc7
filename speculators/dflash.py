"""DFlash: a block drafter that drafts K tokens in one non-causal pass.

The drafter's input is a block [anchor, mask x K] at positions a0..a0+K, where the anchor is
the token the target just sampled (a0 = seq_len - 1). Every block query attends to the whole
block and to the target's context: the hidden states of a few target layers, fused by `fc`
and `hidden_norm` into one feature per position, and projected by each draft layer's own
k_proj/v_proj into that layer's K/V (DFlash injects the target context as K/V in every layer).
Block position j >= 1 drafts the token after position a0 + j - 1.

Serving: the context K/V live in the draft KV, indexed by the target's cache slots. Every pass
(sync and propose) writes them for every token of the step, so positions < a0 always hold
confirmed context; the block's own K/V go to positions a0..a0+K (overwritten by the next
step's tokens before anything reads them), hence two lookahead slots per draft. Everything
runs on device tensors with fixed shapes, so the kernel captures it in the step's graph.

Training: many anchors per sequence at once, all blocks of a sequence in one masked attention
per layer over [the sequence's context K/V, all its blocks]. Serving drafts K tokens with a
block of K + 1 positions, and the block attends non-causally, so K changes what every position
sees: training draws half the blocks shorter than block_size, so any K serves as trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, TypeVar, cast

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
    TargetModel,
    TrainBatch,
)
from speckernel.speculators.learned import (
    Attend,
    DecoderBlock,
    DrafterConfig,
    DrafterModule,
    LearnedSpeculator,
    Norm,
    Rope,
    SelfAttention,
    TargetShape,
    cache_slots,
    checkpoint,
    draft_probability,
    masked_attention,
    rope,
    trim,
)

NUM_ANCHORS = 64
"""Anchors trained per sequence and batch."""
DECAY = 4.0
"""Loss weight of block position j is exp(-(j - 1) / DECAY): early drafts matter most, since a
draft counts only when every one before it was accepted."""


@dataclass
class TrainBlocks:
    """The backbone's output on a batch's anchors: what a head trains on."""

    hidden: torch.Tensor
    """[B, A, block_size - 1, H] final-norm hidden of block positions 1.. (the drafted ones)."""
    labels: torch.Tensor
    """[B, A, block_size - 1] what each drafted position should predict."""
    valid: torch.Tensor
    """[B, A, block_size - 1] bool: the label counts."""
    prev: torch.Tensor
    """[B, A, block_size - 1] the token before each drafted one (the anchor, then the labels)."""
    anchors: torch.Tensor
    """[B, A] anchor positions."""


class DFlashDrafter(DrafterModule):
    """fc + hidden_norm fuse the target layers; `layers` run over the block; `norm`, then the
    target's head. Tensor names follow the public DFlash layout."""

    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__()
        if cfg.hidden_size != target.hidden_size:
            raise InvalidInputError(f"{cfg.method}: hidden_size {cfg.hidden_size} must equal the target's "
                                    f"{target.hidden_size} (it shares the target's embedding and head)")
        if cfg.block_size < 2 or not cfg.target_layers:
            raise InvalidInputError(f"{cfg.method}: needs block_size >= 2 and at least one target layer")
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * target.hidden_size, h, bias=False)
        self.hidden_norm = Norm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(h) * 0.02)
        self.rope = Rope(target, cfg.head_dim, max_len)

    # --- pieces shared by serving and training ----------------------------------------------

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """[..., H] context feature per position from the target layers' residual streams."""
        return self.hidden_norm(self.fc(torch.cat([hidden[layer] for layer in self.config.target_layers], dim=-1)))

    def context_kv(self, i: int, feat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K (roped) and V of the context feature [..., H] -> [..., kv_heads, D]."""
        attn = self.attention_of(i)
        lead = feat.shape[:-1]
        k = attn.k_proj(feat).view(*lead, attn.nkv, attn.hd)
        return rope(k, cos, sin), attn.v_proj(feat).view(*lead, attn.nkv, attn.hd)

    def attention_of(self, i: int) -> SelfAttention:
        """Layer i's attention (a ModuleList item is typed as a plain module)."""
        return cast(DecoderBlock, self.layers[i]).self_attn

    def positions_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions.clamp(0, self.rope.cos.shape[0] - 1))

    def backbone(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attends: list[Attend]) -> torch.Tensor:
        for layer, attend in zip(self.layers, attends, strict=True):
            x = layer(x, cos, sin, attend)
        return self.norm(x)

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor, target: TargetModel
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, K, H] of the drafted positions -> (greedy drafts [R, K], a score [R, K]:
        the drafter's probability of each draft)."""
        r, k, h = hidden.shape
        assert target.head is not None
        logits = target.head(hidden.reshape(r * k, h)).view(r, k, -1)
        return logits.argmax(dim=-1), draft_probability(logits)

    # --- training -----------------------------------------------------------------------------

    def train_blocks(self, batch: TrainBatch, block_lens: torch.Tensor | None = None,
                     num_anchors: int = NUM_ANCHORS) -> TrainBlocks:
        """Up to num_anchors random anchors per sequence (where the first label counts; as many as
        the sequence has such positions takes them all), all blocks drafted at once. block_lens
        [B, A] (2..block_size): each block's length, the K + 1 of a serving step; random when not
        given (half of them full)."""
        tokens, labels, mask = batch.tokens, batch.labels, batch.mask
        b, t = tokens.shape
        bs, dev = self.config.block_size, tokens.device
        n = min(num_anchors, t)
        score = torch.rand(b, t, device=dev).masked_fill(~mask, -1.0)
        anchors = score.topk(n, dim=1).indices.sort(dim=1).values  # [B, A]
        anchor_ok = mask.gather(1, anchors)
        j = torch.arange(bs, device=dev)
        pos = anchors[..., None] + j  # [B, A, bs]
        label_pos = pos[..., 1:] - 1  # block position j predicts labels[a + j - 1]
        label_idx = label_pos.clamp(max=t - 1).reshape(b, -1)
        block_labels = labels.gather(1, label_idx).view(b, n, bs - 1).clamp(min=0)  # padding ids: any valid one
        if block_lens is None:
            short = torch.randint(2, bs + 1, (b, n), device=dev)
            block_lens = torch.where(torch.rand(b, n, device=dev) < 0.5, bs, short)
        in_block = j < block_lens[..., None]  # [B, A, bs]
        valid = (mask.gather(1, label_idx).view(b, n, bs - 1) & (label_pos < t) & anchor_ok[..., None]
                 & in_block[..., 1:])
        anchor_tok = tokens.gather(1, anchors).clamp(min=0)
        prev = torch.cat([anchor_tok[..., None], block_labels[..., :-1]], dim=-1)

        feat = self.context(batch.hidden)  # [B, T, H]
        ctx_cos, ctx_sin = self.positions_cos_sin(torch.arange(t, device=dev).expand(b, t))
        assert batch.target.embed is not None
        emb = batch.target.embed(anchor_tok)  # [B, A, H]
        x = torch.cat([emb[:, :, None], self.mask_embedding.to(emb.dtype).expand(b, n, bs - 1, -1)], dim=2)
        x = x.reshape(b, n * bs, -1)
        cos, sin = self.positions_cos_sin(pos.reshape(b, n * bs))
        # Block (anchor a) sees context positions < a and its own block, non-causally.
        sees_ctx = torch.arange(t, device=dev) < anchors[..., None]  # [B, A, T]
        sees_ctx = sees_ctx[:, :, None].expand(b, n, bs, t).reshape(b, n * bs, t)
        block_id = torch.arange(n, device=dev).repeat_interleave(bs)
        sees_block = (block_id[:, None] == block_id[None, :]) & in_block.view(b, 1, n * bs)
        attn_mask = torch.cat([sees_ctx, sees_block], dim=-1)

        def layer_attend(i: int) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                ck, cv = self.context_kv(i, feat, ctx_cos, ctx_sin)
                keys, values = torch.cat([ck.to(k.dtype), k], dim=1), torch.cat([cv.to(v.dtype), v], dim=1)
                return masked_attention(q, keys, values, attn_mask, self.attention_of(i).scale)
            return attend

        hidden = self.backbone(x, cos, sin, [layer_attend(i) for i in range(len(self.layers))])
        hidden = hidden.view(b, n, bs, -1)[:, :, 1:]
        return TrainBlocks(hidden=hidden, labels=block_labels, valid=valid, prev=prev, anchors=anchors)

    def position_weights(self, device: torch.device) -> torch.Tensor:
        return torch.exp(-torch.arange(self.config.block_size - 1, device=device, dtype=torch.float32) / DECAY)

    def head_loss(self, blocks: TrainBlocks, target: TargetModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert target.head is not None
        logits = target.head(blocks.hidden.reshape(-1, blocks.hidden.shape[-1]))
        return weighted_ce(logits.view(*blocks.labels.shape, -1), blocks, self.position_weights(logits.device))

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.head_loss(self.train_blocks(batch), batch.target)


def weighted_ce(logits: torch.Tensor, blocks: TrainBlocks, weights: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Position-weighted cross-entropy of logits [B, A, P, V]; top-1 accuracy at position 1 and
    over all positions (left on the device: the trainer reads them once per log interval)."""
    labels, valid = blocks.labels, blocks.valid
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         reduction="none").view(labels.shape)
    w = weights * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(dim=-1) == labels) & valid
        figures = {"acc": hit.sum() / valid.sum().clamp(min=1),
                   "acc_1": hit[..., 0].sum() / valid[..., 0].sum().clamp(min=1), "ce": loss.detach()}
    return loss, figures


# --- the speculator ----------------------------------------------------------------------------


class DFlashOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min_prob: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """A draft whose drafter probability is below this ends the row's drafts."""


BlockOptionsT = TypeVar("BlockOptionsT", bound=msgspec.Struct)


class BlockSpeculator(LearnedSpeculator[DFlashDrafter, BlockOptionsT]):
    """The serving side dflash and dspark share; each gives its options and `keep`, their cut."""

    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=15,
                                          k0_pass="stores the context K/V of the step's tokens",
                                          lookahead_slots_per_draft=2, uses_target_weights=True,
                                          trainable=True)
    Module = DFlashDrafter

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        n = target.num_layers
        layers = tuple(sorted({min(max(layer, 0), n - 1) for layer in (1, n // 2 - 1, n - 4)}))
        return DrafterConfig(method=cls.name, target=TargetShape.of(target), hidden_size=target.hidden_size,
                             intermediate_size=1024, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                             head_dim=target.head_dim, num_layers=4, target_layers=layers, block_size=8)

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        _, cfg = checkpoint(cls.name, ctx)
        if ctx.num_speculative_tokens > cfg.block_size - 1:
            raise InvalidInputError(f"{cls.name}: this drafter's block of {cfg.block_size} drafts at most "
                                    f"{cfg.block_size - 1} tokens; got K={ctx.num_speculative_tokens}")

    def sync(self, states: DeviceStates) -> None:
        self._write_context(states)

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        self._write_context(states)
        assert states.target is not None
        hidden, anchor = self._block(states, k)
        drafts, score = self.module.draft(hidden, anchor, states.target)
        return Drafts(trim(drafts, self.keep(score)))

    def keep(self, score: torch.Tensor) -> torch.Tensor:
        """[R, K] bool: which drafts pass the options' cut (trim ends a row at its first False)."""
        raise NotImplementedError

    def _write_context(self, states: DeviceStates) -> None:
        """Context K/V of every token of the step into each layer's draft KV, at its cache slot."""
        meta = states.attention
        assert meta is not None and self.kv is not None
        feat = self.module.context(states.hidden)
        cos, sin = self.module.positions_cos_sin(meta.positions)
        for i in range(len(self.module.layers)):
            k, v = self.module.context_kv(i, feat, cos, sin)
            self.attention.write(k, v, self.kv[i], meta.slot_mapping)

    def _block(self, states: DeviceStates, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass for every row: ([R, k, H] final-norm hidden of positions 1..k, anchors [R])."""
        meta, target = states.attention, states.target
        assert meta is not None and target is not None and target.embed is not None and self.kv is not None
        width = states.tokens.shape[1]
        a0 = (states.seq_lens - 1).clamp(0, width - 1)  # padding rows: anything valid
        anchor = states.tokens[states.slot_index, a0]
        rows, n = a0.shape[0], k + 1
        pos = a0[:, None] + torch.arange(n, device=a0.device)  # [R, n]
        tables = meta.block_tables
        bs = self.block_size
        slots = torch.where(states.samples[:, None], cache_slots(tables, pos, bs), -1).reshape(-1)
        # One query per block position, each with its row's table; it sees the context < a0
        # and the whole block (expand, not repeat_interleave: no output size to compute).
        query_tables = tables[:, None].expand(rows, n, tables.shape[1]).reshape(rows * n, -1)
        query_lens = (a0 + n)[:, None].expand(rows, n).reshape(-1)
        emb = target.embed(anchor)
        x = torch.cat([emb[:, None], self.module.mask_embedding.to(emb.dtype).expand(rows, k, -1)], dim=1)
        cos, sin = self.module.positions_cos_sin(pos)

        draft_kv = self.kv

        def layer_attend(i: int) -> Attend:
            kv = draft_kv[i]
            scale = self.module.attention_of(i).scale

            def attend(q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                self.attention.write(kk.reshape(rows * n, *kk.shape[2:]), v.reshape(rows * n, *v.shape[2:]),
                                     kv, slots)
                out = self.attention.attend(q.reshape(rows * n, *q.shape[2:]), kv, query_tables, query_lens, scale)
                return out.view(q.shape)
            return attend

        hidden = self.module.backbone(x, cos, sin, [layer_attend(i) for i in range(len(self.module.layers))])
        return hidden[:, 1:], anchor


class DFlashSpeculator(BlockSpeculator[DFlashOptions]):
    name = "dflash"
    Options = DFlashOptions

    def keep(self, score: torch.Tensor) -> torch.Tensor:
        return score >= self.options.min_prob
