"""Wire messages between the frontend (AsyncEngine) and the engine core.

msgspec Structs, array_like and tagged; fields are only ever appended so older peers still
decode. Token arrays travel as separate zero-copy frames (see codec.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from .sampling_params import SamplingParams

WIRE = {"array_like": True, "omit_defaults": True, "gc": False, "tag": True}


# --- frontend → core -------------------------------------------------------------------------


class AddRequest(msgspec.Struct, **WIRE):
    req_id: str
    prompt_token_ids: np.ndarray
    params: SamplingParams


class AbortRequests(msgspec.Struct, **WIRE):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, **WIRE):
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, **WIRE):
    pass


FrontendMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


# --- core → frontend -------------------------------------------------------------------------


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    """Set when the request failed inside the engine (finish_reason is then 'error')."""
    stats: dict[str, Any] | None = None
    """Per-request speculation counters, on the final delta."""


class CoreOutputs(msgspec.Struct, **WIRE):
    deltas: list[RequestDelta]


class UtilityResult(msgspec.Struct, **WIRE):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreReady(msgspec.Struct, **WIRE):
    platform: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int


class CoreFailed(msgspec.Struct, **WIRE):
    error_type: str
    message: str
    invalid_input: bool = False


CoreMessage = CoreOutputs | UtilityResult | CoreReady | CoreFailed
