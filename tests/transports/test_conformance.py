"""Every built-in transport passes the conformance suite a vendor runs against their own."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from speckernel import registry
from speckernel.testing import check_transport, sample_frame
from speckernel.transport import Transport
from speckernel.transports.inproc import InprocTransport
from speckernel.transports.torch_dist import TorchDistTransport
from speckernel.transports.zmq import ZmqTransport


def inproc_pair(max_rows: int, max_k: int) -> tuple[Transport, Transport, Callable[[], None]]:
    a, b = InprocTransport.pair()
    return a, b, a.close


def zmq_pair(max_rows: int, max_k: int) -> tuple[Transport, Transport, Callable[[], None]]:
    rx = ZmqTransport("tcp://127.0.0.1:*", bind=True)
    tx = ZmqTransport(rx.address, bind=False, send_timeout_s=5.0)
    return tx, rx, tx.close


def gloo_groups(world: int = 2) -> list[Any]:
    """A gloo process group of `world` ranks inside this process, one rank per thread."""
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    groups: list[Any] = [None] * world

    def join(rank: int) -> None:
        s = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("conformance", s), rank, world,
                                             datetime.timedelta(seconds=20))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    groups.append(store)  # the store outlives the test's use of the groups
    return groups


def torch_dist_pair(max_rows: int, max_k: int) -> tuple[Transport, Transport, Callable[[], None]]:
    g0, g1, _store = gloo_groups()
    tx = TorchDistTransport(g0, 1, max_rows, max_k)
    rx = TorchDistTransport(g1, 0, max_rows, max_k)
    return tx, rx, g0.abort


@pytest.mark.parametrize("make_pair", [inproc_pair, zmq_pair, torch_dist_pair], ids=["inproc", "zmq", "torch_dist"])
def test_transport_conformance(make_pair: Any) -> None:
    check_transport(make_pair)


def test_torch_dist_is_registered() -> None:
    assert registry.load("transport", "torch_dist") is TorchDistTransport


class ShiftedTransport(InprocTransport):
    """A transport that loses the step identity: what the suite must catch."""

    def recv_frame(self, timeout_s: float | None = None) -> Any:
        import msgspec  # only this broken double needs it

        frame = super().recv_frame(timeout_s)
        return msgspec.structs.replace(frame, step_id=frame.step_id + 1)


def test_suite_catches_a_transport_that_loses_step_identity() -> None:
    def pair(max_rows: int, max_k: int) -> tuple[Transport, Transport, Callable[[], None]]:
        import queue  # only this broken double needs it

        a: queue.Queue[object] = queue.Queue()
        b: queue.Queue[object] = queue.Queue()
        return ShiftedTransport(a, b), ShiftedTransport(b, a), lambda: None

    with pytest.raises(AssertionError, match="arrived as step"):
        check_transport(pair)
    assert sample_frame(1, 3, 2).tokens.shape == (3, 3)
