"""The engine core's side of pipeline parallelism: starts one stage process per slice of the
target's layers, hands each a StepFrame per step, and collects the last stage's TokenFrames.

Stages meet at an env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) on
`pipeline_host`, so the stage code is what `torchrun` would run, and link up through the
configured transport (`stage_links`). The core talks to them over ZeroMQ: a PUSH socket per
stage for commands, one PULL for their reports; the last stage's token frames come on a link of
the configured transport that the core binds. While it waits for a frame it watches the stage processes: one that
exits, or whose beats stop for HUNG_S, fails the step with EngineDeadError naming it, and
`close` leaves no stage behind.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from .. import log
from ..config import EngineConfig
from ..errors import EngineDeadError
from ..kernel.frame import StepFrame, StepResult
from ..kernel.kv_plan import KvPlan
from ..kernel.token_frames import frame_meta, meta_digest, result_from_frame
from ..platform import PlatformCapabilities
from ..transport import TransportContext
from ..wire.limits import engine_frame_limit
from .check import Checked
from .stage_links import free_port, open_link, transport_name
from .stage_messages import HUNG_S, Digest, RunStep, StageBootstrap, StageReport, Stop

POLL_S = 0.1
"""How often a wait for a frame looks at the stage processes (a dead one is seen within this)."""
STOP_WAIT_S = 3.0


class PendingFrame:
    """A step handed to the stages: its result once the last stage's frame is in."""

    def __init__(self, collect: Callable[[], StepResult]) -> None:
        self.collect = collect

    def ready(self) -> bool:
        """Unknown until the last stage's frame is read: the loop waits for it on a thread."""
        return False

    def result(self) -> StepResult:
        return self.collect()


def _open_into(future: Future[Any], name: str, ctx: TransportContext) -> None:
    """Opens a link on a daemon thread (an open that waits for a peer that never comes must not
    hold the process at exit)."""
    try:
        future.set_result(open_link(name, ctx))
    except BaseException as e:
        future.set_exception(e)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass


