"""ZeroMQ transport: msgspec-framed messages over a PAIR socket, arrays as zero-copy frames."""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
import zmq

from speckernel.codec import Decoder, Encoder
from speckernel.transport import HiddenStates, TokenFrame, TransportCapabilities, TransportMessage


class ZmqTransport:
    name = "zmq"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=True)

    def __init__(self, address: str, bind: bool, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
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

    def send_frame(self, frame: TokenFrame) -> None:
        self.sock.send_multipart(self.encoder.encode(frame), copy=False)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        return self._recv(TokenFrame, timeout_s)  # type: ignore[return-value]

    def send_hidden(self, step_id: int, hidden: np.ndarray) -> None:
        self.sock.send_multipart(self.encoder.encode(HiddenStates(step_id, hidden)), copy=False)

    def recv_hidden(self, timeout_s: float | None = None) -> tuple[int, np.ndarray]:
        msg: HiddenStates = self._recv(HiddenStates, timeout_s)  # type: ignore[assignment]
        return msg.step_id, msg.data

    def close(self) -> None:
        self.sock.close(linger=0)
