"""The frontend <-> core process boundary under faults: a dead, hung or signalled core, malformed
frames, stray peers on the sockets, stale and over-long socket folders.

Real core processes over loopback ipc, on the tiny random-weight model; the frontend gets a
byte-level tokenizer, since random models ship none. Starting a core costs seconds (torch), so
one module fixture starts every engine the tests need at once: a healthy one that tests share,
one per test that ends its core, and a frontend in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np
import pytest
import pytest_asyncio
import zmq
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from speckernel import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from speckernel.errors import InvalidInputError
from speckernel.frontend import async_engine as async_engine_mod
from speckernel.frontend import client as core_client
from speckernel.frontend.async_engine import _Pending
from speckernel.frontend.client import HEARTBEAT_TIMEOUT_S, IPC_PREFIX, SHORT_TMP, SHUTDOWN_GRACE_S, ProcessClient
from speckernel.models.tokenizer import Tokenizer
from speckernel.transport import TokenFrame
from speckernel.transports.zmq import ZmqTransport
from speckernel.wire.codec import Decoder, Encoder
from speckernel.wire.messages import (
    AddRequest,
    CoreBootstrap,
    CoreOutputs,
    FrontendMessage,
    RequestDelta,
    UtilityResult,
    check_wire,
)
from tests.conftest import exited

pytestmark = pytest.mark.timing  # death, heartbeat and shutdown bounds

CONFIG = EngineConfig(model="random:tiny", platform="cpu", max_model_len=1024, num_kv_blocks=80, seed=0)
PROMPT = [1, 2, 3, 4]
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, None, None, (), False)


@pytest.fixture(scope="module", autouse=True)
def _tokenizer() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(async_engine_mod, "load_tokenizer", lambda path: byte_tokenizer())
        yield


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Fails (instead of hanging the suite) when a blocking call holds the event loop too long."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """A core spawned inside writes its stderr (its log) to `path`."""
    saved = os.dup(2)
    with path.open("ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def core_of(engine: AsyncEngine) -> ProcessClient:
    client = engine._client
    assert isinstance(client, ProcessClient)
    return client


def dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", ""])
    done.wait()
    return done.pid


async def collect(engine: AsyncEngine, params: SamplingParams = SHORT, request_id: str | None = None) -> list[Any]:
    return [out async for out in engine.generate(PROMPT, params, request_id=request_id)]


async def first_output_then_hold(engine: AsyncEngine, request_id: str, started: anyio.Event,
                                 errors: list[BaseException]) -> None:
    try:
        async for _ in engine.generate(PROMPT, LONG, request_id=request_id):
            started.set()
    except EngineDeadError as e:
        errors.append(e)


async def hold_a_request(tg: anyio.abc.TaskGroup, engine: AsyncEngine) -> list[BaseException]:
    """Starts a long request in `tg` and returns once its first output arrived: the core is then
    mid-request. The list it returns receives the EngineDeadError that ends the request."""
    started, errors = anyio.Event(), []
    tg.start_soon(first_output_then_hold, engine, "held", started, errors)
    with anyio.fail_after(20):
        await started.wait()
    return errors


# --- the engines, all started at once --------------------------------------------------------


class Owned:
    """An engine whose task group lives in one owner task from start to shutdown."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
        self.ready, self.done = anyio.Event(), anyio.Event()
        self.task: asyncio.Task[None] | None = None

    async def _own(self) -> None:
        async with AsyncEngine(CONFIG) as engine:
            self.engine = engine
            self.ready.set()
            await self.done.wait()

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._own())

    async def shutdown(self) -> float:
        """Shuts the engine down; returns how long that took."""
        assert self.task is not None
        t0 = time.monotonic()
        self.done.set()
        await self.task
        return time.monotonic() - t0

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.engine is not None
        proc = core_of(self.engine).proc
        assert proc is not None
        return proc


