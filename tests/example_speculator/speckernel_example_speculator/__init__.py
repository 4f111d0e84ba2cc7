"""Example third-party speculators, using only speckernel's public plugin API.

repeat_last: proposes the last confirmed token K times (fixed width, no K=0 pass).
needs_hidden: declares target hidden states from a layer no target has, to show that the
kernel refuses it at start.
hidden_probe: declares target hidden states of three layers and the target's weights and KV,
and checks on every step that the kernel hands over exactly those, consistent with the token
the target just sampled (a 30-layer target such as the default model).
"""

from __future__ import annotations

import torch

from speckernel.plugin import Drafts, SpeculatorBase, SpeculatorCapabilities, SpeculatorContext, TargetStates


class RepeatLastSpeculator(SpeculatorBase):
    name = "repeat_last"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device

    def propose(self, states: TargetStates, k: int) -> Drafts:
        # The newest confirmed token of each row, read from the kernel's token buffer.
        last = torch.tensor([max(n - 1, 0) for n in states.seq_lens], device=self.device)
        tokens = states.tokens[states.slot_index, last].clamp(min=0)
        return Drafts(tokens[:, None].repeat(1, k))

    def sync(self, states: TargetStates) -> None:
        raise AssertionError("repeat_last declared supports_k0=False; sync must never be called")


class NeedsHiddenStates(RepeatLastSpeculator):
    name = "needs_hidden"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8,
                                          target_hidden_layers=(1000,))


class HiddenProbe(RepeatLastSpeculator):
    name = "hidden_probe"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=8,
                                          target_hidden_layers=(2, 15, 29), uses_target_weights=True,
                                          uses_target_kv=True)

    def _check(self, states: TargetStates) -> None:
        assert set(states.hidden) == {2, 15, 29}, f"hidden states of layers {sorted(states.hidden)}"
        target = states.target
        assert target is not None and target.kv_cache is not None
        assert target.head is not None and target.norm is not None
        assert target.kv_cache.shape[0] == target.config.num_layers
        for h in states.hidden.values():
            assert h.shape == (len(states.positions), target.config.hidden_size)
        for i in range(states.num_rows):
            s = states.sampling[i]
            if not states.samples[i] or s is None or s.temperature != 0.0:
                continue
            # The newest token was sampled from the query position right before it.
            n = states.seq_lens[i] - 1
            idx = states.query_start[i] + (n - 1 - states.start_pos[i])
            predicted = int(target.head(target.norm(states.hidden[29][idx : idx + 1])).argmax())
            newest = int(states.tokens[states.slots[i], n])
            assert predicted == newest, f"layer 29 output predicts {predicted}, the target sampled {newest}"

    def propose(self, states: TargetStates, k: int) -> Drafts:
        self._check(states)
        return super().propose(states, k)

    def sync(self, states: TargetStates) -> None:
        self._check(states)
