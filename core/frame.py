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


class StepFrame(msgspec.Struct, frozen=True, array_like=True):
    step_id: int
    rows: list[ScheduledRow]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


class RowResult(msgspec.Struct, frozen=True, array_like=True):
    req_id: str
    generation: int
    sampled: list[int]
    """Confirmed new tokens for this row (empty for a non-final prefill chunk)."""


class StepResult(msgspec.Struct, frozen=True, array_like=True):
    step_id: int
    rows: list[RowResult]
    error: str | None = None
    """Set when the step failed on the device; its rows' requests fail, the engine goes on."""
