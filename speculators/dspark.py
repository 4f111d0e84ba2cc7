"""DSpark: the DFlash backbone plus a low-rank Markov head and a confidence head.

DFlash drafts every block position independently given the context; a block position cannot
see which token was drafted before it. The Markov head adds that back cheaply: position j's
hidden gets markov_up(markov_down(embed(prev_j))) before the target's head, where prev_j is the
previous draft (the anchor for j = 1), so drafting runs left to right: one call of the head for
all positions, then K rank-sized steps (`DSparkDrafter.draft`). The confidence head estimates
from the same feature whether draft j is accepted; a row's drafts end where the running
product of confidences (the chance all of them so far are accepted) falls below `threshold`, so
verification spends no slots on drafts likely rejected.

Training is teacher-forced: prev_j is the true previous label (an accepted draft equals it),
and the confidence learns (argmax == label) by BCE on detached features, so it never bends the
drafting head.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from speckernel.plugin import InvalidInputError, ModelConfig, TargetModel
from speckernel.speculators.dflash import BlockSpeculator, DFlashDrafter, TrainBlocks, weighted_ce
from speckernel.speculators.learned import DrafterConfig

CONFIDENCE_WEIGHT = 1.0
"""Weight of the confidence BCE next to the drafting cross-entropy."""


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, target, max_len)
        if cfg.rank < 1:
            raise InvalidInputError(f"dspark: the Markov head needs rank >= 1, got {cfg.rank}")
        h = cfg.hidden_size
        self.markov_down = nn.Linear(h, cfg.rank, bias=False)
        self.markov_up = nn.Linear(cfg.rank, h, bias=False)
        nn.init.zeros_(self.markov_up.weight)  # starts as plain DFlash; the low-rank term grows in training
        self.confidence = nn.Linear(h, 1)
        self.lifted: torch.Tensor | None = None

    def markov(self, hidden: torch.Tensor, prev: torch.Tensor, target: TargetModel) -> torch.Tensor:
        """hidden [..., H] plus the low-rank term of the previous tokens prev [...]."""
        assert target.embed is not None
        e = target.embed(prev).to(hidden.dtype)
        return hidden + self.markov_up(self.markov_down(e))

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor, target: TargetModel
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left to right, each position conditioned on the previous draft; the score is the
        confidence that each draft is accepted.

        The target's head is linear (its contract), so head(h + up(d)) = head(h) + d @ head(up):
        every position's head(h) is one call, as in DFlash, and each step left to right adds a
        rank-sized product with the Markov directions' logits (`lift`) instead of another pass
        over the whole head (49,152 x 576 for the default target)."""
        assert target.head is not None and target.embed is not None
        lift = self.lift(target)
        r, k, h = hidden.shape
        base = target.head(hidden.reshape(r * k, h)).view(r, k, -1)
        prev, drafts, downs = anchor, [], []
        for j in range(k):
            d = self.markov_down(target.embed(prev).to(hidden.dtype))
            prev = torch.addmm(base[:, j], d.float(), lift).argmax(dim=-1)
            drafts.append(prev)
            downs.append(d)
        conf = torch.sigmoid(self.confidence(hidden + self.markov_up(torch.stack(downs, dim=1))).float()[..., 0])
        return torch.stack(drafts, dim=1), conf

    def lift(self, target: TargetModel) -> torch.Tensor:
        """[rank, V] float32: the target's logits of the Markov head's directions. Made at the
        first draft, which runs eagerly before any graph is captured, and kept while serving
        (its weights never change); made anew at every draft in training mode."""
        if self.lifted is None or self.training:
            assert target.head is not None
            self.lifted = target.head(self.markov_up.weight.t().contiguous()).float()
        return self.lifted

    def head_loss(self, blocks: TrainBlocks, target: TargetModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.markov(blocks.hidden, blocks.prev, target)
        assert target.head is not None
        logits = target.head(h.reshape(-1, h.shape[-1])).view(*blocks.labels.shape, -1)
        ce, figures = weighted_ce(logits, blocks, self.position_weights(logits.device))
        hit = (logits.argmax(dim=-1) == blocks.labels).float()
        bce = F.binary_cross_entropy_with_logits(self.confidence(h.detach()).float()[..., 0], hit, reduction="none")
        valid = blocks.valid.float()
        bce = (bce * valid).sum() / valid.sum().clamp(min=1)
        return ce + CONFIDENCE_WEIGHT * bce, {**figures, "conf_bce": bce.detach()}


class DSparkOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.15
    """A row's drafts end where the running product of confidences falls below this. 0.15 by
    tokens/s on the H200 (bench-results/drafters/h200/dspark-threshold): best at 16 in flight,
    within 1% of the best (0.05) at batch 1; 0.25 was 3% and 7% slower."""


class DSparkSpeculator(BlockSpeculator[DSparkOptions]):
    name = "dspark"
    Options = DSparkOptions
    Module = DSparkDrafter

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        return msgspec.structs.replace(super().defaults(target), rank=64)

    def keep(self, score: torch.Tensor) -> torch.Tensor:
        keep = score.cumprod(dim=1) >= self.options.threshold
        keep[:, 0] = True  # always at least one draft
        return keep
