"""Entry point of the engine-core process: ZeroMQ in, anyio loop, ZeroMQ out.

Its lifetime is the frontend's: it ignores SIGINT (a Ctrl-C reaches the whole process group; the
frontend decides what it means), reads everything it needs from stdin (so `ps` shows neither
config nor keys), and exits when the frontend says Shutdown, when the frontend's process is gone
(its parent pid changes), on SIGTERM (exit code 143, after telling the frontend why) or on a
fatal error (exit code 1, after reporting it). From the moment its sockets connect it sends a
Heartbeat every HEARTBEAT_S (a thread while the model loads, then its loop), so a frontend can
tell a hung core from a busy one, during start-up too.

Every incoming frame is decoded and checked on a socket thread, totally: a frame that fails is
logged with its traceback and dropped, and a request or utility call whose id can still be read
fails with an error instead of waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec
import zmq

from .. import log
from ..errors import InvalidInputError
from ..wire.codec import Decoder, Encoder
from ..wire.limits import engine_frame_limit
from ..wire.messages import (
    CoreBootstrap,
    CoreFailed,
    CoreMessage,
    FrontendMessage,
    Heartbeat,
    Malformed,
    Shutdown,
    check_wire,
)

if TYPE_CHECKING:
    from .core import EngineCore

POLL_MS = 100
HEARTBEAT_S = 0.5
PROBE_BYTES = 64
LINGER_MS = 1000
"""How long a last message (CoreFailed) may take to reach a frontend that is still there."""
EXIT_CRASHED = 1
EXIT_TERMINATED = 128 + signal.SIGTERM

T = TypeVar("T")


class _FrontendGone(Exception):
    pass


def _first(buf: memoryview, type_: type[T]) -> tuple[T, int]:
    """The complete msgpack object of `type_` that starts `buf`, and its length in bytes."""
    for n in range(1, len(buf) + 1):
        try:
            return msgspec.msgpack.decode(buf[:n], type=type_), n
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    raise ValueError("no such object")


def _probe(frames: list[zmq.Frame]) -> tuple[str, int | None]:
    """The kind and key / call id of a frame that failed to decode: every frontend message is an
    array [tag, id, ...]. Only the first PROBE_BYTES are read, so a frame's depth never matters
    (skipping a deeply nested element would recurse as deep as decoding it)."""
    try:
        view = memoryview(frames[0].buffer).cast("B")[:PROBE_BYTES]
        head = 1 if 0x90 <= view[0] <= 0x9F else {0xDC: 3, 0xDD: 5}[view[0]]
        kind, n = _first(view[head:], str)
        ident, _ = _first(view[head + n:], int)
        return kind, ident
    except Exception:
        return "", None


def _curve_client(sock: zmq.Socket, boot: CoreBootstrap) -> None:
    sock.curve_serverkey = boot.server_key
    sock.curve_publickey = boot.public_key
    sock.curve_secretkey = boot.secret_key


class CoreProcess:
    """The engine core's process, in two halves. The socket side owns both sockets and the
    receive thread, which decodes and checks every frame off the loop and hands what it reads
    to the core. The loop side runs EngineCore.run next to the heartbeat and the SIGTERM
    handler, and reports a fatal error as CoreFailed. `run()` returns the exit code."""

    def __init__(self, boot: CoreBootstrap) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.configure(boot.config.log_level)
        self.boot = boot
        self.log = log.get("core_process")
        self.ctx = zmq.Context()
        self.inbound = self.ctx.socket(zmq.PULL)
        self.inbound.setsockopt(zmq.MAXMSGSIZE, engine_frame_limit(boot.config))  # a larger frame drops the link
        self.outbound = self.ctx.socket(zmq.PUSH)
        self.outbound.setsockopt(zmq.SNDHWM, 0)  # queue rather than block the loop behind a slow frontend
        for sock, addr in ((self.inbound, boot.in_addr), (self.outbound, boot.out_addr)):
            _curve_client(sock, boot)
            sock.connect(addr)
        self.encoder = Encoder()
        self.frontend_gone = threading.Event()
        self.stop = threading.Event()
        """Set once the loop is over: the receive thread leaves its poll."""
        self.terminated = threading.Event()
        """SIGTERM arrived: the loop ends as after Shutdown, and the exit code says why."""

    def run(self) -> int:
        """Serves until told to stop; the process's exit code."""
        started = threading.Event()
        beats = threading.Thread(target=self._beat_until, args=(started,), name="speckernel-core-start-beat",
                                 daemon=True)
        beats.start()
        try:
            # torch loads here, in the core process alone: the frontend imports this module too.
            from .core import EngineCore

            if self.boot.config.data_parallel_size > 1:  # the ranks share this host's CPUs
                import torch

                from .data_parallel import rank_threads

                torch.set_num_threads(rank_threads(self.boot.config.data_parallel_size))
            core = EngineCore(self.boot.config)
        except Exception as e:
            return self._finish(self._refused(e, beats, started))
        self._stop_beating(beats, started)
        try:
            self.send(core.ready_message())
            anyio.run(self._serve, core)
        except BaseException as e:  # whatever ended the loop: report it, exit non-zero
            return self._finish(self._crashed(e))
        if self.terminated.is_set():
            self._report(CoreFailed("EngineDeadError", "engine core received SIGTERM"))
            return self._finish(EXIT_TERMINATED)
        return self._finish(0)

    # --- the socket side ------------------------------------------------------------------

    def send(self, msg: CoreMessage) -> None:
        """Never blocks: a connected PUSH queues; Again means the frontend's socket is gone."""
        try:
            self.outbound.send_multipart(self.encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.frontend_gone.set()
            raise _FrontendGone from None

    def _beat_until(self, started: threading.Event) -> None:
        """Start-up beats, from a thread while the model loads (a core that hangs or is stopped
        there goes silent, and its frontend says so instead of waiting out the start-up timeout)."""
        while True:
            with contextlib.suppress(_FrontendGone):
                self.send(Heartbeat())
            if started.wait(HEARTBEAT_S):
                return

    def _stop_beating(self, beats: threading.Thread, started: threading.Event) -> None:
        """Ends the start-up beats before the main thread uses the socket (one thread at a time)."""
        started.set()
        beats.join()

    def _report(self, msg: CoreFailed) -> None:
        """A last message, for a frontend that may be gone already."""
        with contextlib.suppress(_FrontendGone):
            self.send(msg)

    def _receive(self, deliver: Callable[[FrontendMessage | Malformed], None],
                 token: anyio.lowlevel.EventLoopToken) -> None:
        """Socket thread: decodes and checks frames and hands messages to the loop; a Shutdown
        (sent, or made up when the frontend's process is gone) is the last."""
        decoder = Decoder(FrontendMessage)
        try:
            while not self.stop.is_set():
                msg: FrontendMessage | Malformed | None
                if self.inbound.poll(POLL_MS):
                    msg = self._decode(decoder, self.inbound.recv_multipart(copy=False))
                elif os.getppid() != self.boot.parent_pid:
                    self.log.warning("frontend_gone")
                    self.frontend_gone.set()
                    msg = Shutdown()
                else:
                    continue
                if msg is not None:
                    anyio.from_thread.run_sync(deliver, msg, token=token)
                if isinstance(msg, Shutdown):
                    return
        except RuntimeError:  # the loop ended while a message was on its way: nothing to deliver to
            return

    def _decode(self, decoder: Decoder, frames: list[zmq.Frame]) -> FrontendMessage | Malformed | None:
        """The message, or what can be told of a frame that fails (logged, then dropped)."""
        try:
            msg: FrontendMessage = decoder.decode(frames)
            check_wire(msg)
            return msg
        except Exception as e:
            kind, ident = _probe(frames)
            self.log.warning("malformed_frame_dropped", kind=kind, ident=ident, num_frames=len(frames),
                             exc_info=True)
            return Malformed(kind, ident, str(e)) if ident is not None else None

    def _finish(self, code: int) -> int:
        self.ctx.destroy(linger=0 if self.frontend_gone.is_set() else LINGER_MS)
        return code

    # --- the loop side --------------------------------------------------------------------

    async def _serve(self, core: EngineCore) -> None:
        receiver = threading.Thread(target=self._receive, args=(core.deliver, anyio.lowlevel.current_token()),
                                    name="speckernel-core-recv", daemon=True)
        receiver.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._on_sigterm, core)
                tg.start_soon(self._heartbeat)
                await core.run(self._emit)
                tg.cancel_scope.cancel()
        finally:
            self.stop.set()
            # The socket thread must be out of its poll before the context closes its socket.
            await anyio.to_thread.run_sync(receiver.join, 2 * POLL_MS / 1000)

    async def _emit(self, msg: CoreMessage) -> None:
        self.send(msg)

    async def _on_sigterm(self, core: EngineCore) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                self.log.info("sigterm")
                self.terminated.set()
                core.deliver(Shutdown())

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(HEARTBEAT_S)
            self.send(Heartbeat())

    # --- exit codes -----------------------------------------------------------------------

    def _refused(self, e: Exception, beats: threading.Thread, started: threading.Event) -> int:
        """The core did not start: bad input is the caller's mistake (exit 0, the frontend
        reports it); anything else is a crash (exit 1)."""
        self._stop_beating(beats, started)
        invalid = isinstance(e, InvalidInputError)
        if invalid:
            self.log.info("engine_core_start_refused", error=str(e))
        else:
            self.log.exception("engine_core_start_failed")
        self._report(CoreFailed(type(e).__name__, str(e), invalid))
        return 0 if invalid else EXIT_CRASHED

    def _crashed(self, e: BaseException) -> int:
        """The loop ended with e: 0 when the frontend is gone (nobody to tell), else CoreFailed
        naming the real exception (not the task group around it) and exit 1."""
        leaves = _leaves(e)
        if self.frontend_gone.is_set() or any(isinstance(x, _FrontendGone) for x in leaves):
            self.frontend_gone.set()
            return 0
        self.log.exception("engine_core_crashed")
        self._report(CoreFailed(type(leaves[0] if len(leaves) == 1 else e).__name__, _describe(e)))
        return EXIT_CRASHED


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def _describe(e: BaseException) -> str:
    """The causes inside a task group's exception group, not 'unhandled errors in a TaskGroup'."""
    leaves = _leaves(e)
    return str(leaves[0]) if len(leaves) == 1 else "; ".join(f"{type(x).__name__}: {x}" for x in leaves)


def main() -> None:
    """`python -m speckernel.engine.process`, with a CoreBootstrap (msgpack) on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    boot = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreBootstrap)
    code = CoreProcess(boot).run()
    # Sockets and threads are closed by now; skip the interpreter's teardown of torch, which takes
    # seconds (multiprocessing's children end the same way), so the core exits promptly.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
