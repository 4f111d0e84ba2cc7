"""Transports between two processes, the sender's killed for real: on the CPU (cuda_ipc's ring in
shared host memory, torch_dist on gloo), and natively on a GPU (cuda_ipc with both ends on one
GPU, as pipeline stages sharing it are; torch_dist over nccl where two GPUs exist)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import pytest
import torch

from speckernel.testing import check_transport, sample_frame
from speckernel.transport import Transport, TransportContext
from tests.transports.remote import RemoteEnd, remote_pair
from tests.transports.test_conformance import free_port

Pair = tuple[Transport, Transport, Callable[[], None]]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def two_processes(name: str, rx_device: str = "cpu", tx_device: str = "cpu", backend: str = "gloo",
                  ) -> Callable[[int, int], Pair]:
    bind_first = name != "torch_dist"  # a zmq channel binds at once; a torch_dist pair forms with both ends

    def make_pair(max_rows: int, max_k: int) -> Pair:
        address = "tcp://127.0.0.1:*" if bind_first else f"tcp://127.0.0.1:{free_port()}"

        def ctx(rank: int, device: str, where: str) -> TransportContext:
            return TransportContext(rank=rank, peer=1 - rank, world=2, device=device, dist_backend=backend,
                                    max_rows=max_rows, max_k=max_k, address=where, bind=rank == 1, timeout_s=60.0)

        rx, tx = remote_pair(name, ctx(1, rx_device, address), lambda where: ctx(0, tx_device, where), bind_first)
        return cast(Transport, tx), rx, tx.kill

    return make_pair


@pytest.mark.parametrize("name", ["cuda_ipc", "torch_dist"])
def test_transport_between_processes_on_the_cpu(name: str) -> None:
    check_transport(two_processes(name))


cuda = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")


@cuda
def test_cuda_ipc_on_one_gpu_shared_by_two_processes() -> None:
    check_transport(two_processes("cuda_ipc", "cuda:0", "cuda:0"))


@pytest.mark.skipif(GPUS < 2, reason="nccl refuses two ranks on one GPU: needs two GPUs")
def test_torch_dist_over_nccl() -> None:
    check_transport(two_processes("torch_dist", "cuda:0", "cuda:1", backend="nccl"))


@cuda
def test_cuda_ipc_steady_state_never_waits_for_the_device() -> None:
    """Past the first use of each slot (which maps memory), neither end syncs with its device:
    both run under torch.cuda.set_sync_debug_mode("error"), and a slow producer (a long matmul
    chain issued before each send) still reaches the receiver intact."""
    end, rx, _ = two_processes("cuda_ipc", "cuda:0", "cuda:0")(2, 1)
    tx = cast(RemoteEnd, end)
    try:
        shape = (64, 1024)
        for step in range(20):  # every slot mapped and every event opened
            tx.send_tensor(step, torch.full(shape, float(step)))
            assert bool((rx.recv_tensor(step, shape, torch.float32, timeout_s=30.0) == step).all())
        tx.strict()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = []
            for step in range(20, 40):
                tx.send_tensor(step, torch.full(shape, float(step)))
                out = rx.recv_tensor(step, shape, torch.float32, timeout_s=30.0)
                got.append(out.sum())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sums = torch.stack(got).cpu()
        assert sums.tolist() == [float(s * shape[0] * shape[1]) for s in range(20, 40)]
    finally:
        tx.close()
        rx.close()


def test_cuda_ipc_notices_a_killed_peer_at_once() -> None:
    """A receive fails as soon as the sender's process is gone, not when its timeout ends; what
    reached the receiver before the sender died still arrives first. (A frame sent after the
    tensor and received before the kill proves the tensor's note reached this end: a message
    still in the dead sender's queue is lost with it.)"""
    tx, rx, kill = two_processes("cuda_ipc")(2, 1)
    try:
        tx.send_tensor(0, torch.ones(3))
        tx.send_frame(sample_frame(1, 2, 1))
        assert rx.recv_frame(timeout_s=30.0).step_id == 1
        kill()
        assert rx.recv_tensor(0, (3,), torch.float32, timeout_s=30.0).tolist() == [1.0] * 3
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="died"):
            rx.recv_frame(timeout_s=30.0)
        assert time.monotonic() - started < 5.0
    finally:
        rx.close()