class Pool:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.long_tmp = root / ("a-very-long-temp-folder-name-" * 4)
        self.long_tmp.mkdir()
        self.stale = self.long_tmp / f"{IPC_PREFIX}{dead_pid()}-abcdefgh"  # left by a killed run
        self.stale.mkdir()
        (self.stale / "in").write_text("")
        self.foreign = self.long_tmp / f"{IPC_PREFIX}{os.getppid()}-abcdefgh"  # owner alive: kept
        self.foreign.mkdir()
        self.legacy_stale, self.legacy_live = root / "speckernel-old00001", root / "speckernel-old00002"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.legacy_live.mkdir()
        self.listener.bind(str(self.legacy_live / "in"))
        self.listener.listen()
        self.legacy_stale.mkdir()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as closed:
            closed.bind(str(self.legacy_stale / "in"))
        self.log = root / "core.log"
        self.frontend_tmp = root / "frontend-tmp"
        self.frontend_tmp.mkdir()
        self.owned = {role: Owned() for role in ("healthy", "killed", "hung", "just_hung", "sigterm")}
        self.frontend: subprocess.Popen[str] | None = None

    @property
    def healthy(self) -> AsyncEngine:
        engine = self.owned["healthy"].engine
        assert engine is not None
        return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pool]:
    pool = Pool(tmp_path_factory.mktemp("reliability"))
    pool.frontend = subprocess.Popen([sys.executable, "-c", FRONTEND], stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TMPDIR=str(pool.frontend_tmp)))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tempfile, "tempdir", str(pool.long_tmp))
            with stderr_to(pool.log), anyio.fail_after(120):
                for owned in pool.owned.values():
                    owned.start()
                for owned in pool.owned.values():
                    assert owned.task is not None
                    await asyncio.wait([owned.task, asyncio.ensure_future(owned.ready.wait())],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if owned.task.done():
                        owned.task.result()
        yield pool
    finally:
        pool.frontend.kill()
        pool.listener.close()
        for owned in pool.owned.values():
            if owned.task is not None:
                await owned.shutdown()


@pytest.mark.asyncio(loop_scope="module")
async def test_long_tmpdir_falls_back_to_a_short_socket_folder_and_stale_ones_are_swept(pool: Pool) -> None:
    client = core_of(pool.healthy)
    assert len(str(pool.stale.parent)) > 107
    assert Path(client.ipc_dir).parent == Path(SHORT_TMP)
    assert oct(Path(client.ipc_dir).stat().st_mode & 0o777) == "0o700"
    assert not pool.stale.exists(), "a folder whose owner pid is gone is removed at the next start"
    assert pool.foreign.exists(), "a folder whose owner is alive is left alone"
    # Folders of older versions name no pid: stale when no socket in them is listening.
    assert core_client.sweep_stale_ipc_dirs(str(pool.root)) == [pool.legacy_stale]
    assert not pool.legacy_stale.exists() and pool.legacy_live.exists()
    outs = await collect(pool.healthy)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == SHORT.max_tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lone_surrogate_is_bad_input_not_a_type_error(pool: Pool) -> None:
    with pytest.raises(InvalidInputError, match="lone surrogate at character 1"):
        async for _ in pool.healthy.generate("a\ud800b", SHORT):
            pass
    with pytest.raises(InvalidInputError, match=r"messages\[0\].content: not valid Unicode"):
        async for _ in pool.healthy.chat([{"role": "user", "content": "\udcff"}], SHORT):
            pass
    assert len(await collect(pool.healthy)) >= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_ends_the_stream_with_an_abort_output_and_the_id_is_reusable(pool: Pool) -> None:
    engine = pool.healthy
    outs: list[Any] = []
    two = anyio.Event()

    async def consume() -> None:
        async for out in engine.generate(PROMPT, LONG, request_id="job"):
            outs.append(out)
            if len(outs) == 2:
                two.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await two.wait()
            await engine.abort("job")
        again = await collect(engine, request_id="job")
        stats = await engine.stats()
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < LONG.max_tokens
    assert again[-1].finish_reason == "length" and len(again[-1].token_ids) == SHORT.max_tokens
    assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def add_request_frames(key: int, dtype: str, shape: list[int], data: bytes) -> list[bytes]:
    """An AddRequest as the wire spells it, with any array header the sender likes."""
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(SHORT))
    return [msgspec.msgpack.encode(["AddRequest", key, [dtype, shape, data], params, "bad"])]


BAD_ARRAYS = {
    "float-nan": np.array([1.0, np.nan, 3.0]),
    "2-d": np.arange(6, dtype=np.int64).reshape(2, 3),
    "0-d": np.array(5, dtype=np.int64),
    "unicode": np.array(["12", "7"]),
    "bool": np.array([True, False]),
}


