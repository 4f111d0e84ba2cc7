"""CUDA IPC transport: stages on one host, including stages that share one GPU (where nccl
refuses two ranks), move tensors device to device through a ring of shared buffers, with no
host staging and no host waiting for the device.

Each direction of a link has a ring of slots owned by its sender (`RING`, growing to `MAX_RING`
while the receiver lags). A send copies the tensor
into a free slot on the current stream and records the slot's IPC event there; a receive makes
its current stream wait on that event, copies the slot out into a fresh tensor and records its
own IPC event for the slot. A small host channel, a zmq PAIR socket at `ctx.address`, carries
the step id, slot, dtype and shape of each tensor (and a slot's memory and event handles the
first time they are needed), the receiver's credits, and the token frames; its dropped connection
(a peer that died) or a goodbye (one that closed) fails the receives at once. A slot is reused only
after its credit came back, and the sender's stream first waits on the receiver's event, so
the slot is overwritten only after the receiver's copy out of it has passed on the device. A
sender with no credit waits on the host for one (the receiver has issued its copy), at most
ctx.timeout_s.

On the CPU the same ring lives in shared host memory (`multiprocessing.shared_memory`) and the
copies complete before they return, so the events drop out: ordering, credits, step-id checks,
a closed peer and timeouts run in CI without a GPU. Only a GPU exercises the IPC memory and
event handles and the stream waits.

Both ends must number the host's GPUs alike (the same CUDA_VISIBLE_DEVICES); a receiver on
another GPU than the sender's reads the slot over peer access.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Self

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from speckernel.transport import (
    StepMismatchError,
    TokenFrame,
    TransportCapabilities,
    TransportContext,
    check_received,
)
from speckernel.wire.codec import Decoder, Encoder

RING = 4
"""Slots a direction starts with."""
MAX_RING = 16
"""Slots a direction may grow to when the receiver lags: with this many tensors in flight, a
sender waits on the host for a credit."""
BYE_LINGER_MS = 200
"""How long a closing end keeps trying to deliver its goodbye."""
MIN_SLOT_BYTES = 1 << 20
"""A slot's first size; it grows to the next power of two that holds a larger tensor."""


