"""The host-side gate, for devices whose streams cannot wait for the host."""

from __future__ import annotations

import threading
import time

from speckernel import log


class HostWaitGate:
    """Device work is issued in order by one thread, so that thread waits in `wait()`, before it
    issues the gated work, until `open()` or the timeout. Stream-side gates reuse `block()` as
    the body of the host function the stream waits on."""

    blocks_host = True

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.timed_out = False
        self.opened_at = 0.0
        self.blocked_at = 0.0
        self.passed_at = 0.0
        self._opened = threading.Event()
        self._enqueued = False

    def enqueue(self) -> None:
        self._enqueued = True

    def wait(self) -> None:
        if self._enqueued:
            self.block()

    def open(self) -> None:
        if not self.opened_at:
            self.opened_at = time.perf_counter()
        self._opened.set()

    def block(self) -> None:
        """Returns once the gate is open; opens it (and says so) when the timeout passes first."""
        self.blocked_at = time.perf_counter()
        if not self._opened.wait(self.timeout_s):
            self.timed_out = True
            self._opened.set()
            log.get("platform").warning("host_gate_timeout", timeout_s=self.timeout_s,
                                        effect="gated device work ran without the host's go")
        self.passed_at = time.perf_counter()
