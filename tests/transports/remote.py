"""A transport's sending end in a process of its own, driven from the test's process: what
`check_transport` needs to test a link between processes (CUDA IPC refuses to map memory into
the process that owns it; nccl wants one process per GPU), and a peer that can really die.

The child opens its end from a context and runs the commands it is sent: frames as they are,
tensors moved to its device first and overwritten there right after the send (so the transport's
stream ordering is exercised on the device, not only on the host).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from speckernel import registry
from speckernel.transport import TokenFrame, Transport, TransportContext

SPAWN = mp.get_context("spawn")  # CUDA does not survive fork
REPLY_S = 60.0


def serve(name: str, ctx: TransportContext, conn: Connection) -> None:
    """The child: opens its end, then runs commands until close."""
    try:
        end = registry.load("transport", name).open(ctx)
        conn.send(("ok", end.address))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    pinned: deque[torch.Tensor] = deque(maxlen=64)  # sources of copies that may still run
    while True:
        command, *args = conn.recv()
        try:
            if command == "send_frame":
                end.send_frame(args[0])
            elif command == "send_tensor":
                step, tensor = args
                if torch.device(ctx.device).type == "cuda":  # from pinned memory: a pageable copy would sync
                    pinned.append(tensor.pin_memory())
                    on_device = pinned[-1].to(ctx.device, non_blocking=True)
                else:
                    on_device = tensor.to(ctx.device)
                end.send_tensor(step, on_device)
                on_device.zero_()  # the transport read it in stream order, or the receiver sees zeros
            elif command == "strict":  # every later command fails if it makes the host wait for the device
                torch.cuda.set_sync_debug_mode("error")
            elif command == "close":
                end.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", None))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class RemoteEnd:
    """The sending end, living in a child process."""

    name = "remote"

    def __init__(self, name: str, ctx: TransportContext) -> None:
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=serve, args=(name, ctx, child), daemon=True)
        self.process.start()
        self.address = ""

    def opened(self) -> None:
        self.address = self._reply()

    def _reply(self) -> Any:
        if not self.conn.poll(REPLY_S):
            raise TimeoutError(f"the remote end did not answer within {REPLY_S} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"the remote end failed:\n{value}")
        return value

    def _call(self, *command: Any) -> None:
        self.conn.send(command)
        self._reply()

    def send_frame(self, frame: TokenFrame) -> None:
        self._call("send_frame", frame)

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        self._call("send_tensor", step_id, tensor.cpu().clone())

    def strict(self) -> None:
        self._call("strict")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("close")
            except (EOFError, BrokenPipeError, TimeoutError):  # already gone
                pass
        self.process.join(10)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


def remote_pair(name: str, rx_ctx: TransportContext, tx_ctx: Callable[[str], TransportContext],
                bind_first: bool) -> tuple[Transport, RemoteEnd]:
    """(receiver here, sender in a child). `tx_ctx(address)` is the sender's context once the
    receiver's address is known; `bind_first`: the receiver's open returns before its peer comes
    (a zmq channel), else both open at once (torch_dist)."""
    cls = registry.load("transport", name)
    if bind_first:
        rx = cls.open(rx_ctx)
        tx = RemoteEnd(name, tx_ctx(rx.address))
        tx.opened()
        return rx, tx
    got: queue.Queue[Any] = queue.Queue()
    opener = threading.Thread(target=lambda: got.put(_try(lambda: cls.open(rx_ctx))))
    opener.start()
    tx = RemoteEnd(name, tx_ctx(rx_ctx.address))
    tx.opened()
    opener.join()
    rx = got.get()
    if isinstance(rx, Exception):
        tx.kill()
        raise rx
    return rx, tx


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # handed to the test's thread
        return e