class CudaMemory(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A slot's device buffer, as torch shares CUDA storage (`UntypedStorage._share_cuda_`)."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class HostMemory(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A slot's shared host buffer, by name. The receiver unlinks the name once it has mapped
    it (the sender, if nobody did by its close), so a process that dies leaves nothing in
    /dev/shm; the resource tracker is kept out of it, since ends of one link may or may not share
    one tracker."""

    name: str
    size: int


class Filled(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A tensor waits in `slot` for the receiver."""

    step_id: int
    slot: int
    dtype: str
    """A torch dtype's attribute name."""
    shape: tuple[int, ...]
    memory: CudaMemory | HostMemory | None = None
    """The slot's buffer, when it is new to the receiver (its first use, or it grew)."""
    event: bytes = b""
    """The IPC handle of the event the sender records after filling the slot (first use only)."""


class Freed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The receiver's credit: its copy out of `slot` is issued, ordered before its event."""

    slot: int
    event: bytes = b""
    """The IPC handle of the receiver's event for this slot (first use only)."""


class Bye(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The peer closed its end."""


Message = TokenFrame | Filled | Freed | Bye


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StepMismatchError(f"cuda_ipc: unknown dtype {name!r} from the peer")
    return dtype


class Slot:
    """One slot of a ring: of this end's outgoing ring (it owns the buffer and records `filled`),
    or of the peer's, as this end sees it (it maps the buffer and records `freed`)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.shm: shared_memory.SharedMemory | None = None
        self.filled: Any = None
        """torch.cuda.Event(interprocess=True) the sender records after each copy in (CUDA only)."""
        self.freed: Any = None
        """The receiver's event for the slot, recorded after each copy out (CUDA only)."""
        self.announced = False
        """The receiver knows the buffer (a sender's slot)."""


class CudaIpcTransport:
    """Stages on one host, device to device through CUDA IPC buffers and events (shared host
    memory on the CPU)."""

    name = "cuda_ipc"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=False, device_direct=True)

    def __init__(self, ctx: TransportContext, sock: zmq.Socket[Any]) -> None:
        self.ctx, self.sock = ctx, sock
        self.device = torch.device(ctx.device)
        self.cuda = self.device.type == "cuda"
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT) if ctx.bind else ctx.address
        self.encoder, self.decoder = Encoder(), Decoder(Message)
        self.slots = [Slot() for _ in range(RING)]
        self.free: deque[int] = deque(range(RING))
        self.mirrors: list[Slot] = []
        self.frames: deque[TokenFrame] = deque()
        self.filled: deque[Filled] = deque()
        self.retired: list[torch.Tensor] = []
        """Buffers a slot outgrew: kept until close, since the peer may still map them."""
        self.owned: list[shared_memory.SharedMemory] = []
        self.mapped: list[shared_memory.SharedMemory] = []
        """Shared host memory this end created (it unlinks it) and that it maps of the peer's."""
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        """Tells when the peer's connection drops (its process died): receives then fail at once."""
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.send_poller = zmq.Poller()
        self.send_poller.register(sock, zmq.POLLOUT)
        self.send_poller.register(self.monitor, zmq.POLLIN)
        self.peer_gone = False
        self.closed = False

    @classmethod
    def open(cls, ctx: TransportContext) -> Self:
        """Binds or connects the host channel at ctx.address at once."""
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, ctx.max_frame_bytes)
        (sock.bind if ctx.bind else sock.connect)(ctx.address)
        return cls(ctx, sock)

    # --- the host channel ----------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        """Sends without blocking while the peer takes messages; otherwise waits for room up to
        ctx.timeout_s, failing at once if the peer's connection drops (a credit for a peer that is
        gone is dropped instead)."""
        if self.closed:
            raise ConnectionError("cuda_ipc transport is closed")
        frames = self.encoder.encode(msg)
        deadline = None if self.ctx.timeout_s is None else _now_ms() + int(self.ctx.timeout_s * 1000)
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            left = None if deadline is None else deadline - _now_ms()
            if left is not None and left <= 0:
                raise TimeoutError(f"cuda_ipc {self.address}: no peer took a message within {self.ctx.timeout_s} s")
            ready = dict(self.send_poller.poll(left))
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                self.peer_gone = True
            if self.peer_gone:
                if isinstance(msg, Freed):
                    return
                raise ConnectionError(f"cuda_ipc {self.address}: the peer closed the link or died")

    def _pump(self, deadline_ms: int | None) -> bool:
        """Reads one message from the channel into its queue; False when none came in time (or
        the peer's connection dropped, which sets peer_gone)."""
        ready = dict(self.poller.poll(deadline_ms))
        if self.sock not in ready:
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                self.peer_gone = True
            return False
        try:
            msg = self.decoder.decode(self.sock.recv_multipart(copy=False))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"malformed cuda_ipc message on {self.address}: {e}") from e
        if isinstance(msg, TokenFrame):
            self.frames.append(msg)
        elif isinstance(msg, Filled):
            self.filled.append(msg)
        elif isinstance(msg, Freed):
            self._credit(msg)
        else:
            self.peer_gone = True
        return True

    def _wait_for(self, queue: deque[Any], timeout_s: float | None, what: str) -> None:
        """Pumps the channel until `queue` has an item; TimeoutError, or ConnectionError once the
        peer said goodbye."""
        if self.closed:
            raise ConnectionError("cuda_ipc transport is closed")
        deadline = None if timeout_s is None else _now_ms() + int(timeout_s * 1000)
        while not queue:
            if self.peer_gone and not self._pump(0):  # what the peer sent before it went still counts
                raise ConnectionError(f"cuda_ipc {self.address}: the peer closed the link or died")
            left = None if deadline is None else max(0, deadline - _now_ms())
            if not self._pump(left) and deadline is not None and _now_ms() >= deadline:
                raise TimeoutError(f"cuda_ipc {self.address}: no {what} within {timeout_s} s")

    # --- frames ----------------------------------------------------------------------------------

    def send_frame(self, frame: TokenFrame) -> None:
        self._send(frame)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        self._wait_for(self.frames, timeout_s, "token frame")
        return self.frames.popleft()

    # --- tensors: the sending side ---------------------------------------------------------------

    def _credit(self, msg: Freed) -> None:
        slot = self.slots[msg.slot]
        if msg.event and self.cuda:
            slot.freed = torch.cuda.Event.from_ipc_handle(self.device, msg.event)
        self.free.append(msg.slot)

    def _grow(self, slot: Slot, nbytes: int) -> None:
        size = max(MIN_SLOT_BYTES, 1 << (nbytes - 1).bit_length())
        if slot.buffer is not None:
            self.retired.append(slot.buffer)
        if self.cuda:
            slot.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            slot.shm = shared_memory.SharedMemory(create=True, size=size)
            resource_tracker.unregister(slot.shm._name, "shared_memory")  # type: ignore[attr-defined]  # see _map
            self.owned.append(slot.shm)
            slot.buffer = torch.frombuffer(slot.shm.buf, dtype=torch.uint8, count=size)
        slot.announced = False

    def _memory(self, slot: Slot) -> CudaMemory | HostMemory:
        assert slot.buffer is not None
        if slot.shm is not None:
            return HostMemory(slot.shm.name, slot.buffer.numel())
        share = slot.buffer.untyped_storage()._share_cuda_()
        return CudaMemory(*share)

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        while not self.free and self._pump(0):  # credits the receiver already sent
            pass
        if not self.free and len(self.slots) < MAX_RING:
            self.slots.append(Slot())
            self.free.append(len(self.slots) - 1)
        self._wait_for(self.free, self.ctx.timeout_s, "credit for a ring slot")
        index = self.free.popleft()
        slot = self.slots[index]
        nbytes = tensor.numel() * tensor.element_size()
        if slot.freed is not None:  # the receiver's copy out of this slot passes first, on the device
            slot.freed.wait(torch.cuda.current_stream(self.device))
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            self._grow(slot, nbytes)
        assert slot.buffer is not None
        slot.buffer[:nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        event = b""
        if self.cuda:
            first = slot.filled is None
            if first:
                slot.filled = torch.cuda.Event(interprocess=True)
            slot.filled.record(torch.cuda.current_stream(self.device))
            if first:  # after the record, which creates the event on this end's device
                event = slot.filled.ipc_handle()
        memory = None if slot.announced else self._memory(slot)
        slot.announced = True
        self._send(Filled(step_id, index, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                          memory, event))

    # --- tensors: the receiving side -------------------------------------------------------------

    def _map(self, mirror: Slot, memory: CudaMemory | HostMemory) -> None:
        if mirror.buffer is not None:
            self.retired.append(mirror.buffer)
        if isinstance(memory, HostMemory):
            mirror.shm = shared_memory.SharedMemory(name=memory.name)
            mirror.shm.unlink()  # both ends map it now: the name goes, so no end's death leaves it behind
            self.mapped.append(mirror.shm)
            mirror.buffer = torch.frombuffer(mirror.shm.buf, dtype=torch.uint8, count=memory.size)
        else:
            torch.cuda.init()
            storage = torch.UntypedStorage._new_shared_cuda(*msgspec.structs.astuple(memory))
            mirror.buffer = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        self._wait_for(self.filled, timeout_s, "tensor")
        note = self.filled.popleft()
        if not 0 <= note.slot < MAX_RING:
            raise ValueError(f"cuda_ipc {self.address}: slot {note.slot} from the peer; the ring has {MAX_RING}")
        while len(self.mirrors) <= note.slot:
            self.mirrors.append(Slot())
        mirror = self.mirrors[note.slot]
        if note.memory is not None:
            self._map(mirror, note.memory)
        if note.event:
            mirror.filled = torch.cuda.Event.from_ipc_handle(self.device, note.event)
        assert mirror.buffer is not None
        sent_dtype = dtype_of(note.dtype)
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if mirror.filled is not None:
            mirror.filled.wait(stream)
        nbytes = sent_dtype.itemsize
        for n in note.shape:
            nbytes *= n
        out = mirror.buffer[:nbytes].view(sent_dtype).view(note.shape).to(self.device, copy=True)
        event = b""
        if self.cuda:
            first = mirror.freed is None
            if first:
                mirror.freed = torch.cuda.Event(interprocess=True)
            mirror.freed.record(stream)
            if first:  # after the record, which creates the event on this end's device
                event = mirror.freed.ipc_handle()
        self._send(Freed(note.slot, event))
        check_received(f"cuda_ipc {self.address}", (step_id, shape, dtype), (note.step_id, note.shape, sent_dtype))
        return out

    def close(self) -> None:
        """Says goodbye (the peer's receives fail at once), then releases the ring."""
        if self.closed:
            return
        try:
            self.sock.send_multipart(self.encoder.encode(Bye()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # no peer connected, or its queue is full: it times out instead
            pass
        self.closed = True
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=BYE_LINGER_MS)
        for slot in self.slots:
            slot.buffer = None  # a view of shared memory keeps its mapping open
        for mirror in self.mirrors:
            mirror.buffer = None
        self.retired.clear()
        for shm in self.mapped:
            shm.close()
        for shm in self.owned:
            shm.close()
            resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]  # unlink unregisters
            try:
                shm.unlink()
            except FileNotFoundError:  # the peer mapped it and unlinked the name
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _now_ms() -> int:
    return int(time.monotonic() * 1000)