@pytest.mark.asyncio(loop_scope="module")
async def test_each_malformed_frame_is_dropped_with_a_traceback_and_the_core_keeps_serving(pool: Pool) -> None:
    engine, client = pool.healthy, core_of(pool.healthy)
    before = pool.log.read_text().count("malformed_frame_dropped")
    errors: dict[str, str] = {}
    with anyio.fail_after(20):
        for i, (name, array) in enumerate(BAD_ARRAYS.items()):
            key = 10**9 + i
            send, recv = anyio.create_memory_object_stream[Any](math.inf)
            engine._requests[key] = _Pending(name, send)  # the frontend waits on this key
            client.send(AddRequest(key, array, SHORT, name))  # through the client's own send
            item = await recv.receive()
            engine._requests.pop(key)
            assert isinstance(item, RequestDelta) and item.finish_reason == "error", name
            errors[name] = item.error or ""
        # Raw frames: a forged array header, garbage, and a utility call with deeply nested args.
        key = 10**9 + 99
        send, recv = anyio.create_memory_object_stream[Any](math.inf)
        engine._requests[key] = _Pending("huge", send)
        client.tx.send_multipart(add_request_frames(key, "<i8", [10**12], b""))
        item = await recv.receive()
        engine._requests.pop(key)
        errors["huge-shape"] = item.error or ""
        client.tx.send_multipart([b"\x93not msgpack"])
        call_id = 10**9
        event, box = anyio.Event(), []
        engine._calls[call_id] = (event, box)
        nested = b"\x91" * 5000 + b"\xc0"
        client.tx.send_multipart([b"\x94\xabUtilityCall" + msgspec.msgpack.encode(call_id) + b"\xa5stats"
                                  + nested])
        await event.wait()
        # The core is still there and serves a normal request.
        outs = await collect(engine)
    assert all(e.startswith("InvalidInputError: malformed AddRequest frame") for e in errors.values()), errors
    assert isinstance(box[0], UtilityResult) and "malformed UtilityCall frame" in (box[0].error or "")
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == SHORT.max_tokens
    assert client.proc is not None and client.proc.poll() is None
    await anyio.sleep(0.2)  # let the core's log line land
    log = pool.log.read_text()
    dropped = [line for line in log.splitlines() if "malformed_frame_dropped" in line]
    assert len(dropped) - before == len(BAD_ARRAYS) + 3
    assert all("Traceback (most recent call last)" in line for line in dropped), dropped


@pytest.mark.asyncio(loop_scope="module")
async def test_stray_peers_cannot_steal_or_inject(pool: Pool) -> None:
    engine, client = pool.healthy, core_of(pool.healthy)
    assert all(CONFIG.model not in a and client.server_public.decode() not in a for a in client.argv)
    expected = (await collect(engine))[-1].token_ids
    ctx = zmq.Context()
    strays: list[zmq.Socket] = []  # type: ignore[type-arg]
    try:
        for curve in (False, True):
            public, secret = zmq.curve_keypair()
            for kind, name in ((zmq.PULL, "in"), (zmq.PUSH, "out")):
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                if curve:  # knows the server key, but its own key was never admitted
                    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                        client.server_public, public, secret)
                sock.connect(f"ipc://{client.ipc_dir}/{name}")
                strays.append(sock)
        forged = CoreOutputs([RequestDelta(k, [7, 7, 7], "stop") for k in range(1000)])
        for sock in strays:
            if sock.type == zmq.PUSH:
                # A stray whose handshake was already refused has no pipe to queue into: a
                # blocking send would wait forever, and there is nothing to deliver anyway.
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(Encoder().encode(forged), flags=zmq.NOBLOCK, copy=False)
        await anyio.sleep(0.5)
        with anyio.fail_after(20):  # a stolen request would never finish
            results = []
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(lambda: _append(results, collect(engine)))
        assert [r[-1].token_ids for r in results] == [expected] * 6
        assert all(r[-1].finish_reason == "length" for r in results)
        assert not any(s.poll(0) for s in strays if s.type == zmq.PULL)
    finally:
        ctx.destroy(linger=0)


async def _append(box: list[Any], coro: Any) -> None:
    box.append(await coro)


@pytest.mark.asyncio(loop_scope="module")
async def test_sigint_to_the_core_is_ignored(pool: Pool) -> None:
    client = core_of(pool.healthy)
    assert client.proc is not None
    os.kill(client.proc.pid, signal.SIGINT)
    await anyio.sleep(0.5)
    assert client.proc.poll() is None
    with anyio.fail_after(10):
        outs = await collect(pool.healthy)
    assert outs[-1].finish_reason == "length"
    assert "KeyboardInterrupt" not in pool.log.read_text()


