"""Entry point of the engine-core process: ZeroMQ in, anyio loop, ZeroMQ out.

Its lifetime is the frontend's: it ignores SIGINT (a Ctrl-C reaches the whole process group; the
frontend decides what it means), reads everything it needs from stdin (so `ps` shows neither
config nor keys), and exits when the frontend says Shutdown, when the frontend's process is gone
(its parent pid changes), on SIGTERM (exit code 143, after telling the frontend why) or on a
fatal error (exit code 1, after reporting it). While it runs, its loop sends a Heartbeat every
HEARTBEAT_S, so a frontend can tell a hung core from a busy one.

Every incoming frame is decoded and checked on a socket thread, totally: a frame that fails is
logged with its traceback and dropped, and a request or utility call whose id can still be read
fails with an error instead of waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec
import zmq

from .. import log
from ..config import EngineConfig
from ..errors import InvalidInputError
from ..wire.codec import Decoder, Encoder
from ..wire.messages import (
    CoreFailed,
    CoreMessage,
    FrontendMessage,
    Heartbeat,
    Malformed,
    Shutdown,
    check_wire,
)

POLL_MS = 100
HEARTBEAT_S = 0.5
PROBE_BYTES = 64
LINGER_MS = 1000
"""How long a last message (CoreFailed) may take to reach a frontend that is still there."""
EXIT_CRASHED = 1
EXIT_TERMINATED = 128 + signal.SIGTERM


class CoreBootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """What the frontend writes to the core's stdin: config, socket addresses and CURVE keys.

    The core connects to both sockets as a CURVE client: it speaks only to the holder of
    `server_key`'s secret (the frontend), and the frontend admits only `public_key`."""

    config: EngineConfig
    in_addr: str
    out_addr: str
    parent_pid: int
    server_key: bytes
    public_key: bytes
    secret_key: bytes


class _FrontendGone(Exception):
    pass


def _first(buf: memoryview, type_: Any) -> tuple[Any, int]:
    """The complete msgpack object of `type_` that starts `buf`, and its length in bytes."""
    for n in range(1, len(buf) + 1):
        try:
            return msgspec.msgpack.decode(buf[:n], type=type_), n
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    raise ValueError("no such object")


def _probe(frames: list[Any]) -> tuple[str, int | None]:
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


def _curve_client(sock: zmq.Socket, boot: CoreBootstrap) -> None:  # type: ignore[type-arg]
    sock.curve_serverkey = boot.server_key
    sock.curve_publickey = boot.public_key
    sock.curve_secretkey = boot.secret_key


def run_core_process(boot: CoreBootstrap) -> int:
    """Serves until told to stop; returns the process's exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = boot.config
    log.configure(config.log_level)
    logger = log.get("core_process")
    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    _curve_client(inbound, boot)
    inbound.connect(boot.in_addr)
    outbound = ctx.socket(zmq.PUSH)
    outbound.setsockopt(zmq.SNDHWM, 0)  # queue rather than block the loop behind a slow frontend
    _curve_client(outbound, boot)
    outbound.connect(boot.out_addr)
    encoder = Encoder()
    frontend_gone = threading.Event()

    def send(msg: CoreMessage) -> None:
        """Never blocks: a connected PUSH queues; Again means the frontend's socket is gone."""
        try:
            outbound.send_multipart(encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            frontend_gone.set()
            raise _FrontendGone from None

    def finish(code: int) -> int:
        ctx.destroy(linger=0 if frontend_gone.is_set() else LINGER_MS)
        return code

    try:
        from .core import EngineCore

        core = EngineCore(config)
    except Exception as e:
        if isinstance(e, InvalidInputError):  # the caller's mistake: the frontend reports it
            logger.info("engine_core_start_refused", error=str(e))
        else:
            logger.exception("engine_core_start_failed")
        try:
            send(CoreFailed(type(e).__name__, str(e), isinstance(e, InvalidInputError)))
        except _FrontendGone:
            pass
        return finish(0 if isinstance(e, InvalidInputError) else EXIT_CRASHED)
    send(core.ready_message())
    stop = threading.Event()
    terminated = threading.Event()

    def decode(decoder: Decoder, frames: list[Any]) -> FrontendMessage | Malformed | None:
        try:
            msg: FrontendMessage = decoder.decode(frames)
            check_wire(msg)
            return msg
        except Exception as e:
            kind, ident = _probe(frames)
            logger.warning("malformed_frame_dropped", kind=kind, ident=ident, num_frames=len(frames),
                           exc_info=True)
            return Malformed(kind, ident, str(e)) if ident is not None else None

    def receive(token: Any) -> None:
        """Socket thread: decodes and checks frames, hands messages to the loop."""
        decoder = Decoder(FrontendMessage)
        try:
            while not stop.is_set():
                if not inbound.poll(POLL_MS):
                    if os.getppid() != boot.parent_pid:
                        logger.warning("frontend_gone")
                        frontend_gone.set()
                        anyio.from_thread.run_sync(core.deliver, Shutdown(), token=token)
                        return
                    continue
                msg = decode(decoder, inbound.recv_multipart(copy=False))
                if msg is not None:
                    anyio.from_thread.run_sync(core.deliver, msg, token=token)
                if isinstance(msg, Shutdown):
                    return
        except RuntimeError:  # the loop ended while a message was on its way: nothing to deliver to
            return

    async def on_sigterm() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                logger.info("sigterm")
                terminated.set()
                core.deliver(Shutdown())

    async def heartbeat() -> None:
        while True:
            await anyio.sleep(HEARTBEAT_S)
            send(Heartbeat())

    async def main() -> None:
        receiver = threading.Thread(target=receive, args=(anyio.lowlevel.current_token(),),
                                    name="speckernel-core-recv", daemon=True)
        receiver.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_sigterm)
                tg.start_soon(heartbeat)

                async def emit(msg: CoreMessage) -> None:
                    send(msg)

                await core.run(emit)
                tg.cancel_scope.cancel()
        finally:
            stop.set()
            # The socket thread must be out of its poll before the context closes its socket.
            await anyio.to_thread.run_sync(receiver.join, 2 * POLL_MS / 1000)

    try:
        anyio.run(main)
    except BaseException as e:  # whatever ended the loop: report it, exit non-zero
        if frontend_gone.is_set() or any(isinstance(x, _FrontendGone) for x in _leaves(e)):
            frontend_gone.set()
            return finish(0)
        logger.exception("engine_core_crashed")
        leaves = _leaves(e)
        try:
            send(CoreFailed(type(leaves[0] if len(leaves) == 1 else e).__name__, _describe(e)))
        except _FrontendGone:
            pass
        return finish(EXIT_CRASHED)
    if terminated.is_set():
        try:
            send(CoreFailed("EngineDeadError", "engine core received SIGTERM"))
        except _FrontendGone:
            pass
        return finish(EXIT_TERMINATED)
    return finish(0)


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
    code = run_core_process(boot)
    # Sockets and threads are closed by now; skip the interpreter's teardown of torch, which takes
    # seconds (multiprocessing's children end the same way), so the core exits promptly.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
