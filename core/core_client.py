"""How the frontend reaches the engine core: its own process over ZeroMQ, or in-process.

Both give the same three operations (send a message, receive the next one, close), so
AsyncEngine has one code path whatever the mode.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq
from anyio.abc import TaskGroup

from . import errors as errors_mod
from .codec import Decoder, Encoder
from .config import EngineConfig
from .messages import CoreFailed, CoreMessage, CoreReady, FrontendMessage, Shutdown

POLL_S = 0.1


def raise_core_failure(msg: CoreFailed) -> None:
    raise errors_mod.rebuild(msg.error_type, msg.message) or errors_mod.EngineDeadError(
        f"engine core failed to start: {msg.error_type}: {msg.message}")


class CoreClient(ABC):
    @abstractmethod
    async def start(self, tg: TaskGroup) -> CoreReady: ...

    @abstractmethod
    def send(self, msg: FrontendMessage) -> None: ...

    @abstractmethod
    async def recv(self) -> CoreMessage | None:
        """The next message, or None once the core is gone."""

    @abstractmethod
    async def close(self) -> None:
        """Stops the core; the receiving side stays usable until release()."""

    def release(self) -> None:  # noqa: B027 - optional hook, in-process clients hold no sockets
        """Frees sockets once nothing receives any more."""

    def death_reason(self) -> str:
        return "engine core stopped"


class InprocClient(CoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core: Any = None
        self.tx, self.rx = anyio.create_memory_object_stream[CoreMessage | None](math.inf)

    async def start(self, tg: TaskGroup) -> CoreReady:
        from .engine_core import EngineCore

        self.core = await anyio.to_thread.run_sync(EngineCore, self.config)

        async def run() -> None:
            try:
                await self.core.run(self.tx.send)
            except Exception as e:
                await self.tx.send(CoreFailed(type(e).__name__, str(e)))
            finally:
                await self.tx.send(None)

        tg.start_soon(run)
        return self.core.ready_message()

    def send(self, msg: FrontendMessage) -> None:
        self.core.deliver(msg)

    async def recv(self) -> CoreMessage | None:
        try:
            return await self.rx.receive()
        except anyio.EndOfStream:
            return None

    async def close(self) -> None:
        if self.core is not None:
            self.core.deliver(Shutdown())


class ProcessClient(CoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.encoder = Encoder()
        self.decoder = Decoder(CoreMessage)
        self.ctx = zmq.Context()
        self.ipc_dir = tempfile.mkdtemp(prefix="speckernel-")
        in_addr, out_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.tx = self.ctx.socket(zmq.PUSH)
        self.tx.setsockopt(zmq.SNDHWM, 0)
        self.tx.setsockopt(zmq.LINGER, 0)
        self.tx.bind(in_addr)
        self.rx = self.ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.bind(out_addr)
        # A fresh interpreter (not multiprocessing) so the caller's __main__ is never re-imported.
        self.argv = [sys.executable, "-m", "speckernel.core_process", in_addr, out_addr,
                     str(os.getpid()), msgspec.json.encode(config).decode()]
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, tg: TaskGroup) -> CoreReady:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
        atexit.register(self._kill)
        with anyio.move_on_after(self.config.startup_timeout_s):
            first = await self.recv()
            if isinstance(first, CoreReady):
                return first
            if isinstance(first, CoreFailed):
                raise_core_failure(first)
            raise errors_mod.EngineDeadError(f"engine core exited during start-up ({self.death_reason()})")
        raise errors_mod.EngineDeadError(
            f"engine core did not start within {self.config.startup_timeout_s} s")

    def send(self, msg: FrontendMessage) -> None:
        self.tx.send_multipart(self.encoder.encode(msg), copy=False)

    def _poll(self) -> list[zmq.Frame] | None:
        if self.rx.poll(int(POLL_S * 1000)):
            return self.rx.recv_multipart(copy=False)
        return None

    async def recv(self) -> CoreMessage | None:
        while True:
            frames = await anyio.to_thread.run_sync(self._poll)
            if frames is not None:
                return self.decoder.decode(frames)
            if self.proc is None or self.proc.poll() is not None:
                return None

    def death_reason(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return f"engine core process exited with code {code}"

    def _wait(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:  # never block: a core on its way out may have no socket left to receive this
                self.tx.send_multipart(self.encoder.encode(Shutdown()), flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                pass
            if not await anyio.to_thread.run_sync(self._wait, 10.0):
                self.proc.terminate()
                if not await anyio.to_thread.run_sync(self._wait, 5.0):
                    self._kill()
        atexit.unregister(self._kill)

    def release(self) -> None:
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
