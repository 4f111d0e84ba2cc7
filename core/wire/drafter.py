"""The drafter RPC: the `remote` speculator (a DEALER) and `speckernel serve-drafter` (a ROUTER).

One request, one reply, matched by `call_id`, in order on one socket: the server handles its
requests in the order they were sent, so an `Ingest` sent before a `Propose` is always in the
drafter's state when the proposal runs. Arrays (tokens, hidden states, drafts) travel as
zero-copy frames (`codec`). Rows name their request by (slot, generation), never by position in
the step, so a reply can only ever be applied to the request it was computed for.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..errors import InvalidInputError
from ..sampling_params import RowSampling
from .limits import REPLY_FRAME_BYTES as REPLY_FRAME_BYTES

SERVER_SECRET = "server.key_secret"
CLIENT_SECRET = "client.key_secret"
"""The CURVE secret key files of a keys folder (`speckernel serve-drafter --keys DIR`)."""

WIRE = {"array_like": True, "omit_defaults": True, "gc": False, "tag": True}


class Describe(msgspec.Struct, **WIRE):
    """What would you serve for this target and these sizes? (the speculator's `check`)."""

    call_id: int
    target: str
    """The target's fingerprint (`fingerprint`): the server refuses another target."""
    block_size: int
    max_model_len: int
    num_speculative_tokens: int


class Hello(Describe, **WIRE):
    """Describe, then build the drafter's state for num_slots slots (the engine is starting)."""

    num_slots: int = 0


class Row(msgspec.Struct, array_like=True, gc=False):
    slot: int
    generation: int
    start_pos: int
    """Position of the row's first query token."""
    num_tokens: int
    """Query tokens of the row in this step (their hidden states are in the step's arrays)."""
    num_drafts: int
    accepted: int
    seq_len: int
    """Confirmed tokens after the step (the newest one's target KV is not written yet)."""
    samples: bool
    tokens_from: int
    """Position of the first of this row's `tokens` (the rest follow in order)."""
    num_new_tokens: int
    sampling: RowSampling | None = None


class Ingest(msgspec.Struct, **WIRE):
    """One step as the target saw it, for the drafter's K=0 pass (keep its state in step)."""

    call_id: int
    rows: list[Row]
    tokens: np.ndarray
    """int64: each row's token-buffer span [tokens_from, tokens_from + num_new_tokens), in row order."""
    hidden: list[np.ndarray]
    """Per declared target layer, [T, H] over the step's query tokens (bfloat16 as its raw int16 bits)."""
    hidden_dtype: str = "float32"


class Propose(Ingest, **WIRE):
    """The same step, then K drafts per row."""

    k: int = 0


class Free(msgspec.Struct, **WIRE):
    """These requests are over: their slots may be given to new requests."""

    call_id: int
    slots: list[int]
    generations: list[int]


class Ping(msgspec.Struct, **WIRE):
    call_id: int


DrafterRequest = Describe | Hello | Ingest | Propose | Free | Ping


class ServerTiming(msgspec.Struct, array_like=True, gc=False):
    """Where the server spent a request's time, in ms (host clock; on a device that runs
    asynchronously `d2h` also holds the device work still running when the drafts were asked for,
    and `device_compute` the pass's own device time, -1 where the server does not time it)."""

    decode: float = 0.0
    """Frames received -> the request decoded."""
    hold: float = 0.0
    """The injected round trip (`--inject-rtt-ms`), both halves."""
    prepare: float = 0.0
    """Checks, the step's plan, token and hidden-state copies to the device."""
    compute: float = 0.0
    """The drafter's pass, as the host issued it."""
    d2h: float = 0.0
    """The drafts to the host."""
    send: float = 0.0
    """Encoding and sending the server's previous reply (this one's is not known yet)."""
    device_compute: float = -1.0


class Described(msgspec.Struct, **WIRE):
    call_id: int
    session: int
    """Random per server start: a new one means the server restarted and lost every slot's state."""
    method: str
    capabilities: dict[str, Any]
    """The served drafter's `SpeculatorCapabilities` for that target, as builtins."""
    dtype: str


class Drafted(msgspec.Struct, **WIRE):
    call_id: int
    slots: list[int]
    generations: list[int]
    token_ids: np.ndarray
    """[rows, K] int64; -1 ends a variable-width row."""
    timing: ServerTiming | None = None


class Done(msgspec.Struct, **WIRE):
    """Ingest, Free and Ping went through."""

    call_id: int
    session: int = 0
    timing: ServerTiming | None = None


class Failed(msgspec.Struct, **WIRE):
    call_id: int
    error: str
    invalid_input: bool = False
    """The request was refused (a wrong target, a K the drafter cannot draft), not a fault."""


DrafterReply = Described | Drafted | Done | Failed


def fingerprint(config: msgspec.Struct) -> str:
    """A target's identity on the wire: its ModelConfig, as canonical JSON."""
    return msgspec.json.encode(msgspec.to_builtins(config, order="sorted")).decode()


HIDDEN_CARRIERS = {"float32": "float32", "float16": "float16", "bfloat16": "int16"}
"""Hidden-state dtype on the wire -> the numpy dtype carrying it (bfloat16 travels as its bits)."""


def check_private(path: Path) -> None:
    """Refuses a secret key file that group or others may read (whoever reads it can pose as its
    holder), with the fix in one line; a missing file is left to the loader to report."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    if mode & 0o077:
        raise InvalidInputError(f"secret key {path} is open to group or others (mode {mode:04o}); "
                                f"run `chmod 600 {path}`")
