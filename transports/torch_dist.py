"""torch.distributed transport: a link is a process group of two, formed at `ctx.address` (a
TCPStore there; the binding end hosts it and is rank 0 of the pair), so stages and the engine
core link up whatever default group a process has, and on any host.

Host metadata (token frames, each tensor's header) travels on a gloo group. Tensors travel on
the device over the platform's backend where the device has one (nccl on CUDA, hccl on Ascend):
the process group runs its p2p on its own side stream, which waits on an event of the current
stream before a send, and a receive's `wait()` makes the current stream wait on the side
stream's event, so neither end's host waits for its device. On the CPU, tensors ride gloo too; a
device end whose backend is gloo (two stages on one GPU, which nccl refuses) stages tensors
through the host and waits for the device on each send: cuda_ipc serves that case.

A frame travels as one int64 tensor whose size follows from (max_rows, max_k), which both ends
know, so a receiver posts its buffer before the frame exists. A receive waits at most its
timeout (a helper thread does the backend's wait: gloo closes a pair whose wait timed out), and
stays posted, so the next call picks up where it left; a peer that is gone makes the backend fail
the receive, which surfaces as ConnectionError (or TimeoutError when the backend only notices by
waiting).
"""

from __future__ import annotations

import datetime
import urllib.parse
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist

from speckernel.transport import TokenFrame, TransportCapabilities, TransportContext, check_received

FRAME_TAG, HEADER_TAG, TENSOR_TAG = 1, 2, 3
MAX_DIMS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8,
          torch.bool, torch.float64)
"""Dtypes a tensor header can name (by index)."""
HEADER = 3 + MAX_DIMS
"""A tensor's header: step id, dtype index, ndim, the dims."""
MAX_SENDS = 2 * 16
"""Sends kept in flight (a tensor is two: header and payload): past this, a send waits on the
host for the oldest, which holds while the peer lags MIN_IN_FLIGHT tensors or fewer."""
GROUP_TIMEOUT = datetime.timedelta(days=365)
"""The gloo group's own timeout: receives wait on helper threads, the caller bounds its own wait."""


def pack(frame: TokenFrame) -> np.ndarray:
    return np.concatenate([
        np.array([frame.step_id, int(frame.k0)], np.int64), frame.req_ids, frame.generations, frame.slots,
        frame.kinds.astype(np.int64), frame.accepted.astype(np.int64), frame.lengths.astype(np.int64),
        frame.tokens.reshape(-1), frame.drafts.reshape(-1)])


def unpack(flat: np.ndarray, max_rows: int, max_k: int) -> TokenFrame:
    r = max_rows
    cols = [flat[2 + i * r : 2 + (i + 1) * r] for i in range(6)]
    tokens_at = 2 + 6 * r
    drafts_at = tokens_at + r * (1 + max_k)
    return TokenFrame(
        step_id=int(flat[0]), req_ids=cols[0].copy(), generations=cols[1].copy(), slots=cols[2].copy(),
        kinds=cols[3].astype(np.int8), accepted=cols[4].astype(np.int32), lengths=cols[5].astype(np.int32),
        tokens=flat[tokens_at:drafts_at].reshape(r, 1 + max_k).copy(),
        drafts=flat[drafts_at:].reshape(r, max_k).copy(), k0=bool(flat[1]))


def host_port(address: str) -> tuple[str, int]:
    """("10.1.2.3", 29600) of "tcp://10.1.2.3:29600"."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"tcp://{address}")
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"torch_dist needs an address with host and port, got {address!r}")
    return parsed.hostname, parsed.port


def device_group(backend: str, store: Any, rank: int, timeout: datetime.timedelta) -> Any:
    """A two-rank group of the platform's device backend: nccl through torch, another one (hccl)
    through the creator its package registered with torch.distributed."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    plugin = dist.Backend._plugins.get(backend.upper())
    if plugin is None:
        raise ValueError(f"torch.distributed has no backend {backend!r} here (is its package imported?)")
    return plugin.creator_fn(store, rank, 2, timeout)


