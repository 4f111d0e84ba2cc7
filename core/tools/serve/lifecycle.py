"""uvicorn's server, speaking for `speckernel serve`: a ready line once the engine is up and the
socket listens (with the URL and the model), a line when it stops and why, and on SIGTERM or
Ctrl-C the open streams ended with an error event and `[DONE]` before connections close, rather
than cut mid-token when uvicorn's grace runs out.
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Protocol

import uvicorn

from ... import log

logger = log.get("serve")


class Served(Protocol):
    """What this needs of the app's Server (app.py), which says what it serves and ends its streams."""

    def announce(self, url: str, started_s: float) -> None: ...

    def begin_shutdown(self, cause: str | None) -> None: ...


class ServeServer(uvicorn.Server):
    def __init__(self, served: Served, url: str, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.served = served
        self.url = url
        self.signals: list[int] = []
        """The signals that stopped the server (SIGINT: serve exits 130)."""
        self._started_at = 0.0

    def handle_exit(self, sig: int, frame: object) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)  # type: ignore[arg-type]
        # uvicorn raises a captured signal again once it has stopped (SIGTERM would then kill the
        # process with 143, after the lines below); serve ends with its own exit code instead.
        self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        begun = time.monotonic()
        await super().startup(sockets)
        if self.started:
            self._started_at = time.monotonic()
            self.served.announce(self.url, self._started_at - begun)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.served.begin_shutdown(signal.Signals(self.signals[0]).name if self.signals else None)
        await super().shutdown(sockets)
        logger.info("stopped", url=self.url, uptime_s=round(time.monotonic() - self._started_at, 1))
