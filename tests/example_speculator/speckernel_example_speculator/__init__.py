"""Example third-party speculators, using only speckernel's public plugin API.

repeat_last: proposes the last confirmed token K times (fixed width, no K=0 pass), inside the
step: an `InStepSpeculator`, reading device tensors only.
needs_hidden: declares target hidden states from a layer no target has, to show that the
kernel refuses it at start.
hidden_probe: declares target hidden states of three layers and the target's weights and KV,
and checks on every step that the kernel hands over exactly those, consistent with the token
the target just sampled (a 30-layer target such as the default model). It reads the step's
host rows, so it drafts after the step: an `AfterStepSpeculator`.
"""

from __future__ import annotations

from speckernel.plugin import (
    DeviceStates,
    Drafts,
    HostRows,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
)


def repeat_last(states: DeviceStates, k: int) -> Drafts:
    """The newest confirmed token of each row, read from the kernel's token buffer, K times."""
    last = (states.seq_lens - 1).clamp(min=0)
    tokens = states.tokens[states.slot_index, last].clamp(min=0)
    return Drafts(tokens[:, None].repeat(1, k))


class RepeatLastSpeculator(SpeculatorBase):
    name = "repeat_last"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        return repeat_last(states, k)

    def sync(self, states: DeviceStates) -> None:
        raise AssertionError("repeat_last declared supports_k0=False; sync must never be called")


class NeedsHiddenStates(RepeatLastSpeculator):
    name = "needs_hidden"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=False, max_k=8,
                                          target_hidden_layers=(1000,))


class HiddenProbe(SpeculatorBase):
    name = "hidden_probe"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=8,
                                          target_hidden_layers=(2, 15, 29), uses_target_weights=True,
                                          uses_target_kv=True)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device

    def _check(self, states: DeviceStates, rows: HostRows) -> None:
        assert set(states.hidden) == {2, 15, 29}, f"hidden states of layers {sorted(states.hidden)}"
        target = states.target
        assert target is not None and target.kv_cache is not None
        assert target.head is not None and target.norm is not None
        assert target.kv_cache.shape[0] == target.config.num_layers
        for h in states.hidden.values():
            assert h.shape == (len(states.positions), target.config.hidden_size)
        assert states.seq_lens.tolist() == rows.seq_lens, "the device and host rows tell the same step"
        for i in range(states.num_rows):
            s = rows.sampling[i]
            if not rows.samples[i] or s is None or s.temperature != 0.0:
                continue
            # The newest token was sampled from the query position right before it.
            n = rows.seq_lens[i] - 1
            idx = rows.query_start[i] + (n - 1 - rows.start_pos[i])
            predicted = int(target.head(target.norm(states.hidden[29][idx : idx + 1])).argmax())
            newest = int(states.tokens[rows.slots[i], n])
            assert predicted == newest, f"layer 29 output predicts {predicted}, the target sampled {newest}"

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        self._check(states, rows)
        return repeat_last(states, k)

    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        self._check(states, rows)
