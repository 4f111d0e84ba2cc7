"""cuda_ipc's ring on the CPU (shared host memory): credits bound it, a receiver that keeps up
keeps it small, and a slot is reused only once its credit came back."""

from __future__ import annotations

import pytest
import torch

from speckernel.transport import TransportContext
from speckernel.transports.cuda_ipc import MAX_RING, RING, CudaIpcTransport


def pair(timeout_s: float = 5.0) -> tuple[CudaIpcTransport, CudaIpcTransport]:
    def ctx(bind: bool, address: str) -> TransportContext:
        return TransportContext(rank=int(bind), peer=int(not bind), world=2, max_rows=2, max_k=1, address=address,
                                bind=bind, timeout_s=timeout_s)

    rx = CudaIpcTransport.open(ctx(True, "tcp://127.0.0.1:*"))
    return CudaIpcTransport.open(ctx(False, rx.address)), rx


def test_a_receiver_that_keeps_up_keeps_the_ring_at_its_first_size() -> None:
    tx, rx = pair()
    try:
        for step in range(3 * RING):
            tx.send_tensor(step, torch.full((8,), float(step)))
            assert rx.recv_tensor(step, (8,), torch.float32, timeout_s=5.0).tolist() == [float(step)] * 8
        assert len(tx.slots) == RING
    finally:
        tx.close()
        rx.close()


def test_a_lagging_receiver_grows_the_ring_then_the_sender_waits_for_a_credit() -> None:
    tx, rx = pair(timeout_s=0.3)
    try:
        for step in range(MAX_RING):  # none received: every send takes a fresh slot
            tx.send_tensor(step, torch.full((8,), float(step)))
        assert len(tx.slots) == MAX_RING
        with pytest.raises(TimeoutError, match="credit"):
            tx.send_tensor(MAX_RING, torch.zeros(8))
        assert rx.recv_tensor(0, (8,), torch.float32, timeout_s=5.0).tolist() == [0.0] * 8  # frees slot 0
        tx.send_tensor(MAX_RING, torch.full((8,), -1.0))
        for step in range(1, MAX_RING):  # slot 0 was reused only after its credit: nothing was overwritten
            assert rx.recv_tensor(step, (8,), torch.float32, timeout_s=5.0).tolist() == [float(step)] * 8
        assert rx.recv_tensor(MAX_RING, (8,), torch.float32, timeout_s=5.0).tolist() == [-1.0] * 8
    finally:
        tx.close()
        rx.close()


def test_a_slot_grows_for_a_larger_tensor() -> None:
    tx, rx = pair()
    try:
        small, large = torch.arange(4.0), torch.arange((1 << 20) // 4 + 3, dtype=torch.float32)
        for step, tensor in enumerate([small] * RING + [large, small]):
            tx.send_tensor(step, tensor)
            assert torch.equal(rx.recv_tensor(step, tuple(tensor.shape), tensor.dtype, timeout_s=5.0), tensor)
    finally:
        tx.close()
        rx.close()
