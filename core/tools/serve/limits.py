"""What one request may cost `speckernel serve`, checked before any work is done for it.

Without bounds one client stalls every other: a 10 MB body is read and tokenized on the serving
loop, a thousand long stop strings are matched after every token, and a thousand requests queue
without limit. Each bound fails its request alone, with OpenAI's error JSON: 413 for a body, 400
for a prompt or stop list, 429 for a full queue or a wait for a slot that ran out, 408 for a body
that does not arrive in time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

import anyio
import msgspec
import numpy as np

from ...errors import EngineOverloadedError, InvalidInputError

if TYPE_CHECKING:  # the CLI reads ServeLimits without loading the server stack
    from starlette.requests import Request

Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class ServeLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_body_bytes: Positive = 8 * 2**20
    """A request body longer than this is refused (413) before it is read whole."""
    max_prompt_chars: Positive = 2 * 2**20
    """Characters of a text prompt, or of all of a conversation's messages together."""
    max_prompt_tokens: Positive | None = None
    """Prompt tokens; None: the model's context less one (the engine's own bound)."""
    max_stop: Positive = 16
    """Stop strings per request (OpenAI allows 4)."""
    max_stop_chars: Positive = 256
    """Characters of one stop string."""
    max_queue: Positive = 256
    """Generation requests in the server at once, running or waiting; more are answered 429."""
    max_queue_wait_s: PositiveFloat = 120.0
    """How long a request may wait for its first token (a slot, then its prefill); then 429."""
    body_timeout_s: PositiveFloat = 30.0
    """How long a request body may take to arrive (a slow drip is cut off with 408)."""
    header_timeout_s: PositiveFloat = 10.0
    """A connection must send a complete request head within this long of opening (or of its last
    response), whether it sends nothing or drips a byte at a time; then it is closed."""
    keep_alive_s: Positive = 5
    """An idle keep-alive connection is closed after this long (uvicorn's timeout_keep_alive)."""
    max_json_depth: Positive = 128
    """Arrays and objects nested in a request body (a JSON schema 60 levels deep fits); a body
    nested deeper is refused (400) before it is decoded."""


class BodyTooLarge(InvalidInputError):
    pass


class BodyTimeout(InvalidInputError):
    pass


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The whole body, refused as soon as it is known to be longer than the bound (its declared
    length, or the bytes read so far), or when it takes longer than `body_timeout_s`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise BodyTooLarge(f"request body is {int(declared)} bytes; this server takes at most "
                           f"{limits.max_body_bytes} (--max-body-bytes)")
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(limits.body_timeout_s) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BodyTooLarge(f"request body is over {limits.max_body_bytes} bytes, the most this server "
                                   "takes (--max-body-bytes)")
            chunks.append(chunk)
    if scope.cancelled_caught:
        raise BodyTimeout(f"request body did not arrive within {limits.body_timeout_s} s (--body-timeout)")
    return b"".join(chunks)


_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, in C-speed passes (no recursion, no
    decoding): escapes, then strings, are cut out, and the brackets left are counted."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1)).max())


def check_json_depth(body: bytes, max_depth: int) -> None:
    """InvalidInputError for a body nested deeper than max_depth (a body with fewer brackets than
    that cannot be, and is not scanned)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    depth = json_depth(body)
    if depth > max_depth:
        raise InvalidInputError(f"request body nests arrays and objects {depth} deep; this server takes at most "
                                f"{max_depth}")


def check_stop(stop: str | list[str] | None, limits: ServeLimits) -> None:
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if len(strings) > limits.max_stop:
        raise InvalidInputError(f"stop: {len(strings)} stop strings; at most {limits.max_stop} (--max-stop)")
    for s in strings:
        if len(s) > limits.max_stop_chars:
            raise InvalidInputError(f"stop: a stop string of {len(s)} characters; at most "
                                    f"{limits.max_stop_chars} (--max-stop-chars)")


def check_prompt_chars(chars: int, limits: ServeLimits, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise InvalidInputError(f"{param}: {chars} characters; this server takes at most "
                                f"{limits.max_prompt_chars} (--max-prompt-chars)")


def check_prompt_tokens(tokens: int, limits: ServeLimits, param: str) -> None:
    if limits.max_prompt_tokens is not None and tokens > limits.max_prompt_tokens:
        raise InvalidInputError(f"{param}: {tokens} tokens; this server takes at most "
                                f"{limits.max_prompt_tokens} (--max-prompt-tokens)")


class Admission:
    """Counts the generation requests in the server; one over `max_queue` is refused at once."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.in_flight = 0

    def enter(self) -> None:
        if self.in_flight >= self.limits.max_queue:
            raise EngineOverloadedError(f"server is at capacity: {self.in_flight} requests in flight, at most "
                                        f"{self.limits.max_queue} (--max-queue); retry later")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
