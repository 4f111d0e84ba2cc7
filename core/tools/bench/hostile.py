"""The hostile requests of `bench serve --hostile F`: what a careless or malicious client sends
next to the well-behaved load. Each kind is answered by one of serve's bounds (or, for the ones
the bounds allow, costs what a normal request costs); the bench reports how each kind ended and
what the hostile share did to the well-behaved streams' latency.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import anyio

KINDS = ("huge_body", "huge_prompt", "too_many_stops", "longest_stops", "disconnect", "idle", "drip")
"""huge_body: a body 1 MiB over serve's default --max-body-bytes (8 MiB); huge_prompt: 600,000
characters (under --max-prompt-chars, ~100k tokens: tokenized, then refused for the context);
too_many_stops: 64 stop strings; longest_stops: the most and longest stop strings the default
bounds allow (16 of 256 characters, never matching), run to the end; disconnect: a stream asking
for 400 tokens that leaves after 2 chunks; idle: a connection that sends nothing; drip: a request
head sent a byte every half second. The last two end when the server closes them."""
HUGE_BODY_BYTES = 9 * 2**20
HUGE_PROMPT = "hello world " * 50_000
LONGEST_STOPS = [("\N{SECTION SIGN}" * 255) + chr(ord("a") + i) for i in range(16)]
CONNECTION_WAIT_S = 30.0
"""How long an idle or dripping connection waits to be closed before the bench gives up on it."""


async def _stream(client: Any, body: dict[str, Any], leave_after: int | None = None) -> str:
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"content":"' in line:
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "left"
    return "200"


async def _connection(url: str, drip: bool) -> str:
    parts = urlsplit(url)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    with anyio.move_on_after(CONNECTION_WAIT_S):
        async with await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 80) as sock:
            try:
                for n in range(len(head) if drip else 0):
                    await sock.send(head[n:n + 1])
                    with anyio.move_on_after(0.5):
                        await sock.receive()
                        return "answered"
                await sock.receive()
                return "answered"
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return "closed"
    return "open"


async def hostile_request(client: Any, url: str, model: str, messages: list[dict[str, str]], kind: str) -> str:
    """One hostile request through httpx2 (`client`, on `url`); how it ended: an HTTP status,
    'left', 'closed' (the server closed the connection), 'open' (it did not within
    CONNECTION_WAIT_S) or 'answered'."""
    import httpx2  # optional: the `bench` extra

    base = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    try:
        if kind == "huge_body":
            content = json.dumps({"model": model, "prompt": "x" * HUGE_BODY_BYTES, "max_tokens": 4}).encode()
            r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            return str(r.status_code)
        if kind == "huge_prompt":
            r = await client.post("/v1/completions", json={"model": model, "prompt": HUGE_PROMPT, "max_tokens": 4})
            return str(r.status_code)
        if kind == "too_many_stops":
            return await _stream(client, base | {"stream": True, "stop": [f"s{i}" for i in range(64)]})
        if kind == "longest_stops":
            return await _stream(client, base | {"stream": True, "stop": LONGEST_STOPS})
        if kind == "disconnect":
            return await _stream(client, base | {"stream": True, "max_tokens": 400}, leave_after=2)
        if kind in ("idle", "drip"):
            return await _connection(url, drip=kind == "drip")
    except httpx2.TransportError:  # e.g. a 413 sent while the body was still going, then the connection closed
        return "closed"
    raise ValueError(f"unknown hostile kind {kind!r}")
