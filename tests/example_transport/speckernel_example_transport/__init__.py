"""A transport as a vendor would ship one: a plain TCP socket per link, messages framed by
length, token frames and tensors encoded with speckernel's wire codec. It imports only the
transport contract and the codec, and proves itself with `speckernel.testing.check_transport`.

Tensors cross as host bytes (`device_direct=False`): a device tensor is copied to the host when
sent, which waits for the device. A closed or dead peer ends the stream, so a receive raises
ConnectionError at once. `TCP_PIPE_TRACE=FILE` appends "rank peer pid" for every end opened.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import urllib.parse
from collections import deque
from typing import TYPE_CHECKING, Self

import msgspec

from speckernel.transport import (
    HostTensor,
    TokenFrame,
    TransportCapabilities,
    TransportContext,
    TransportMessage,
)
from speckernel.wire.codec import Decoder, Encoder

if TYPE_CHECKING:
    import torch

LENGTH = struct.Struct("!Q")
"""Each message: its number of frames, then every frame as its length and its bytes."""


class TcpPipeTransport:
    name = "tcp_pipe"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=False)

    def __init__(self, ctx: TransportContext, listener: socket.socket | None, sock: socket.socket | None,
                 address: str) -> None:
        self.ctx, self.listener, self.sock, self.address = ctx, listener, sock, address
        self.encoder, self.decoder = Encoder(), Decoder(TransportMessage)
        self.stash: dict[type, deque[object]] = {TokenFrame: deque(), HostTensor: deque()}
        self.inbox = bytearray()

    @classmethod
    def open(cls, ctx: TransportContext) -> Self:
        """The binding end listens and returns (it accepts on first use); the other connects,
        retrying until ctx.timeout_s while the listener is not up yet."""
        if trace := os.environ.get("TCP_PIPE_TRACE"):  # which ends were opened, in which process
            with open(trace, "a") as f:
                f.write(f"{ctx.rank} {ctx.peer} {os.getpid()}\n")
        parsed = urllib.parse.urlsplit(ctx.address)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 0
        if ctx.bind:
            listener = socket.create_server((host, port))
            return cls(ctx, listener, None, f"tcp://{host}:{listener.getsockname()[1]}")
        deadline = time.monotonic() + (ctx.timeout_s or 1e9)
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=ctx.timeout_s)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tcp_pipe: nobody listens at {ctx.address}") from None
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(ctx, None, sock, ctx.address)

    def _link(self, timeout_s: float | None) -> socket.socket:
        if self.sock is None:
            if self.listener is None:
                raise ConnectionError("tcp_pipe transport is closed")
            self.listener.settimeout(timeout_s)
            try:
                self.sock, _ = self.listener.accept()
            except TimeoutError:
                raise TimeoutError(f"tcp_pipe: no peer connected to {self.address} within {timeout_s} s") from None
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.sock

    def _send(self, msg: TransportMessage) -> None:
        frames = self.encoder.encode(msg)
        parts: list[bytes | memoryview] = [LENGTH.pack(len(frames))]
        for frame in frames:
            parts += [LENGTH.pack(memoryview(frame).nbytes), frame]
        sock = self._link(self.ctx.timeout_s)
        sock.settimeout(self.ctx.timeout_s)
        try:
            sock.sendall(b"".join(parts))
        except OSError as e:
            raise ConnectionError(f"tcp_pipe {self.address}: {e}") from e

    def _fill(self, n: int, deadline: float | None) -> None:
        """Reads until the inbox holds n bytes."""
        while len(self.inbox) < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"tcp_pipe: nothing from the peer at {self.address} in time")
            sock = self._link(left)
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError(f"tcp_pipe: nothing from the peer at {self.address} in time") from None
            except OSError as e:
                raise ConnectionError(f"tcp_pipe {self.address}: {e}") from e
            if not chunk:
                raise ConnectionError(f"tcp_pipe: the peer at {self.address} closed the link")
            self.inbox += chunk

    def _number(self, at: int, deadline: float | None) -> int:
        self._fill(at + LENGTH.size, deadline)
        value: int = LENGTH.unpack_from(self.inbox, at)[0]
        return value

    def _recv(self, want: type, timeout_s: float | None) -> object:
        """The next message of type `want`; others wait in their stash. A message is taken off
        the inbox only once whole, so a timeout loses nothing."""
        if self.stash[want]:
            return self.stash[want].popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            count, at, spans = self._number(0, deadline), LENGTH.size, []
            for _ in range(count):
                size = self._number(at, deadline)
                if size > self.ctx.max_frame_bytes:
                    raise ConnectionError(f"tcp_pipe: a frame of {size} bytes from {self.address}")
                at += LENGTH.size
                self._fill(at + size, deadline)
                spans.append((at, at + size))
                at += size
            frames = [bytes(self.inbox[a:b]) for a, b in spans]
            del self.inbox[:at]
            try:
                msg = self.decoder.decode(frames)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ValueError(f"malformed tcp_pipe message from {self.address}: {e}") from e
            if isinstance(msg, want):
                return msg
            self.stash[type(msg)].append(msg)

    def send_frame(self, frame: TokenFrame) -> None:
        self._send(frame)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        frame = self._recv(TokenFrame, timeout_s)
        assert isinstance(frame, TokenFrame)
        return frame

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        self._send(HostTensor.of(step_id, tensor))

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        msg = self._recv(HostTensor, timeout_s)
        assert isinstance(msg, HostTensor)
        return msg.tensor(step_id, shape, dtype, self.ctx.device, f"tcp_pipe {self.address}")

    def close(self) -> None:
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()
        self.sock = self.listener = None
