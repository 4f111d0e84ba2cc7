"""The transport plugin contract: how per-step token frames and hidden states move between
processes and pipeline stages.

The token frame has a fixed layout `[max_rows, 1 + max_k]` plus lengths, so every collective's
shape depends only on what all ranks already agree on, never on sampled data.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec
import numpy as np


class TransportCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    cross_process: bool
    zero_copy: bool
    carries_hidden_states: bool = True


EMPTY, PLACEHOLDER, SAMPLED, FAILED = 0, 1, 2, 3
"""Row kinds of a TokenFrame: no row here (padding past the step's rows); a scheduled row that
sampled nothing (an intermediate prefill chunk: zero tokens, by type, not by an empty length);
a row with its confirmed tokens; a row that failed on the device (its request fails)."""


class TokenFrame(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """One step's output, as the last pipeline stage publishes it. Every array's shape is fixed
    by (max_rows, max_k), which all ranks know; the metadata (step id, keys, generations, slots,
    kinds) follows from the step's StepFrame alone, so every rank computes it identically and a
    receiver checks it against its own before it uses the data."""

    step_id: int
    req_ids: np.ndarray
    """[max_rows] int64 row → request key (-1: empty row)."""
    generations: np.ndarray
    """[max_rows] int64."""
    tokens: np.ndarray
    """[max_rows, 1 + max_k] int64: the row's confirmed tokens (accepted drafts, then the bonus
    token), -1 padded."""
    accepted: np.ndarray
    """[max_rows] int32 accepted draft counts."""
    lengths: np.ndarray
    """[max_rows] int32 valid entries per row of `tokens`."""
    slots: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int64))
    """[max_rows] int64 token-buffer slot of each row (-1: empty row)."""
    kinds: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int8))
    """[max_rows] int8: EMPTY, PLACEHOLDER, SAMPLED or FAILED."""
    drafts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros((0, 0), np.int64))
    """[max_rows, max_k] int64 drafts proposed for the next step, -1 padded."""
    k0: bool = False
    """The speculator ran only its sync pass (or its drafts were dropped)."""

    @classmethod
    def empty(cls, step_id: int, max_rows: int, max_k: int) -> TokenFrame:
        return cls(
            step_id=step_id,
            req_ids=np.full(max_rows, -1, np.int64),
            generations=np.zeros(max_rows, np.int64),
            tokens=np.full((max_rows, 1 + max_k), -1, np.int64),
            accepted=np.zeros(max_rows, np.int32),
            lengths=np.zeros(max_rows, np.int32),
            slots=np.full(max_rows, -1, np.int64),
            kinds=np.zeros(max_rows, np.int8),
            drafts=np.full((max_rows, max_k), -1, np.int64),
        )

    def same_meta(self, other: TokenFrame) -> bool:
        """Step id, keys, generations, slots and kinds equal: the frame is for the same step."""
        return (self.step_id == other.step_id and np.array_equal(self.req_ids, other.req_ids)
                and np.array_equal(self.generations, other.generations)
                and np.array_equal(self.slots, other.slots)
                and np.array_equal(self.kinds == EMPTY, other.kinds == EMPTY))


class HiddenStates(msgspec.Struct, frozen=True, tag=True, array_like=True):
    step_id: int
    data: np.ndarray


TransportMessage = TokenFrame | HiddenStates


@runtime_checkable
class Transport(Protocol):
    name: str
    capabilities: TransportCapabilities

    def send_frame(self, frame: TokenFrame) -> None: ...

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame: ...

    def send_hidden(self, step_id: int, hidden: np.ndarray) -> None: ...

    def recv_hidden(self, timeout_s: float | None = None) -> tuple[int, np.ndarray]: ...

    def close(self) -> None: ...
