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


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One output token's raw log-probability and the most likely tokens at its position
    (`SamplingParams.logprobs` of them, most likely first): the model's own log_softmax, before
    penalties, temperature, top-k/top-p and grammar."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    text: str
    """Everything generated so far (stop strings removed): the concatenation of every delta_text.
    Text that might still begin a stop string is held back until it is clear it does not."""
    token_ids: list[int]
    """The tokens behind `text`, the concatenation of every delta_token_ids: they end at the token
    where `text` ends (tokens past a stop string are dropped; see detokenizer.py for the rule)."""
    prompt_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """stop (EOS, stop token or stop string), length, abort or error; "stop" wins whenever a stop
    string ended the text, even in the delta where max_tokens ran out."""
    timing: Timing | None = None
    stats: dict[str, Any] | None = None
    """Speculation counters of this request, on the final output."""
    logprobs: list[TokenLogprobs] | None = None
    """One per delta_token_ids, when the request asked for logprobs (`SamplingParams.logprobs`)."""
