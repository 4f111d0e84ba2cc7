"""Every built-in transport passes the conformance suite a vendor runs against their own, built
the one way the engine builds it: `registry.load("transport", name).open(ctx)`."""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch.distributed as dist

from speckernel import registry
from speckernel.testing import check_transport, sample_frame
from speckernel.transport import Transport, TransportContext
from speckernel.transports.inproc import InprocTransport, SentTensor
from speckernel.transports.torch_dist import TorchDistTransport

Pair = tuple[Transport, Transport, Callable[[], None]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def context(max_rows: int, max_k: int, address: str, bind: bool, **more: Any) -> TransportContext:
    """The receiving end binds (rank 1), the sending end connects (rank 0)."""
    return TransportContext(rank=1 if bind else 0, peer=0 if bind else 1, world=2, max_rows=max_rows, max_k=max_k,
                            address=address, bind=bind, timeout_s=20.0, **more)


def open_both(name: str, rx_ctx: TransportContext, tx_ctx: TransportContext) -> tuple[Transport, Transport]:
    """Opens the two ends at once (a transport may wait in open for its peer)."""
    cls = registry.load("transport", name)
    got: queue.Queue[tuple[str, Any]] = queue.Queue()

    def open_end(which: str, ctx: TransportContext) -> None:
        try:
            got.put((which, cls.open(ctx)))
        except Exception as e:  # reported by the test thread below
            got.put((which, e))

    threads = [threading.Thread(target=open_end, args=("rx", rx_ctx)),
               threading.Thread(target=open_end, args=("tx", tx_ctx))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ends = dict(got.get() for _ in threads)
    for end in ends.values():
        if isinstance(end, Exception):
            raise end
    return ends["tx"], ends["rx"]


def pair_of(name: str, address: Callable[[], str], bind_first: bool = False) -> Callable[[int, int], Pair]:
    """`bind_first`: the binding end's open returns before its peer comes and names the port it
    took (a socket's listener); else both ends open at once."""

    def make_pair(max_rows: int, max_k: int) -> Pair:
        where = address()
        if bind_first:
            rx = registry.load("transport", name).open(context(max_rows, max_k, where, True))
            tx = registry.load("transport", name).open(context(max_rows, max_k, rx.address, False))
        else:
            tx, rx = open_both(name, context(max_rows, max_k, where, True), context(max_rows, max_k, where, False))
        return tx, rx, tx.close

    return make_pair


ADDRESSES: dict[str, Callable[[], str]] = {
    "inproc": lambda: f"inproc://{uuid.uuid4().hex}",
    "zmq": lambda: "tcp://127.0.0.1:*",
    "cuda_ipc": lambda: "tcp://127.0.0.1:*",
    "torch_dist": lambda: f"tcp://127.0.0.1:{free_port()}",
}


@pytest.mark.parametrize("name", sorted(ADDRESSES))
def test_transport_conformance(name: str) -> None:
    check_transport(pair_of(name, ADDRESSES[name], bind_first=name in ("zmq", "cuda_ipc")))


def gloo_pair_groups(address: str) -> list[Any]:
    """Two ends' (metadata, data) gloo groups of one link, formed in threads of this process."""
    host, port = address.removeprefix("tcp://").split(":")
    store = dist.TCPStore(host, int(port), 2, True, wait_for_workers=False)
    groups: list[Any] = [None, None]

    def join(rank: int) -> None:
        s = store if rank == 0 else dist.TCPStore(host, int(port), 2, False)
        groups[rank] = tuple(dist.ProcessGroupGloo(dist.PrefixStore(name, s), rank, 2, datetime.timedelta(seconds=20))
                             for name in ("meta", "data"))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [*groups, store]


def test_torch_dist_with_a_device_group_of_its_own() -> None:
    """The device path's logic (headers on the metadata group, payloads on a group of their own,
    as nccl carries them) on the CPU, with a second gloo group standing in for nccl."""

    def make_pair(max_rows: int, max_k: int) -> Pair:
        (meta0, data0), (meta1, data1), store = gloo_pair_groups(f"tcp://127.0.0.1:{free_port()}")
        rx = TorchDistTransport(meta0, 1, max_rows, max_k, data_group=data0, store=store)
        tx = TorchDistTransport(meta1, 0, max_rows, max_k, data_group=data1, store=store)
        return tx, rx, tx.close

    check_transport(make_pair)


def test_the_context_is_all_a_transport_is_built_from() -> None:
    """A context survives the wire (the engine hands it to a stage process as configuration)."""
    ctx = context(4, 2, "tcp://10.1.2.3:29600", True, device="cuda:1", dist_backend="nccl")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ctx), type=TransportContext) == ctx


def test_torch_dist_is_registered() -> None:
    assert registry.load("transport", "torch_dist") is TorchDistTransport


class ShiftedTransport(InprocTransport):
    """A transport that loses the step identity: what the suite must catch."""

    def recv_frame(self, timeout_s: float | None = None) -> Any:
        frame = super().recv_frame(timeout_s)
        return msgspec.structs.replace(frame, step_id=frame.step_id + 1)


class StaleTransport(InprocTransport):
    """A transport that hands out the sender's own tensor instead of what it held at the send."""

    def send_tensor(self, step_id: int, tensor: Any) -> None:
        self.outbox.put(SentTensor(step_id, tensor, None))


class BlindTransport(InprocTransport):
    """A transport that ignores the step a receiver asks for."""

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: Any, timeout_s: float | None = None) -> Any:
        sent = self._recv(True, timeout_s)
        assert isinstance(sent, SentTensor)
        return sent.tensor


def broken(cls: type[InprocTransport]) -> Callable[[int, int], Pair]:
    def make_pair(max_rows: int, max_k: int) -> Pair:
        a, b = cls.pair()
        return a, b, a.close

    return make_pair


@pytest.mark.parametrize(("cls", "message"), [(ShiftedTransport, "arrived as step"),
                                              (StaleTransport, "changed in transit"),
                                              (BlindTransport, "received as step 4")])
def test_suite_catches_a_broken_transport(cls: type[InprocTransport], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_transport(broken(cls))
    assert sample_frame(1, 3, 2).tokens.shape == (3, 3)
