"""Example third-party speculators, using only speckernel's public plugin API.

repeat_last: proposes the last confirmed token K times (fixed width, no K=0 pass).
needs_hidden: declares target hidden states from a layer no target has, to show that the
kernel refuses it at start.
"""

from __future__ import annotations

import torch

from speckernel.speculator import Drafts, ProposeRow, SpeculatorCapabilities, SpeculatorContext


class RepeatLastSpeculator:
    name = "repeat_last"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device

    def check(self, ctx: SpeculatorContext) -> None:
        return None

    def propose(self, rows: list[ProposeRow], k: int) -> Drafts:
        last = [(row.new_token_ids or row.input_token_ids)[-1] for row in rows]
        return Drafts(torch.tensor(last, dtype=torch.int64, device=self.device)[:, None].repeat(1, k))

    def sync(self, rows: list[ProposeRow]) -> None:
        raise AssertionError("repeat_last declared supports_k0=False; sync must never be called")

    def release(self, req_id: str) -> None:
        return None


class NeedsHiddenStates(RepeatLastSpeculator):
    name = "needs_hidden"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8,
                                          target_hidden_layers=(1000,))
