"""In-process transport: two thread-safe queues, no serialisation; for tests and single-process runs.

Both ends of a link meet by name (`ctx.address`) in a process-wide table: the binding end
creates the pair of queues, the other takes them. A sent tensor is copied on the current stream
(stream-ordered, no host sync), so the sender may overwrite its own afterwards.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Self

from speckernel.transport import TokenFrame, TransportCapabilities, TransportContext, check_received

if TYPE_CHECKING:
    import torch


class SentTensor(NamedTuple):
    step_id: int
    tensor: torch.Tensor
    event: Any
    """A torch.Event the copy recorded on a device (None on the CPU)."""


class _Closed:
    """Put in the peer's inbox by close(): its receives fail at once instead of timing out."""


_LINKS: dict[str, tuple[queue.Queue[object], queue.Queue[object]]] = {}
_LINKS_LOCK = threading.Lock()


class InprocTransport:
    name = "inproc"
    capabilities = TransportCapabilities(cross_process=False, zero_copy=True)

    def __init__(self, outbox: queue.Queue[object], inbox: queue.Queue[object], device: str = "cpu",
                 address: str = "") -> None:
        self.outbox, self.inbox = outbox, inbox
        self.device, self.address = device, address
        self.frames: queue.Queue[object] = queue.Queue()
        self.tensors: queue.Queue[object] = queue.Queue()
        self.closed = False

    @classmethod
    def open(cls, ctx: TransportContext) -> Self:
        """The binding end creates the link under ctx.address; the other end waits up to
        ctx.timeout_s for it."""
        deadline = None if ctx.timeout_s is None else time.monotonic() + ctx.timeout_s
        while True:
            with _LINKS_LOCK:
                if ctx.bind:
                    if ctx.address in _LINKS:
                        raise ConnectionError(f"inproc link {ctx.address!r} is already bound")
                    a: queue.Queue[object] = queue.Queue()
                    b: queue.Queue[object] = queue.Queue()
                    _LINKS[ctx.address] = (a, b)
                    return cls(a, b, ctx.device, ctx.address)
                if ctx.address in _LINKS:
                    a, b = _LINKS.pop(ctx.address)
                    return cls(b, a, ctx.device, ctx.address)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no inproc link bound at {ctx.address!r} within {ctx.timeout_s} s")
            time.sleep(0.001)

    @classmethod
    def pair(cls) -> tuple[Self, Self]:
        """Two connected ends without a context (kernel tests that move frames only)."""
        a: queue.Queue[object] = queue.Queue()
        b: queue.Queue[object] = queue.Queue()
        return cls(a, b), cls(b, a)

    def _recv(self, tensors: bool, timeout_s: float | None) -> object:
        stash, other = (self.tensors, self.frames) if tensors else (self.frames, self.tensors)
        if not stash.empty():
            return stash.get_nowait()
        if self.closed:
            raise ConnectionError("inproc transport is closed")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"nothing from the inproc peer within {timeout_s} s") from None
            if isinstance(msg, _Closed):
                self.inbox.put(msg)  # every later receive fails too
                raise ConnectionError("the inproc peer closed the link")
            if isinstance(msg, TokenFrame) != tensors:
                return msg
            other.put(msg)

    def send_frame(self, frame: TokenFrame) -> None:
        if self.closed:
            raise ConnectionError("inproc transport is closed")
        self.outbox.put(frame)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        frame = self._recv(False, timeout_s)
        assert isinstance(frame, TokenFrame)
        return frame

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        if self.closed:
            raise ConnectionError("inproc transport is closed")
        copy = tensor.clone()  # on the current stream: the caller may overwrite its own afterwards
        event = None
        if copy.device.type != "cpu":  # the receiver's stream waits for the copy, its host does not
            import torch  # only a device end needs torch here; the kernel's tests move frames without it

            event = torch.Event(device=copy.device)
            event.record()
        self.outbox.put(SentTensor(step_id, copy, event))

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        sent = self._recv(True, timeout_s)
        assert isinstance(sent, SentTensor)
        got, tensor = sent.step_id, sent.tensor
        if sent.event is not None:
            sent.event.wait()
        check_received("inproc", (step_id, shape, dtype), (got, tensor.shape, tensor.dtype))
        out: torch.Tensor = tensor.to(self.device, non_blocking=True)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(_Closed())