class Pipeline:
    """The `Runner` of a target split into stages: `launch` hands the stages a frame, its
    PendingFrame's result is the last stage's. The stages replay no graphs the core could time."""

    graphs = None
    device_s = None

    def __init__(self, config: EngineConfig, checked: Checked, kv: KvPlan, k: int, caps: PlatformCapabilities) -> None:
        self.log = log.get("pipeline")
        self.config = config
        n = config.pipeline_parallel_size
        host = config.pipeline_host
        self.transport = transport_name(config, caps)
        self.ctx = zmq.Context()
        self.commands = []
        for _ in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{host}:*")
            self.commands.append(sock)
        limit = engine_frame_limit(config)  # a larger frame from a stage drops its link (`wire.limits`)
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.setsockopt(zmq.MAXMSGSIZE, limit)
        self.reports.bind(f"tcp://{host}:*")
        # The last stage's token frames: the core binds the link and names it in the bootstrap. A
        # transport whose `open` waits for its peer opens on a thread while the stages start.
        results = TransportContext(rank=-1, peer=n - 1, world=n, max_rows=config.max_num_seqs, max_k=k,
                                   address=f"tcp://{host}:{free_port(host)}", bind=True, max_frame_bytes=limit,
                                   timeout_s=config.startup_timeout_s)
        opening: Future[Any] = Future()
        threading.Thread(target=_open_into, args=(opening, self.transport, results), daemon=True,
                         name="speckernel-link").start()
        boot = StageBootstrap(
            config=config, num_blocks=kv.num_blocks, max_model_len=kv.max_model_len,
            lookahead_slots=kv.lookahead_slots, draft_kv_bytes=kv.draft_kv_bytes,
            commands=[s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.commands],
            results=results.address, reports=self.reports.getsockopt_string(zmq.LAST_ENDPOINT),
            threads=max(1, (os.cpu_count() or 1) // n), transport=self.transport, k=k,
            blocks_per_request=kv.blocks_per_request(k))
        payload = msgspec.json.encode(boot)
        port = config.pipeline_port or free_port(host)
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(n):
            env = os.environ | {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank),
                                "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)}
            proc = subprocess.Popen([sys.executable, "-m", "speckernel.engine.stage_process"],
                                    stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            proc.stdin.write(payload)
            proc.stdin.close()
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        self.max_rows, self.k = config.max_num_seqs, k
        self.digest = hashlib.sha256()
        """The core's own digest of every frame's metadata, as the stages compute theirs."""
        self.lock = threading.Lock()
        """The command sockets are shared by the runner thread (steps) and callers of `digests`."""
        self.last_reports: list[StageReport] = []
        self.report_lock = threading.Lock()
        self.stash: list[StageReport] = []
        """Answers read while looking for beats, kept for `_reports`."""
        self.hung = False
        self.last_beat: list[float] | None = None
        """Per stage, when it last said anything; None until every stage is ready."""
        self.results: Any = None
        try:
            ready = self._reports(n, config.startup_timeout_s)
            try:
                self.results = opening.result(config.startup_timeout_s)
            except TimeoutError:
                raise EngineDeadError(f"the last pipeline stage's {self.transport} link to the engine core did "
                                      f"not open within {config.startup_timeout_s} s") from None
        except BaseException:
            self.close()
            raise
        self.prompt_graphs: tuple[list[int], list[tuple[int, int]]] = (
            sorted(set.intersection(*(set(r.prefill_tokens) for r in ready))),
            sorted(set.intersection(*(set(r.prompt_batches) for r in ready))))
        """The prompt step graphs every stage captured: the engine core runs prompts apart on them."""
        self.last_beat = [time.monotonic()] * n
        self.log.info("pipeline_ready", stages=n, pids=[p.pid for p in self.procs],
                      steps=[r.num_steps for r in ready])

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                raise EngineDeadError(f"pipeline stage {i} (pid {p.pid}) exited with code {code}")
        if self.last_beat is None:
            return
        self._drain(0)
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if now - self.last_beat[i] > HUNG_S:
                self.hung = True
                raise EngineDeadError(f"pipeline stage {i} (pid {p.pid}) stopped answering "
                                      f"(no beat for {now - self.last_beat[i]:.1f} s)")

    def _drain(self, timeout_ms: int) -> None:
        """Reads what the stages sent (waiting up to timeout_ms for the first): beats update
        `last_beat`, answers go to `stash`."""
        with self.report_lock:
            while self.reports.poll(timeout_ms):
                timeout_ms = 0
                report = msgspec.msgpack.decode(self.reports.recv(), type=StageReport)
                if self.last_beat is not None and 0 <= report.rank < len(self.last_beat):
                    self.last_beat[report.rank] = time.monotonic()
                if not report.beat:
                    self.stash.append(report)

    def _reports(self, n: int, timeout_s: float) -> list[StageReport]:
        """One report from each stage, by rank; EngineDeadError if a stage dies or fails first."""
        got: dict[int, StageReport] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < n:
            self._drain(int(POLL_S * 1000))
            with self.report_lock:
                answers, self.stash = self.stash, []
            for report in answers:
                if report.error:
                    raise EngineDeadError(f"pipeline stage {report.rank} failed: {report.error}")
                got[report.rank] = report
            if len(got) == n:
                break
            self.check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(f"pipeline stages {sorted(set(range(n)) - set(got))} did not answer "
                                      f"within {timeout_s} s")
        return [got[r] for r in range(n)]

    def _send(self, cmd: RunStep | Digest | Stop, check: bool = True) -> None:
        """To every stage. A PUSH socket whose stage is gone would block for ever: sends never
        wait, and while one cannot go out the stages are checked (a dead one raises)."""
        data = msgspec.msgpack.encode(cmd)
        for sock in self.commands:
            while True:
                try:
                    sock.send(data, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if not check:
                        break
                    self.check_alive()
                    time.sleep(POLL_S / 10)

    def launch(self, frame: StepFrame) -> PendingFrame:
        with self.lock:
            meta_digest(self.digest, frame_meta(frame, self.max_rows, self.k))
            self._send(RunStep(frame))
        return PendingFrame(lambda: self._collect(frame))

    def execute(self, frame: StepFrame) -> StepResult:
        return self.launch(frame).result()

    def stop_speculation(self) -> None:
        """Nothing to stop on the core's side: the last stage's frames carry no speculator
        error, so the core never switches a pipeline's speculator off."""

    def _collect(self, frame: StepFrame) -> StepResult:
        """The last stage's frame for `frame`, as a StepResult the ledger applies."""
        while True:
            try:
                got = self.results.recv_frame(timeout_s=POLL_S)
            except TimeoutError:
                self.check_alive()
                continue
            return result_from_frame(frame, got)

    def digests(self) -> tuple[list[StageReport], str]:
        """Each stage's digest of the frame metadata of every step it ran, and the core's own
        over the frames it sent until then (the runner thread may launch meanwhile)."""
        if self.ctx.closed:  # stopped: what the stages said last
            return self.last_reports, self.digest.hexdigest()
        with self.lock:
            self._send(Digest())
            mine = self.digest.hexdigest()
        self.last_reports = self._reports(len(self.procs), 30.0)
        return self.last_reports, mine

    def close(self) -> None:
        if self.ctx.closed:
            return
        try:
            with self.lock:
                self._send(Stop(), check=False)
        except zmq.ZMQError:
            pass
        # A stage that died or hung leaves its peers blocked on it: no grace then, they are killed at once.
        grace = 0.0 if self.hung or any(p.poll() is not None for p in self.procs) else STOP_WAIT_S
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(self.procs)
        if self.results is not None:
            self.results.close()
        self.ctx.destroy(linger=0)
