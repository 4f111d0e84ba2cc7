"""The step contract between kernel and runner: StepFrame out, StepResult back.

Both carry the step id and each row's (key, generation): that pair is how the ledger knows
which request state a piece of model output belongs to. A row also names its request's slot,
the index into the runner's per-request device buffers (the token buffer above all).

K has one spelling and one meaning: K = `num_speculative_tokens`, the drafts proposed per step
for each row. EngineConfig, StepFrame, SpecPolicy, SpeculatorContext and the ModelRunner all
name it so, and a speculator's `propose(states, k)` receives it. Three neighbours keep their
own names:

- `SpeculatorCapabilities.max_k`: the most a speculator can propose per step, its limit;
  `engine.check` bounds K by it.
- `ScheduledRow.num_drafts`: the drafts one row verifies in this step (at most K; 0 after a
  K=0 step). `StepShape.verify_width` is its maximum over a step's rows, which captured graphs
  pad to 0 or K.
- `StepShape.propose_width`: the drafts an in-step speculator proposes inside a step's
  device work: K, or 0 when it runs only its sync pass.
"""

from __future__ import annotations

import msgspec

from ..outputs import TokenLogprobs
from ..sampling_params import RowSampling


class ScheduledRow(msgspec.Struct, frozen=True, array_like=True):
    key: int
    generation: int
    slot: int
    """Row of the device token buffer this request owns while it runs."""
    start_pos: int
    token_ids: list[int]
    """Host-known input tokens for positions [start_pos, start_pos + len(token_ids)); the runner
    writes them into the token buffer. The rest of the row's inputs are already there."""
    block_ids: list[int]
    sampling: RowSampling | None
    """None for a prefill chunk that ends before the last known token: nothing is sampled."""
    draft_token_ids: list[int] = []
    """Drafts to verify whose IDs the host holds (variable width, or a structured-output batch);
    the runner reads them from the token buffer all the same."""
    num_draft_slots: int = 0
    """Drafts to verify that stayed on the device (fixed width): the host knows only the count."""
    num_placeholder_inputs: int = 0
    """Async scheduling: input tokens sampled by an earlier frame still in flight; the runner
    reads them from the token buffer, after the host token_ids."""
    prev_step_id: int = -1
    """The step whose device output (placeholder input, drafts) this row reads; -1 if none. The
    runner refuses the row if that step did not complete for this (slot, generation)."""
    shifted: bool = False
    """Run-ahead: planned while prev_step_id was in flight, as if it accepted all its drafts;
    the device moves the row back by the drafts that step rejected."""
    token_bitmask: bytes = b""
    """Structured output: num_drafts + 1 rows of int32 words (bit v % 32 of word v // 32 allows
    token v), row j what the grammar allows after the first j drafts; empty: no constraint."""
    num_forced: int = 0
    """Structured output: the first num_forced of draft_token_ids are tokens the grammar forces
    (its only continuation), not a speculator's: nothing wrote them on the device, so the runner
    writes them with the host tokens."""
    mask_later: bool = False
    """Structured output, run ahead: the row's mask needs the token its frame in flight samples,
    so the host fills it after launching the step, while the device runs the forward; the
    sampling waits for it on the device (`runner.late_masks`)."""

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) + self.num_draft_slots

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholder_inputs + self.num_drafts


class StepFrame(msgspec.Struct, frozen=True, array_like=True):
    step_id: int
    rows: list[ScheduledRow]
    skip_drafts: bool = False
    """K=0 step: no scheduled request can use drafts proposed after it."""
    host_drafts: bool = False
    """Draft IDs proposed after this step must reach the host."""
    num_speculative_tokens: int = 0
    """K for drafts proposed after this step (0 without a speculator): the scheduler decides it,
    the runner and the speculator read it from here."""

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class RowResult(msgspec.Struct, frozen=True, array_like=True):
    key: int
    generation: int
    sampled: list[int]
    """Confirmed new tokens for this row (empty for a non-final prefill chunk)."""
    num_drafts: int = 0
    """Drafts this step verified for the row."""
    num_accepted: int = 0
    next_draft_ids: list[int] | None = None
    """Drafts for the next step, when they were copied to the host (trimmed at the first -1)."""
    num_next_drafts: int = 0
    """Drafts for the next step that stay on the device."""
    error: str | None = None
    """This row failed on the device: its request fails, the rest of the frame goes on."""
    logprobs: list[TokenLogprobs] | None = None
    """One per sampled token, for a row whose request asked for logprobs."""
    num_drafted: int | None = None
    """Of `num_drafts`, the drafts a speculator proposed: those before the -1 padding a
    variable-width drafter leaves where drafts stay on the device. The acceptance counters count
    these; None: all `num_drafts` (the host trimmed the padding before scheduling)."""


class StepResult(msgspec.Struct, frozen=True, array_like=True):
    step_id: int
    rows: list[RowResult]
    k0: bool = False
    """The speculator ran only its sync pass (or its drafts were dropped)."""
    num_host_draft_copies: int = 0
    speculator_error: str | None = None
    """The speculator's pass raised in this step: the target's tokens stand, no row has drafts
    from it, and the engine counts the failure (it switches a speculator that keeps failing off)."""
