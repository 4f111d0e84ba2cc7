"""How the frontend reaches the engine core: its own process over ZeroMQ, or in-process.

Both give the same three operations (send a message, receive the next one, close), so
AsyncEngine has one code path whatever the mode. None of them blocks the caller's event loop
for long: sends never wait on the core (a gone core raises EngineDeadError), a core that stops
sending heartbeats is killed and reported dead, and closing a core that does not exit is
bounded by a short grace, then SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import logging
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq
from anyio.abc import TaskGroup
from zmq.auth.thread import ThreadAuthenticator

from .. import errors as errors_mod
from .. import log
from ..config import EngineConfig
from ..wire.codec import Decoder, Encoder
from ..wire.limits import engine_frame_limit
from ..wire.messages import CoreBootstrap, CoreFailed, CoreMessage, CoreReady, FrontendMessage, Heartbeat, Shutdown

POLL_S = 0.1
HEARTBEAT_TIMEOUT_S = 3.0
"""Silence (while the frontend was listening) after which a core is hung: six missed beats."""
STARTUP_HEARTBEAT_TIMEOUT_S = 30.0
"""The same during start-up, where the core beats from a thread while the model loads: looser,
since loading may hold the GIL for a while (a shared library's load, a long C call)."""
SEND_WAIT_S = 0.1
"""The longest a send waits for a core whose socket is momentarily not there."""
REAP_S = 1.0
"""How long a SIGKILLed core may take to be reaped (milliseconds, in practice)."""
SHUTDOWN_GRACE_S = 3.0
"""How long a core told to shut down may take before it is killed."""
IPC_PREFIX = "speckernel-ipc-"
"""Socket folders are named IPC_PREFIX + owner pid + '-' + random, so stale ones can be told apart."""
SHORT_TMP = "/tmp"
"""The POSIX temp folder: the fallback when TMPDIR is too long for a socket name."""
MAX_IPC_PATH = 107
"""Unix socket paths hold 108 bytes with the terminating NUL."""
BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "from speckernel.engine.process import main; main()")
"""The core's whole command line: SIGINT is ignored before anything is imported, and config and
keys come on stdin, so `ps` shows neither."""


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
        """How the core ended, after 'engine core died: '."""
        return "it stopped"


class InprocClient(CoreClient):
    def __init__(self, config: EngineConfig, core: Callable[[EngineConfig], Any] | None = None) -> None:
        """core: what builds the engine core (default `EngineCore`; `bench frontend` passes one
        whose runner is a stand-in)."""
        self.config = config
        self.make_core = core
        self.core: Any = None
        self.tx, self.rx = anyio.create_memory_object_stream[CoreMessage | None](math.inf)

    async def start(self, tg: TaskGroup) -> CoreReady:
        if self.make_core is None:
            from ..engine.core import EngineCore  # torch, imported only when the core runs in this process

            self.make_core = EngineCore
        self.core = await anyio.to_thread.run_sync(self.make_core, self.config)

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _stale(path: Path) -> bool:
    """IPC_PREFIX + pid folders: the pid is gone. Older `speckernel-XXXXXXXX` folders (no pid):
    they hold nothing but sockets, and no socket accepts a connection."""
    name = path.name
    if name.startswith(IPC_PREFIX):
        pid = name.removeprefix(IPC_PREFIX).split("-", 1)[0]
        return pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))
    entries = list(path.iterdir())
    return (bool(entries) and all(e.name in ("in", "out") and stat.S_ISSOCK(e.lstat().st_mode) for e in entries)
            and not any(_listening(e) for e in entries))


