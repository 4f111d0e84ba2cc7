"""What the caller of AsyncEngine.generate receives: one RequestOutput per delta."""

from __future__ import annotations

from typing import Any

import msgspec


class Timing(msgspec.Struct, kw_only=True):
    arrival: float
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def total_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    text: str
    """Everything generated so far (stop strings removed)."""
    token_ids: list[int]
    prompt_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """stop (EOS, stop token or stop string), length, abort or error."""
    timing: Timing | None = None
    stats: dict[str, Any] | None = None
    """Speculation counters of this request, on the final output."""
