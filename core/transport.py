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


class TokenFrame(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    step_id: int
    req_ids: np.ndarray
    """[max_rows] int64 row → request id (-1: empty row)."""
    generations: np.ndarray
    """[max_rows] int64."""
    tokens: np.ndarray
    """[max_rows, 1 + max_k] int64: sampled token then draft tokens, -1 padded."""
    accepted: np.ndarray
    """[max_rows] int32 accepted draft counts."""
    lengths: np.ndarray
    """[max_rows] int32 valid entries per row of `tokens`."""

    @classmethod
    def empty(cls, step_id: int, max_rows: int, max_k: int) -> TokenFrame:
        return cls(
            step_id=step_id,
            req_ids=np.full(max_rows, -1, np.int64),
            generations=np.zeros(max_rows, np.int64),
            tokens=np.full((max_rows, 1 + max_k), -1, np.int64),
            accepted=np.zeros(max_rows, np.int32),
            lengths=np.zeros(max_rows, np.int32),
        )


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