def sweep_stale_ipc_dirs(base: str) -> list[Path]:
    """Removes this user's socket folders under `base` left by runs that were killed before they
    could clean up; returns what it removed."""
    removed = []
    for path in Path(base).glob("speckernel-*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.lstat().st_uid != os.getuid() or not _stale(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def make_ipc_dir() -> str:
    """A fresh 0700 folder for this engine's sockets, in TMPDIR or, where socket paths there would
    be too long, in SHORT_TMP; stale folders of killed runs are swept from both first."""
    prefix = f"{IPC_PREFIX}{os.getpid()}-"
    bases = list(dict.fromkeys([tempfile.gettempdir(), SHORT_TMP]))
    for base in bases:
        sweep_stale_ipc_dirs(base)
    for base in bases:
        if len(os.path.join(base, prefix + "x" * 8, "out")) <= MAX_IPC_PATH:
            return tempfile.mkdtemp(prefix=prefix, dir=base)
    raise errors_mod.EngineDeadError(f"no temp folder has a path short enough for a socket: {bases}")


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _OneKey:
    """ZAP credentials: only the core this client spawned (its CURVE public key) is admitted."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


class ProcessClient(CoreClient):
    """The core in its own process, over two ipc sockets the frontend binds.

    Peers are authenticated with ZeroMQ CURVE, not a secret in the first frame: a PUSH socket
    hands messages to whichever peer connects, so a stray PULL would steal requests before any
    frame could be checked. With CURVE a peer joins only after the handshake: the frontend's
    ZAP handler admits only the core's public key, and the core (a CURVE client) speaks only to
    the holder of the frontend's server key; the keys go to the core on its stdin."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.log = log.get("core_client")
        self.encoder = Encoder()
        self.decoder = Decoder(CoreMessage)
        self.ctx = zmq.Context()
        self.max_frame_bytes = engine_frame_limit(config)
        """Both ends refuse a larger frame (`wire.limits`); `send` fails one before it leaves."""
        self.ipc_dir = make_ipc_dir()
        in_addr, out_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.server_public, server_secret = zmq.curve_keypair()
        core_public, core_secret = zmq.curve_keypair()
        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(f"{log.ROOT}.zap"))
        self.auth.start()
        try:
            self.auth.configure_curve_callback("*", _OneKey(core_public))
            self.tx = self._bind(zmq.PUSH, in_addr, server_secret)
            self.tx.setsockopt(zmq.SNDHWM, 0)
            self.rx = self._bind(zmq.PULL, out_addr, server_secret)
        except BaseException:
            self.release()
            raise
        self.bootstrap = msgspec.msgpack.encode(CoreBootstrap(
            config=config, in_addr=in_addr, out_addr=out_addr, parent_pid=os.getpid(),
            server_key=self.server_public, public_key=core_public, secret_key=core_secret))
        # A fresh interpreter (not multiprocessing) so the caller's __main__ is never re-imported.
        self.argv = [sys.executable, "-c", BOOT]
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        self.silent_s = 0.0
        """Time spent listening without a message since the last one (not time the loop was busy)."""
        self.gave_up: str | None = None
        """Why this client declared a still-running core dead (hung, unreachable); it was killed."""

    def _bind(self, kind: int, addr: str, secret: bytes) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.curve_server = True
        sock.curve_secretkey = secret
        sock.bind(addr)
        return sock

    async def start(self, tg: TaskGroup) -> CoreReady:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE)
        atexit.register(self._kill)
        assert self.proc.stdin is not None
        try:  # far below a pipe's buffer: never blocks
            self.proc.stdin.write(self.bootstrap)
            self.proc.stdin.close()
        except BrokenPipeError:  # it died at once; recv() reports how
            pass
        with anyio.move_on_after(self.config.startup_timeout_s):
            first = await self.recv()
            if isinstance(first, CoreReady):
                self.ready = True
                self.silent_s = 0.0
                return first
            if isinstance(first, CoreFailed):
                raise_core_failure(first)
            raise errors_mod.EngineDeadError(f"engine core failed during start-up: {self.death_reason()}")
        self._give_up(f"pid {self.proc.pid} did not start within {self.config.startup_timeout_s} s "
                      "(startup_timeout_s)")
        raise errors_mod.EngineDeadError(f"engine core failed during start-up: {self.death_reason()}")

    def send(self, msg: FrontendMessage) -> None:
        """Never blocks for long: the bound PUSH queues without limit (SNDHWM 0) while the core is
        connected, so Again means its socket is gone; then EngineDeadError, after SEND_WAIT_S."""
        if self.gave_up is not None:
            raise errors_mod.EngineDeadError(f"engine core died: {self.death_reason()}")
        frames = self.encoder.encode(msg)
        largest = max(len(f) for f in frames)
        if largest > self.max_frame_bytes:  # the core would drop the link and the message unseen
            raise errors_mod.InvalidInputError(f"{type(msg).__name__}: a frame of {largest} bytes is over the "
                                               f"engine link's {self.max_frame_bytes}")
        for _ in range(2):
            try:
                self.tx.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not self.tx.poll(int(SEND_WAIT_S * 1000), zmq.POLLOUT):
                    break
        if self.proc is not None and self.proc.poll() is None:
            self._give_up("engine core unreachable (its socket is gone)")
        raise errors_mod.EngineDeadError(f"engine core died: {self.death_reason()}")

    def _give_up(self, reason: str) -> None:
        """Declares a still-running core dead and SIGKILLs it; it is reaped here (a killed process,
        even a stopped one, ends at once), so the message says how it ended, not that it runs."""
        if self.gave_up is None:
            self.gave_up = reason
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(REAP_S)
        self.log.warning("engine_core_given_up", reason=self.death_reason())

    def _poll(self) -> list[zmq.Frame] | None:
        """One poll of the socket. Only the poll's own wait counts as silence, capped at POLL_S:
        the clock read after it also counts how long this thread waited for the GIL (user code or
        a tokenizer holding it for seconds), and beats sent meanwhile are queued, not lost."""
        started = time.monotonic()
        if self.rx.poll(int(POLL_S * 1000)):
            self.silent_s = 0.0
            return self.rx.recv_multipart(copy=False)
        self.silent_s += min(time.monotonic() - started, POLL_S)
        return None

    async def recv(self) -> CoreMessage | None:
        while self.gave_up is None:
            frames = await anyio.to_thread.run_sync(self._poll)
            if frames is not None:
                try:
                    msg = self.decoder.decode(frames)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.log.warning("malformed_frame_dropped", exc_info=True)
                    continue
                if not isinstance(msg, Heartbeat):
                    return msg
                continue
            if self.proc is None or self.proc.poll() is not None:
                return None
            bound = HEARTBEAT_TIMEOUT_S if self.ready else STARTUP_HEARTBEAT_TIMEOUT_S
            if self.silent_s >= bound:
                during = "" if self.ready else " during start-up"
                self._give_up(f"pid {self.proc.pid} stopped answering{during} "
                              f"(no heartbeat for {self.silent_s:.1f} s)")
        return None

    def death_reason(self) -> str:
        """How the core's process ended, after 'engine core died: ': its pid and exit code or
        signal, and why this client killed it if it did."""
        if self.proc is None:
            return "it never started"
        code = self.proc.poll()
        if self.gave_up is not None:
            how = ("sent it SIGKILL" if code is None else "killed it with SIGKILL" if code == -signal.SIGKILL
                   else _ended(code))
            return f"{self.gave_up}; {how}"
        if code is None:
            return f"pid {self.proc.pid} is still running"
        return f"pid {self.proc.pid} {_ended(code)}"

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
        """Shutdown, then SIGKILL after SHUTDOWN_GRACE_S (at once for a core already given up)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:  # never block: a core on its way out may have no socket left to receive this
                self.tx.send_multipart(self.encoder.encode(Shutdown()), flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                pass
            grace = 0.0 if self.gave_up is not None else SHUTDOWN_GRACE_S
            if not await anyio.to_thread.run_sync(self._wait, grace):
                self.log.warning("engine_core_killed", reason=f"no exit within {grace} s of Shutdown")
                await anyio.to_thread.run_sync(self._kill)
        atexit.unregister(self._kill)

    def release(self) -> None:
        if not self.ctx.closed:
            self.auth.stop()
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
