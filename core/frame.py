"""The step contract between kernel and runner: StepFrame out, StepResult back.

Both carry the step id and each row's (req_id, generation): that pair is how the ledger knows
which request state a piece of model output belongs to.
"""

from __future__ import annotations

import msgspec


class RowSampling(msgspec.Struct, frozen=True, array_like=True):
    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int
    """Index of the output token this row samples; with the seed it fixes the random draw."""


class ScheduledRow(msgspec.Struct, frozen=True, array_like=True):
    req_id: str
    generation: int
    start_pos: int
    token_ids: list[int]
    """Input tokens for positions [start_pos, start_pos + len(token_ids))."""
    block_ids: list[int]
    sampling: RowSampling | None
    """None for a prefill chunk that ends before the last known token: nothing is sampled."""
    draft_token_ids: list[int] = []
    """Drafts to verify whose IDs the host holds (variable width, or a structured-output batch)."""
    num_draft_slots: int = 0
    """Drafts to verify that stayed on the device (fixed width): the host knows only the count."""
    num_placeholder_inputs: int = 0
    """Async scheduling: input tokens sampled by an earlier frame still in flight; the runner
    takes them from the device, after the host token_ids."""

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
    finished_req_ids: list[str] = []
    """Requests finished or preempted since the last frame: their device state can go."""

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class RowResult(msgspec.Struct, frozen=True, array_like=True):
    req_id: str
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


class StepResult(msgspec.Struct, frozen=True, array_like=True):
    step_id: int
    rows: list[RowResult]
    error: str | None = None
    """Set when the step failed on the device; its rows' requests fail, the engine goes on."""
    k0: bool = False
    """The speculator ran only its sync pass (or its drafts were dropped)."""
    num_host_draft_copies: int = 0
