"""The transport plugin contract: how per-step token frames and device tensors move between
processes and pipeline stages.

Every transport is built one way, `registry.load("transport", name).open(ctx)`, from a
`TransportContext`, so the engine never names one and a vendor's package plugs in unchanged.
A link carries two kinds of payload:
- host metadata, the per-step `TokenFrame` (`send_frame` / `recv_frame`): its layout is fixed
  `[max_rows, 1 + max_k]` plus lengths, so every collective's shape depends only on what all
  ranks already agree on, never on sampled data;
- device payloads, the residual stream between stages and the token ids stage 0 embeds
  (`send_tensor` / `recv_tensor`), stream-ordered: a send is enqueued after the work already
  issued on the current stream and the host never waits for the device; a receive may wait on
  the host until the peer has *issued* its send, and returns a tensor that work issued
  afterwards on the current stream may read.

torch is imported for annotations only: the kernel reads the token frame's row kinds from here
without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import msgspec
import numpy as np

from .errors import SpeckernelError

if TYPE_CHECKING:  # annotations only: the kernel imports this module without torch
    import torch

MAX_FRAME_BYTES = 2**30
"""Default bound on one message of a host channel: 1 GiB holds hidden states [T, H] of 32k
tokens of a 8192-wide float32 model; the engine passes the bound of its own links
(`speckernel.wire.limits`)."""


MIN_IN_FLIGHT = 12
"""Tensors a sender may have in flight before a send may wait for the receiver (pipeline stages
run a few steps ahead of each other)."""


class TransportContext(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a transport is built from: one end of one link between two parties (two
    stages, or a stage and the engine core). Both ends get the same context but for rank, peer,
    device and bind."""

    rank: int
    """This end: a stage's rank (0 .. world - 1), or -1 for the engine core."""
    peer: int
    """The other end, in the same convention."""
    world: int
    """Number of pipeline stages."""
    device: str = "cpu"
    """Where this end's tensors live ("cuda:0", "npu:1", "cpu"): `recv_tensor` returns tensors
    there and `send_tensor` takes them from there. The engine core's end is "cpu"."""
    dist_backend: str = "gloo"
    """The platform's torch.distributed backend (gloo, nccl, hccl), for transports built on it."""
    max_rows: int
    """Rows of a token frame (the engine's max_num_seqs)."""
    max_k: int
    """Draft tokens per row (a frame's tokens are [max_rows, 1 + max_k])."""
    address: str
    """Where this link meets, from configuration or the rendezvous ("tcp://10.1.2.3:29600"); a
    transport derives any further endpoints from it (the next ports). The binding end may name
    port 0 or "*" where its transport reports the port it took (`Transport.address`)."""
    bind: bool = False
    """This end listens at `address` (exactly one end of a link does)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Largest single message this end accepts: a larger one drops the link before it is read."""
    timeout_s: float | None = 10.0
    """How long opening the link (the peer joining) and a send that finds no room may wait; None
    waits for ever. Receives take their own timeout."""


class TransportCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    cross_process: bool
    """The two ends may live in different processes."""
    zero_copy: bool
    """Payloads are not serialised on the way (buffers move as they are)."""
    carries_hidden_states: bool = True
    """Tensors travel (`send_tensor` works), not only token frames."""
    device_direct: bool = False
    """Device tensors move device to device, never through host memory and never waiting on the
    host for the device (a transport without it stages them through the host)."""


class TransportError(SpeckernelError):
    """A link broke a promise of this contract (its message says which end and what)."""


class StepMismatchError(TransportError):
    """A tensor arrived for another step, or of another shape or dtype, than the receiver asked
    for: the two ends disagree on the schedule, a kernel or transport bug."""


EMPTY, PLACEHOLDER, SAMPLED, FAILED = 0, 1, 2, 3
"""Row kinds of a TokenFrame: no row here (padding past the step's rows); a scheduled row that
sampled nothing (an intermediate prefill chunk: zero tokens, by type, not by an empty length);
a row with its confirmed tokens; a row that failed on the device (its request fails)."""