# --- faults that end a core: each on its own engine ------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_core_killed_while_the_loop_is_busy_then_abort_stats_generate_raise_engine_dead(pool: Pool) -> None:
    owned = pool.owned["killed"]
    engine, proc = owned.engine, owned.proc
    assert engine is not None
    async with anyio.create_task_group() as tg:
        errors = await hold_a_request(tg, engine)
        proc.kill()
        time.sleep(0.5)  # the loop is busy; meanwhile the core and its socket go away
        t0 = time.monotonic()
        with hard_deadline(5):  # a send blocked in ZeroMQ would hold the loop for ever
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await engine.abort("held")  # the first call after the busy spell meets the dead socket
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await engine.stats()
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await collect(engine)
        took = time.monotonic() - t0
    assert took < 5
    assert len(errors) == 1 and "SIGKILL" in str(errors[0])
    assert await owned.shutdown() < 1


@pytest.mark.asyncio(loop_scope="module")
async def test_hung_core_is_reported_dead_within_the_heartbeat_bound_and_shutdown_is_bounded(pool: Pool) -> None:
    owned = pool.owned["hung"]
    engine, proc = owned.engine, owned.proc
    assert engine is not None
    async with anyio.create_task_group() as tg:
        errors = await hold_a_request(tg, engine)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with anyio.fail_after(HEARTBEAT_TIMEOUT_S + 2), pytest.raises(EngineDeadError, match="heartbeat"):
            await engine.stats()
        detected = time.monotonic() - t0
    assert detected <= 5
    assert len(errors) == 1 and "heartbeat" in str(errors[0])
    with pytest.raises(EngineDeadError, match="heartbeat"):
        await collect(engine)
    assert await owned.shutdown() < 1, "shutting down a core found hung must not wait for it"
    assert proc.poll() == -signal.SIGKILL


@pytest.mark.asyncio(loop_scope="module")
async def test_shutdown_of_a_core_that_just_hung_kills_it_after_a_short_grace(pool: Pool) -> None:
    owned = pool.owned["just_hung"]
    proc = owned.proc
    os.kill(proc.pid, signal.SIGSTOP)
    assert await owned.shutdown() < SHUTDOWN_GRACE_S + 1.5
    assert proc.poll() == -signal.SIGKILL


@pytest.mark.asyncio(loop_scope="module")
async def test_sigterm_to_the_core_ends_it_within_a_second_and_names_the_cause(pool: Pool) -> None:
    owned = pool.owned["sigterm"]
    engine, proc = owned.engine, owned.proc
    assert engine is not None
    async with anyio.create_task_group() as tg:
        errors = await hold_a_request(tg, engine)
        proc.terminate()
        t0 = time.monotonic()
        code = await anyio.to_thread.run_sync(proc.wait, 5)
        took = time.monotonic() - t0
    assert took < 1.0, f"core took {took:.2f} s to exit on SIGTERM"
    assert code == 128 + signal.SIGTERM
    assert len(errors) == 1 and "SIGTERM" in str(errors[0])
    assert await owned.shutdown() < 1


