"""What the scheduler needs to know of the speculator, derived once at start from what the
speculator declares (its capabilities) and what the attention backend declares (`device_planned`).

No torch: the capabilities and the backend are only read here, so their types are imported for
the type checker alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ..config import EngineConfig

if TYPE_CHECKING:
    from ..attention import AttentionBackend
    from ..plugin import SpeculatorCapabilities


class SpecPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler needs to know of the speculator: derived from its capabilities."""

    num_speculative_tokens: int
    """K: drafts proposed per step for each row (see `kernel.frame`)."""
    lookahead_slots: int
    variable_width: bool
    """Draft IDs must reach the host (variable width, where the device does not pad them)."""
    skip_drafts: bool = True
    """Allow K=0 steps (off: `--no-skip-drafts`, for comparison)."""
    run_ahead: bool = False
    """Schedule a speculative request's next step while its current one is in flight, as if
    every draft is accepted (the device moves the row back by what was rejected)."""
    sampled_drafts: bool = False
    """Verification reads the speculator's proposal distribution at each draft position, which
    a token the grammar forces was not drawn from: no forced drafts then."""


def lookahead_slots(caps: SpeculatorCapabilities | None, num_speculative_tokens: int) -> int:
    """KV slots a request holds past its tokens for the speculator's K drafts (0 without one)."""
    return caps.lookahead_slots(num_speculative_tokens) if caps is not None else 0


def spec_policy(caps: SpeculatorCapabilities | None, backend: AttentionBackend,
                config: EngineConfig, in_step: bool = False) -> SpecPolicy | None:
    """None without a speculator. Where the backend plans steps on the device, a step verifies K
    slots whatever the drafts (graphs pad to K anyway): variable-width drafts are padded with -1
    there instead of copied to the host, and the requests of a speculator that drafts inside the
    step (`in_step`: an `InStepSpeculator`) run ahead of their accepted counts (with async
    scheduling)."""
    if caps is None:
        return None
    k = config.num_speculative_tokens
    variable_width = caps.draft_width == "variable" and not backend.device_planned
    run_ahead = in_step and backend.device_planned and config.async_scheduling and not variable_width
    return SpecPolicy(num_speculative_tokens=k, lookahead_slots=lookahead_slots(caps, k),
                      variable_width=variable_width, skip_drafts=config.skip_drafts, run_ahead=run_ahead,
                      sampled_drafts=caps.sampled_drafts)