class TorchDistTransport:
    name = "torch_dist"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=False, device_direct=True)

    def __init__(self, group: Any, peer: int, max_rows: int, max_k: int, device: torch.device | str = "cpu",
                 data_group: Any = None, address: str = "", store: Any = None) -> None:
        """`group`: a gloo torch.distributed ProcessGroup for host metadata; `peer`: the other end's
        rank in it; `data_group`: the device backend's group for tensors (None: tensors ride
        `group`). `open` builds all of it from a context."""
        self.group, self.peer = group, peer
        self.data_group = data_group
        self.max_rows, self.max_k = max_rows, max_k
        self.device = torch.device(device)
        self.address, self.store = address, store
        self.size = 2 + 6 * max_rows + max_rows * (1 + 2 * max_k)
        self.posted: dict[int, tuple[Future[Any], torch.Tensor]] = {}
        self.waiter = ThreadPoolExecutor(3, thread_name_prefix="torch-dist-recv")
        """Waits on posted receives, one thread per tag: the caller waits on the future with its
        timeout, since a gloo wait that times out closes the pair for good."""
        self.sends: deque[tuple[Any, torch.Tensor]] = deque()
        """Sends in flight, with their tensors (the backend reads them until done)."""
        self.header: list[int] | None = None
        """A tensor's header received, its payload not yet (a receive timed out between them)."""
        self.closed = False

    @classmethod
    def open(cls, ctx: TransportContext) -> Self:
        """Forms the pair's groups at ctx.address; waits up to ctx.timeout_s for the peer."""
        host, port = host_port(ctx.address)
        timeout = datetime.timedelta(seconds=ctx.timeout_s if ctx.timeout_s is not None else 24 * 3600)
        me = 0 if ctx.bind else 1
        try:
            store = dist.TCPStore(host, port, 2, ctx.bind, timeout, wait_for_workers=False)
            group = dist.ProcessGroupGloo(dist.PrefixStore("meta", store), me, 2, GROUP_TIMEOUT)
        except (RuntimeError, dist.DistStoreError) as e:
            raise TimeoutError(f"torch_dist link at {ctx.address}: the peer did not join ({e})") from e
        device = torch.device(ctx.device)
        data_group = None
        if device.type != "cpu" and ctx.dist_backend != "gloo":
            data_group = device_group(ctx.dist_backend, dist.PrefixStore("data", store), me, timeout)
            probe = torch.ones(1, device=device)  # forms the p2p communicator now: later sends never wait for it
            for sender in (0, 1):
                (data_group.send if me == sender else data_group.recv)([probe], 1 - me, 0).wait()
        return cls(group, 1 - me, ctx.max_rows, ctx.max_k, device, data_group, ctx.address, store)

    def _send(self, tensor: torch.Tensor, tag: int, group: Any = None) -> None:
        if self.closed:
            raise ConnectionError("torch_dist transport is closed")
        try:
            self.sends.append(((group or self.group).send([tensor], self.peer, tag), tensor))
            while self.sends and self.sends[0][0].is_completed():
                self.sends.popleft()
            while len(self.sends) > MAX_SENDS:  # gloo reports a send done only once waited on
                self.sends.popleft()[0].wait()
        except RuntimeError as e:  # the pair is closed: the peer is gone
            raise ConnectionError(f"torch_dist peer at {self.address}: {e}") from e

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int, timeout_s: float | None) -> torch.Tensor:
        if self.closed:
            raise ConnectionError("torch_dist transport is closed")
        if tag not in self.posted:
            buf = torch.empty(shape, dtype=dtype)
            try:
                work = self.group.recv([buf], self.peer, tag)
            except RuntimeError as e:  # the pair is already closed: the peer is gone
                raise ConnectionError(f"torch_dist peer at {self.address}: {e}") from e
            self.posted[tag] = (self.waiter.submit(work.wait), buf)
        done, buf = self.posted[tag]
        try:
            done.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no message from the peer at {self.address} within {timeout_s} s") from None
        except RuntimeError as e:
            self.posted.pop(tag, None)
            raise ConnectionError(f"torch_dist peer at {self.address}: {e}") from e
        self.posted.pop(tag)
        return buf

    def send_frame(self, frame: TokenFrame) -> None:
        if frame.tokens.shape != (self.max_rows, 1 + self.max_k):
            raise ValueError(f"frame of shape {frame.tokens.shape}; this transport carries "
                             f"({self.max_rows}, {1 + self.max_k})")
        self._send(torch.from_numpy(pack(frame)), FRAME_TAG)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        buf = self._recv((self.size,), torch.int64, FRAME_TAG, timeout_s)
        return unpack(buf.numpy(), self.max_rows, self.max_k)

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(f"torch_dist carries tensors of at most {MAX_DIMS} dims of {DTYPES}, "
                             f"not {tuple(tensor.shape)} {tensor.dtype}")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1], header[2] = step_id, DTYPES.index(tensor.dtype), tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self._send(header, HEADER_TAG)
        if self.data_group is not None:  # a copy on the current stream, which the group's stream waits for
            self._send(tensor.detach().clone(memory_format=torch.contiguous_format), 0, self.data_group)
        else:
            self._send(tensor.detach().to("cpu", copy=True).contiguous(), TENSOR_TAG)

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        if self.header is None:
            self.header = self._recv((HEADER,), torch.int64, HEADER_TAG, timeout_s).tolist()
        sent_step, code, ndim = self.header[:3]
        sent_shape, sent_dtype = tuple(self.header[3 : 3 + ndim]), DTYPES[code]
        if self.data_group is not None:
            out = torch.empty(sent_shape, dtype=sent_dtype, device=self.device)
            self.data_group.recv([out], self.peer, 0).wait()  # the current stream waits, the host does not
        else:
            got = self._recv(sent_shape, sent_dtype, TENSOR_TAG, timeout_s)
            out = got.to(self.device, non_blocking=True)
        self.header = None
        check_received(f"torch_dist {self.address}", (step_id, shape, dtype), (sent_step, sent_shape, sent_dtype))
        return out

    def close(self) -> None:
        """Aborts the groups, so the peer's pending receives fail rather than wait."""
        if self.closed:
            return
        self.closed = True
        self.waiter.shutdown(wait=False, cancel_futures=True)
        for group in (self.group, self.data_group):
            if group is not None and hasattr(group, "abort"):
                try:
                    group.abort()
                except RuntimeError:  # already broken by the peer: nothing left to release
                    pass