FRONTEND = """
import anyio
from speckernel.config import EngineConfig
from speckernel.frontend.client import ProcessClient

async def main():
    client = ProcessClient(EngineConfig(model="random:tiny", platform="cpu", max_model_len=64, num_kv_blocks=8))
    async with anyio.create_task_group() as tg:
        await client.start(tg)
        print(client.proc.pid, client.ipc_dir, flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


@pytest.mark.asyncio(loop_scope="module")
async def test_sigterm_to_the_frontend_takes_the_core_within_a_second_and_its_folder_is_swept_later(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    frontend = pool.frontend
    assert frontend is not None and frontend.stdout is not None
    with anyio.fail_after(60):
        pid_text, ipc_dir = (await anyio.to_thread.run_sync(frontend.stdout.readline)).split()
    core_pid = int(pid_text)
    frontend.terminate()
    t0 = time.monotonic()
    assert await anyio.to_thread.run_sync(frontend.wait, 5) == -signal.SIGTERM
    while not exited(core_pid) and time.monotonic() - t0 < 5:
        await anyio.sleep(0.02)
    took = time.monotonic() - t0
    assert exited(core_pid)
    assert took < 1.0, f"core outlived its SIGTERMed frontend by {took:.2f} s"
    assert Path(ipc_dir).exists() and Path(ipc_dir).parent == pool.frontend_tmp  # a killed run cleans nothing
    monkeypatch.setattr(tempfile, "tempdir", str(pool.frontend_tmp))
    client = ProcessClient(CONFIG)  # the next start sweeps it
    try:
        assert not Path(ipc_dir).exists() and Path(client.ipc_dir).exists()
    finally:
        client.release()
    assert core_client.sweep_stale_ipc_dirs(str(pool.frontend_tmp)) == []


def test_wire_check_refuses_every_malformed_prompt_array() -> None:
    """The check both the core process (before its loop) and EngineCore.add_request (in-process) run."""
    for array in BAD_ARRAYS.values():
        with pytest.raises(ValueError, match="1-D integer array"):
            check_wire(AddRequest(0, array, SHORT))
    check_wire(AddRequest(0, np.array(PROMPT, dtype=np.int64), SHORT))
    check_wire(AddRequest(0, np.array(PROMPT, dtype=np.uint16), SHORT))


def test_codec_is_total_and_keeps_shapes() -> None:
    """Any frame decodes or raises a msgspec error (never RecursionError); 0-d arrays stay 0-d."""
    decoder = Decoder(FrontendMessage)
    for frames in ([b"\x91" * 5000 + b"\xc0"], [], add_request_frames(1, "O", [1], b"x"),
                   add_request_frames(1, "<i8", [2], 5), add_request_frames(1, "<i8", [2], 0)):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decoder.decode(frames)
    for array in (np.array(5), np.arange(100).reshape(4, 25)):
        got = Decoder(np.ndarray).decode(Encoder().encode(array))
        assert got.shape == array.shape and np.array_equal(got, array)


def test_zmq_transport_send_is_bounded_and_a_bad_frame_is_a_value_error() -> None:
    a = ZmqTransport("tcp://127.0.0.1:*", bind=True, send_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no peer"):  # a PAIR socket without a peer blocks
            a.send_frame(TokenFrame.empty(1, max_rows=4, max_k=2))
        assert time.monotonic() - t0 < 2
        b = ZmqTransport(a.address, bind=False)
        try:
            a.sock.send_multipart([b"\x91" * 5000 + b"\xc0"])
            with pytest.raises(ValueError, match="malformed"):
                b.recv_frame(timeout_s=2)
        finally:
            b.close()
    finally:
        a.close()


def test_a_core_whose_loop_raises_reports_the_cause_and_exits_with_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing the frontend sends crashes the core any more, so the crash path gets a loop that
    raises: the core serves `CoreProcess.run` here, over CURVE sockets this test binds as its
    frontend, and must say it is ready, then send CoreFailed naming the real exception (not the
    task group around it), and return exit code 1."""
    from speckernel.engine import process as core_process
    from speckernel.engine.core import EngineCore
    from speckernel.wire.messages import CoreFailed, CoreMessage, CoreReady, Heartbeat

    async def crash(self: EngineCore, emit: Any) -> None:
        raise RuntimeError("boom in the loop")

    monkeypatch.setattr(EngineCore, "run", crash)
    monkeypatch.setattr(core_process.log, "configure", lambda level: None)  # the test process keeps its logging
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (to_core, from_core):
        sock.curve_server = True
        sock.curve_secretkey = server_secret
        sock.bind("tcp://127.0.0.1:*")
    boot = CoreBootstrap(
        config=msgspec.structs.replace(CONFIG, log_level="critical"), in_addr=to_core.last_endpoint.decode(),
        out_addr=from_core.last_endpoint.decode(), parent_pid=os.getppid(), server_key=server_public,
        public_key=public, secret_key=secret)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with hard_deadline(60):
            code = core_process.CoreProcess(boot).run()
    finally:
        signal.signal(signal.SIGINT, previous)
    decoder = Decoder(CoreMessage)
    received = []
    while from_core.poll(2000):
        received.append(decoder.decode(from_core.recv_multipart(copy=False)))
    ctx.destroy(linger=0)
    assert code == core_process.EXIT_CRASHED == 1
    received = [m for m in received if not isinstance(m, Heartbeat)]  # beats come while it starts, too
    assert isinstance(received[0], CoreReady)
    failed = [m for m in received if isinstance(m, CoreFailed)]
    assert len(failed) == 1 and failed[0].error_type == "RuntimeError", received
    assert failed[0].message == "boom in the loop" and not failed[0].invalid_input