class TokenFrame(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """One step's output, as the last pipeline stage publishes it. Every array's shape is fixed
    by (max_rows, max_k), which all ranks know; the metadata (step id, keys, generations, slots,
    kinds) follows from the step's StepFrame alone, so every rank computes it identically and a
    receiver checks it against its own before it uses the data."""

    step_id: int
    req_ids: np.ndarray
    """[max_rows] int64 row → request key (-1: empty row)."""
    generations: np.ndarray
    """[max_rows] int64."""
    tokens: np.ndarray
    """[max_rows, 1 + max_k] int64: the row's confirmed tokens (accepted drafts, then the bonus
    token), -1 padded."""
    accepted: np.ndarray
    """[max_rows] int32 accepted draft counts."""
    lengths: np.ndarray
    """[max_rows] int32 valid entries per row of `tokens`."""
    slots: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int64))
    """[max_rows] int64 token-buffer slot of each row (-1: empty row)."""
    kinds: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int8))
    """[max_rows] int8: EMPTY, PLACEHOLDER, SAMPLED or FAILED."""
    drafts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros((0, 0), np.int64))
    """[max_rows, max_k] int64 drafts proposed for the next step, -1 padded."""
    k0: bool = False
    """The speculator ran only its sync pass (or its drafts were dropped)."""

    @classmethod
    def empty(cls, step_id: int, max_rows: int, max_k: int) -> TokenFrame:
        return cls(
            step_id=step_id,
            req_ids=np.full(max_rows, -1, np.int64),
            generations=np.zeros(max_rows, np.int64),
            tokens=np.full((max_rows, 1 + max_k), -1, np.int64),
            accepted=np.zeros(max_rows, np.int32),
            lengths=np.zeros(max_rows, np.int32),
            slots=np.full(max_rows, -1, np.int64),
            kinds=np.zeros(max_rows, np.int8),
            drafts=np.full((max_rows, max_k), -1, np.int64),
        )

    def same_meta(self, other: TokenFrame) -> bool:
        """Step id, keys, generations, slots and kinds equal: the frame is for the same step."""
        return (self.step_id == other.step_id and np.array_equal(self.req_ids, other.req_ids)
                and np.array_equal(self.generations, other.generations)
                and np.array_equal(self.slots, other.slots)
                and np.array_equal(self.kinds == EMPTY, other.kinds == EMPTY))


Received = tuple[int, Sequence[int], object]
"""A tensor's (step id, shape, dtype), as asked for or as sent."""


def check_received(where: str, asked: Received, sent: Received) -> None:
    """A received tensor is the one asked for: (step id, shape, dtype) equal, else
    StepMismatchError naming `where`, what was asked and what came."""
    (step_id, shape, dtype), (sent_step, sent_shape, sent_dtype) = asked, sent
    if sent_step != step_id or tuple(sent_shape) != tuple(shape) or sent_dtype != dtype:
        raise StepMismatchError(f"{where}: expected step {step_id} {tuple(shape)} {dtype}, "
                                f"got step {sent_step} {tuple(sent_shape)} {sent_dtype}")


class HostTensor(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A tensor on a host channel (zmq, a vendor's socket transport): its bytes, with the torch
    dtype by name, since numpy has no bfloat16."""

    step_id: int
    dtype: str
    """A torch dtype's attribute name: "bfloat16", "int64"."""
    shape: tuple[int, ...]
    data: np.ndarray
    """The tensor's bytes, uint8, flat."""

    @classmethod
    def of(cls, step_id: int, tensor: torch.Tensor) -> HostTensor:
        """A copy of `tensor` on the host (from a device, this waits for it): the caller's stays its own."""
        import torch  # host transports only: the kernel reads this module without torch

        host = tensor.detach().to("cpu", copy=True).contiguous()
        data = host.reshape(-1).view(torch.uint8).numpy()
        return cls(step_id, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data)

    def tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype, device: str,
               where: str) -> torch.Tensor:
        """The tensor on `device`, after checking it is the one asked for (StepMismatchError names
        `where` otherwise)."""
        import torch  # host transports only: the kernel reads this module without torch

        check_received(where, (step_id, shape, str(dtype).removeprefix("torch.")),
                       (self.step_id, self.shape, self.dtype))
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)  # a writable copy of the bytes
        return flat.view(dtype).reshape(shape).to(device, non_blocking=True)


TransportMessage = TokenFrame | HostTensor
"""What a host channel carries (for transports that frame with `speckernel.wire.codec`)."""


@runtime_checkable
class Transport(Protocol):
    """One end of a link. Not thread-safe: one thread uses an end (the two directions of a link
    are two ends in two places)."""

    name: str
    capabilities: TransportCapabilities
    address: str
    """Where the link meets, as the peer must be told (a bound port resolved)."""

    @classmethod
    def open(cls, ctx: TransportContext) -> Self:
        """This end of the link `ctx` describes. May wait (up to ctx.timeout_s) for the peer to
        open its end; raises TimeoutError when it does not."""
        ...

    def send_frame(self, frame: TokenFrame) -> None:
        """Sends a token frame of shape (ctx.max_rows, 1 + ctx.max_k); frames arrive in order."""
        ...

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        """The next frame; TimeoutError after timeout_s, ConnectionError (or TimeoutError) when the
        peer is gone."""
        ...

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        """Enqueues `tensor` for the peer after the work already issued on the current stream, with
        no host sync; the transport reads it in that stream order, so work issued afterwards may
        overwrite it. Tensors arrive in order. With `MIN_IN_FLIGHT` or more tensors sent and not
        yet received, a transport may make the host wait (up to ctx.timeout_s) for the peer to
        receive one; below that it never does."""
        ...

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        """The next tensor, on ctx.device, which work issued afterwards on the current stream may
        read. The host may wait until the peer has issued its send, never for the device to
        finish. Raises StepMismatchError when the tensor was sent for another step (where the
        transport carries step ids) or has another shape or dtype; TimeoutError and
        ConnectionError as recv_frame."""
        ...

    def close(self) -> None:
        """Releases the link; the peer's receives then fail (ConnectionError or TimeoutError)."""
        ...
