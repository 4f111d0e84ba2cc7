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
    key: int
    """Internal key, unique per request for the frontend's lifetime: deltas and aborts use it,
    so a caller reusing a request id can never receive an earlier request's output."""
    prompt_token_ids: np.ndarray
    params: SamplingParams
    request_id: str = ""
    """The caller's id, for logs only."""


class AbortRequests(msgspec.Struct, **WIRE):
    keys: list[int]


class UtilityCall(msgspec.Struct, **WIRE):
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, **WIRE):
    pass


FrontendMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


# --- core → frontend -------------------------------------------------------------------------


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    key: int
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
