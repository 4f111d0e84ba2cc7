"""Connections that cannot be held open for free: uvicorn's HTTP/1.1 protocol with a header timeout.

uvicorn closes a keep-alive connection that stays silent after a response, but a fresh connection
that sends nothing, or one that sends its request line and headers a byte at a time (every byte
resets uvicorn's timer), is kept forever. Here a connection must deliver a complete request head
within `header_timeout_s` of opening, and again of each response, or it is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        timer: asyncio.TimerHandle | None = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        timer: asyncio.TimerHandle | None = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._waiting_after = self.cycle
        """The request cycle that was current when the wait began; a new one means a head arrived."""
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete  # not serving a request now
        if idle and self.cycle is self._waiting_after and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head within %.1f s",
                             self.header_timeout_s)
            self.transport.close()


def guarded_h11(header_timeout_s: float) -> type[Any]:
    """The protocol class uvicorn instantiates per connection, with this header timeout."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
