"""EAGLE-3: an fc over the target's hidden states entering layers (2, L/2, L-3), one decoder
layer whose attention reads cat[embed(token), feature] (2H), and a head over a draft vocabulary
of the target's most frequent tokens, mapped back with `d2t` (target id = index + d2t[index]).

Checkpoint names follow the public EAGLE-3 layout: `fc`, `midlayer.*` (with `hidden_norm`),
`norm`, `lm_head`, `d2t`, `t2d`. Fixed width: the host never needs its draft IDs.
"""

from __future__ import annotations

import torch
from torch import nn

from speckernel.plugin import ModelConfig, TargetModel
from speckernel.speculators.chain import ChainModule, ChainSpeculator
from speckernel.speculators.learned import Attend, DecoderBlock, DrafterConfig, Norm, TargetShape

DRAFT_VOCAB = 4096


class MidLayer(DecoderBlock):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg, in_dim=2 * cfg.hidden_size)
        self.hidden_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Module(ChainModule):
    d2t: torch.Tensor
    """Draft index -> target id offset (public EAGLE-3 layout)."""
    t2d: torch.Tensor
    """Target id -> in the draft vocabulary."""
    t2d_index: torch.Tensor
    """Target id -> draft index (-1: not in it), derived from d2t."""

    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, target, max_len)
        h = cfg.hidden_size
        vocab = cfg.draft_vocab_size or cfg.target.vocab_size
        self.fc = nn.Linear(len(cfg.target_layers) * h, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = Norm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.target.vocab_size, dtype=torch.bool))
        self.t2d[:vocab] = True
        self.register_buffer("t2d_index", torch.empty(0, dtype=torch.int64), persistent=False)
        self._index()

    def _index(self) -> None:
        index = torch.full((self.t2d.shape[0],), -1, dtype=torch.int64, device=self.d2t.device)
        draft = torch.arange(self.d2t.shape[0], device=self.d2t.device)
        index[draft + self.d2t] = draft
        self.t2d_index = index

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._index()

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """d2t must map every draft index to a distinct target id (an id out of the vocabulary
        would fail every request that drafts it; a negative one would wrap around)."""
        d2t = state["d2t"]
        vocab = self.t2d.shape[0]
        ids = torch.arange(d2t.shape[0]) + d2t
        bad = ((ids < 0) | (ids >= vocab)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"tensor d2t maps draft index {i} to target id {int(ids[i])}, outside the "
                             f"vocabulary [0, {vocab}) ({len(bad)} such entries)")
        if len(ids.unique()) != len(ids):
            raise ValueError("tensor d2t maps two draft indices to the same target id")

    def fit_vocab(self, counts: torch.Tensor) -> None:
        """Keeps the most frequent target tokens (counts [V] over the training labels)."""
        keep = counts.topk(self.d2t.shape[0]).indices.sort().values.to(self.d2t.device)
        self.d2t.copy_(keep - torch.arange(keep.shape[0], device=keep.device))
        self.t2d.zero_()
        self.t2d[keep] = True
        self._index()

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([hidden[layer] for layer in self.config.target_layers], dim=-1))

    def run(self, embedded: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: Attend) -> torch.Tensor:
        mid = self.midlayer
        wide = torch.cat([mid.input_layernorm(embedded), mid.hidden_norm(feature)], dim=-1)
        return mid(feature, cos, sin, attend, attn_input=wide)

    def logits(self, out: torch.Tensor, target: TargetModel) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index + self.d2t[index]

    def to_draft_index(self, labels: torch.Tensor) -> torch.Tensor:
        return self.t2d_index[labels]


class Eagle3Speculator(ChainSpeculator):
    name = "eagle3"
    Module = Eagle3Module

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        n = target.num_layers
        return DrafterConfig(method="eagle3", target=TargetShape.of(target), hidden_size=target.hidden_size,
                             intermediate_size=1024, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                             head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                             target_layers=(1, n // 2 - 1, n - 4),
                             draft_vocab_size=min(DRAFT_VOCAB, target.vocab_size), num_steps=5)
