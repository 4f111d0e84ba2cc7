"""Wire messages between the frontend (AsyncEngine) and the engine core.

msgspec Structs, array_like and tagged; fields are only ever appended so older peers still
decode. Token arrays travel as separate zero-copy frames (see codec.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..config import EngineConfig
from ..outputs import TokenLogprobs
from ..sampling_params import SamplingParams

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


Scalar = int | float | str | bool | None
"""Utility arguments are flat scalars, so decoding one never recurses (a nested frame fails fast)."""


class UtilityCall(msgspec.Struct, **WIRE):
    call_id: int
    method: str
    args: list[Scalar] = []


class Shutdown(msgspec.Struct, **WIRE):
    pass


FrontendMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


def check_wire(msg: FrontendMessage) -> None:
    """What the msgspec types cannot say about a decoded message; raises ValueError.

    Token arrays arrive as any dtype and shape the sender chose (float with NaN, 2-D, 0-d,
    unicode); only a 1-D integer array is a prompt."""
    if isinstance(msg, AddRequest):
        ids = msg.prompt_token_ids
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"prompt_token_ids: expected a 1-D integer array, got {ids.dtype.str} of shape "
                             f"{ids.shape}")


class Malformed(msgspec.Struct, frozen=True):
    """Not on the wire: the core's socket thread hands the loop a frame it had to drop, with what it
    could still read of it, so a request or call whose id is known fails instead of waiting."""

    kind: str
    """The message tag ("AddRequest", "UtilityCall", ...), or "" when unreadable."""
    ident: int | None
    """Its key or call id, when readable."""
    error: str


# --- core → frontend -------------------------------------------------------------------------


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    key: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    """Set when the request failed inside the engine (finish_reason is then 'error')."""
    stats: dict[str, Any] | None = None
    """Per-request speculation counters, on the final delta."""
    logprobs: list[TokenLogprobs] | None = None
    """One per new token, for a request that asked for logprobs."""


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


class Heartbeat(msgspec.Struct, **WIRE):
    """Sent by the core's loop every HEARTBEAT_S: a core that stops sending them is hung."""


CoreMessage = CoreOutputs | UtilityResult | CoreReady | CoreFailed | Heartbeat


class CoreBootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """What the frontend writes to the core's stdin: config, socket addresses and CURVE keys.

    The core connects to both sockets as a CURVE client: it speaks only to the holder of
    `server_key`'s secret (the frontend), and the frontend admits only `public_key`."""

    config: EngineConfig
    in_addr: str
    out_addr: str
    parent_pid: int
    server_key: bytes
    public_key: bytes
    secret_key: bytes
