"""The access log of `speckernel serve`: one key-value line per request, once its answer is over
(a stream's too), with the method, path, status and duration, on the `speckernel.serve.access`
logger at info (the CLI shows it unless --no-access-log).

Status 499 means the client left before an answer began, 500 that the app failed without one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ... import log

logger = log.get("serve.access")
CLIENT_LEFT = 499


class AccessLog:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams through a second task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: int | None = None
        sent = 0
        left = complete = False

        async def watched_receive() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not complete)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal status, sent, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)
            complete = complete or (message["type"] == "http.response.body" and not message.get("more_body", False))

        failed = False
        try:
            await self.app(scope, watched_receive, watched_send)
        except BaseException:
            failed = True
            raise
        finally:
            client: Any = scope.get("client")
            logger.info("request", method=scope["method"], path=scope["path"],
                        status=status if status is not None else (500 if failed and not left else CLIENT_LEFT),
                        duration_ms=round((time.monotonic() - started) * 1000, 1), bytes=sent,
                        client=f"{client[0]}:{client[1]}" if client else None,
                        **({"client_left": True} if left and status is not None else {}))
