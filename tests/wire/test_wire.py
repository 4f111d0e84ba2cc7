"""Wire codec and transports: round trips, zero-copy frames, malformed input."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from speckernel.sampling_params import SamplingParams
from speckernel.transport import TokenFrame
from speckernel.transports.inproc import InprocTransport
from speckernel.transports.zmq import ZmqTransport
from speckernel.wire.codec import INLINE_MAX_BYTES, Decoder, Encoder
from speckernel.wire.messages import AbortRequests, AddRequest, CoreOutputs, FrontendMessage, RequestDelta, UtilityCall


def test_frontend_messages_round_trip_with_out_of_band_arrays() -> None:
    enc, dec = Encoder(), Decoder(FrontendMessage)
    big = np.arange(1000, dtype=np.int64)
    msg = AddRequest(1, big, SamplingParams(max_tokens=5, temperature=0.5, stop=("x",)))
    frames = enc.encode(msg)
    assert len(frames) == 2 and frames[1].nbytes == big.nbytes  # the array left the payload
    got = dec.decode(frames)
    assert isinstance(got, AddRequest) and got.params == msg.params
    assert np.array_equal(got.prompt_token_ids, big)
    small = AddRequest(2, np.arange(4), SamplingParams())
    assert len(enc.encode(small)) == 1 and small.prompt_token_ids.nbytes <= INLINE_MAX_BYTES
    for other in (AbortRequests([1, 2]), UtilityCall(3, "stats")):
        assert dec.decode(enc.encode(other)) == other


def test_core_outputs_round_trip() -> None:
    msg = CoreOutputs([RequestDelta(1, [1, 2], None), RequestDelta(2, [], "error", "boom")])
    assert Decoder(CoreOutputs).decode(Encoder().encode(msg)) == msg


MALFORMED = [[b""], [b"\xc1"], [b"\x92\xa3Bad\x01"], [msgspec.msgpack.encode(["AddRequest", 7, ["<i8", [3], 1], []])]]


@pytest.mark.parametrize("frames", MALFORMED)
def test_malformed_frames_raise_decode_errors(frames: list[bytes]) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        Decoder(FrontendMessage).decode(frames)


def frame_of(step: int) -> TokenFrame:
    f = TokenFrame.empty(step, max_rows=64, max_k=4)
    f.tokens[0, :3] = [5, 6, 7]
    f.lengths[0] = 3
    return f


def check_transport(a, b) -> None:  # type: ignore[no-untyped-def]
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    a.send_tensor(7, hidden)
    a.send_frame(frame_of(7))
    a.send_frame(frame_of(8))
    got = b.recv_frame(timeout_s=2)  # frames and tensors are demultiplexed
    assert got.step_id == 7 and got.tokens[0, :3].tolist() == [5, 6, 7] and got.tokens.shape == (64, 5)
    assert torch.equal(b.recv_tensor(7, (16, 64), torch.float32, timeout_s=2), hidden)
    assert b.recv_frame(timeout_s=2).step_id == 8


def test_inproc_transport() -> None:
    check_transport(*InprocTransport.pair())


def test_zmq_transport_over_tcp_loopback() -> None:
    a = ZmqTransport("tcp://127.0.0.1:*", bind=True)
    b = ZmqTransport(a.address, bind=False)
    try:
        check_transport(a, b)
        with pytest.raises(TimeoutError):
            b.recv_frame(timeout_s=0.05)
        a.sock.send_multipart([b"garbage"])
        with pytest.raises(ValueError, match="malformed"):
            b.recv_frame(timeout_s=1)
    finally:
        a.close()
        b.close()
