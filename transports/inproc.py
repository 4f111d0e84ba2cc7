"""In-process transport: two thread-safe queues, no copies; for tests and single-process runs."""

from __future__ import annotations

import queue

import numpy as np

from speckernel.transport import HiddenStates, TokenFrame, TransportCapabilities


class InprocTransport:
    name = "inproc"
    capabilities = TransportCapabilities(cross_process=False, zero_copy=True)

    def __init__(self, outbox: queue.Queue[object], inbox: queue.Queue[object]) -> None:
        self.outbox, self.inbox = outbox, inbox
        self.frames: queue.Queue[TokenFrame] = queue.Queue()
        self.hidden: queue.Queue[HiddenStates] = queue.Queue()

    @classmethod
    def pair(cls) -> tuple[InprocTransport, InprocTransport]:
        a: queue.Queue[object] = queue.Queue()
        b: queue.Queue[object] = queue.Queue()
        return cls(a, b), cls(b, a)

    def _recv(self, want: type, timeout_s: float | None) -> object:
        stash = self.frames if want is TokenFrame else self.hidden
        if not stash.empty():
            return stash.get_nowait()
        while True:
            try:
                msg = self.inbox.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no {want.__name__} within {timeout_s} s") from None
            if isinstance(msg, want):
                return msg
            (self.hidden if isinstance(msg, HiddenStates) else self.frames).put(msg)  # type: ignore[arg-type]

    def send_frame(self, frame: TokenFrame) -> None:
        self.outbox.put(frame)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        return self._recv(TokenFrame, timeout_s)  # type: ignore[return-value]

    def send_hidden(self, step_id: int, hidden: np.ndarray) -> None:
        self.outbox.put(HiddenStates(step_id, hidden))

    def recv_hidden(self, timeout_s: float | None = None) -> tuple[int, np.ndarray]:
        msg: HiddenStates = self._recv(HiddenStates, timeout_s)  # type: ignore[assignment]
        return msg.step_id, msg.data

    def close(self) -> None:
        return None
