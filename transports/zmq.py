"""ZeroMQ transport: msgspec-framed messages over a PAIR socket, arrays as zero-copy frames.

Neither side can hang the other: sends give up after `send_timeout_s` (a PAIR socket blocks
while no peer is connected), a malformed message is a ValueError, never a crash, and a frame
over `max_frame_bytes` drops the link before it is read.
"""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
import zmq

from speckernel.transport import HiddenStates, TokenFrame, TransportCapabilities, TransportMessage
from speckernel.wire.codec import Decoder, Encoder

MAX_FRAME_BYTES = 2**30
"""A larger frame (its length is read first) drops the peer's connection unbuffered: a forged
length never makes the receiver allocate it. 1 GiB holds hidden states [T, H] of 32k tokens of a
8192-wide float32 model; the engine passes the bound of its own links (`speckernel.wire.limits`)."""


class ZmqTransport:
    name = "zmq"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=True)

    def __init__(self, address: str, bind: bool, ctx: zmq.Context | None = None,
                 send_timeout_s: float | None = 10.0, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.send_timeout_s = send_timeout_s
        self.sock.setsockopt(zmq.SNDTIMEO, -1 if send_timeout_s is None else int(send_timeout_s * 1000))
        (self.sock.bind if bind else self.sock.connect)(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address
        self.encoder = Encoder()
        self.decoder = Decoder(TransportMessage)
        self.stash: dict[type, deque[object]] = {TokenFrame: deque(), HiddenStates: deque()}

    def _recv(self, want: type, timeout_s: float | None) -> object:
        if self.stash[want]:
            return self.stash[want].popleft()
        while True:
            if not self.sock.poll(None if timeout_s is None else int(timeout_s * 1000)):
                raise TimeoutError(f"no {want.__name__} within {timeout_s} s on {self.address}")
            try:
                msg = self.decoder.decode(self.sock.recv_multipart(copy=False))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ValueError(f"malformed transport message on {self.address}: {e}") from e
            if isinstance(msg, want):
                return msg
            self.stash[type(msg)].append(msg)

    def _send(self, msg: TransportMessage) -> None:
        try:
            self.sock.send_multipart(self.encoder.encode(msg), copy=False)
        except zmq.Again:
            raise TimeoutError(f"no peer took a message within {self.send_timeout_s} s on {self.address}") from None

    def send_frame(self, frame: TokenFrame) -> None:
        self._send(frame)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        return self._recv(TokenFrame, timeout_s)  # type: ignore[return-value]

    def send_hidden(self, step_id: int, hidden: np.ndarray) -> None:
        self._send(HiddenStates(step_id, hidden))

    def recv_hidden(self, timeout_s: float | None = None) -> tuple[int, np.ndarray]:
        msg: HiddenStates = self._recv(HiddenStates, timeout_s)  # type: ignore[assignment]
        return msg.step_id, msg.data

    def close(self) -> None:
        self.sock.close(linger=0)
