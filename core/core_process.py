"""Entry point of the engine-core process: ZeroMQ in, anyio loop, ZeroMQ out.

It exits when the frontend says Shutdown, when its input socket stays silent past the
frontend's death (the parent pid changes), or on a fatal error, which it reports first.
"""

from __future__ import annotations

import os
import threading

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import zmq

from . import log
from .codec import Decoder, Encoder
from .config import EngineConfig
from .errors import InvalidInputError
from .messages import CoreFailed, CoreMessage, FrontendMessage, Shutdown

POLL_MS = 100


def run_core_process(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int) -> None:
    log.configure(config.log_level)
    logger = log.get("core_process")
    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    inbound.connect(in_addr)
    outbound = ctx.socket(zmq.PUSH)
    outbound.setsockopt(zmq.LINGER, 2000)
    outbound.connect(out_addr)
    encoder = Encoder()

    def send(msg: CoreMessage) -> None:
        outbound.send_multipart(encoder.encode(msg), copy=False)

    try:
        from .engine_core import EngineCore

        core = EngineCore(config)
    except Exception as e:
        if isinstance(e, InvalidInputError):  # the caller's mistake: the frontend reports it
            logger.info("engine_core_start_refused", error=str(e))
        else:
            logger.exception("engine_core_start_failed")
        send(CoreFailed(type(e).__name__, str(e), isinstance(e, InvalidInputError)))
        ctx.destroy(linger=2000)
        return
    send(core.ready_message())
    stop = threading.Event()

    def receive() -> None:
        """Socket thread: decode frames and hand messages to the loop; malformed ones are logged."""
        decoder = Decoder(FrontendMessage)
        while not stop.is_set():
            if not inbound.poll(POLL_MS):
                if os.getppid() != parent_pid:
                    logger.warning("frontend_gone")
                    anyio.from_thread.run_sync(core.deliver, Shutdown())
                    return
                continue
            frames = inbound.recv_multipart(copy=False)
            try:
                msg = decoder.decode(frames)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("malformed_frame_dropped", error=str(e))
                continue
            anyio.from_thread.run_sync(core.deliver, msg)
            if isinstance(msg, Shutdown):
                return

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.to_thread.run_sync(receive, abandon_on_cancel=True))

            async def emit(msg: CoreMessage) -> None:
                send(msg)

            await core.run(emit)
            stop.set()
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    except Exception as e:
        logger.exception("engine_core_crashed")
        send(CoreFailed(type(e).__name__, str(e)))
    finally:
        stop.set()
        ctx.destroy(linger=2000)


if __name__ == "__main__":
    import sys

    in_addr, out_addr, parent, config_json = sys.argv[1:5]
    run_core_process(msgspec.json.decode(config_json, type=EngineConfig), in_addr, out_addr, int(parent))
