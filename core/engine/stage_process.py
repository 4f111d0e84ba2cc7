"""Entry point of a pipeline stage process: `python -m speckernel.engine.stage_process`.

It meets the other stages at the env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
as torchrun sets them), reads its StageBootstrap on stdin, opens its links of the configured
transport (`stage_links`), loads its slice of the target (the last stage also builds the
speculator) on the single stage's fast path, says it is ready, then runs every StepFrame the
engine core sends, in order. The stages hand each other the residual stream, and the last
stage hands the first, device to device, the tokens each step wrote; it publishes each step's
TokenFrame to the engine core from a thread of its own, so its step loop never waits on the
host for the device. It exits on Stop, and by itself when the process that started it is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from .. import log, registry
from ..kernel.frame import StepFrame
from ..kernel.token_frames import frame_from_result, frame_meta, meta_digest
from ..models.loader import load_model
from ..platform import Platform, parse_dtype
from ..plugin import drafting_kind
from ..runner.host_copy import syncs_fail
from ..runner.model_runner import PendingStep
from ..runner.stage_runner import StageLinks, StageRunner, StageSlice, split_layers
from ..transport import TokenFrame, Transport, TransportContext
from ..wire.limits import engine_frame_limit
from .check import check
from .fast_path import capture_graphs, use_kernels, warm_kernels
from .speculation import build_speculator, check_speculator, held_bytes
from .stage_group import StageGroup, plan_group
from .stage_links import RENDEZVOUS_TIMEOUT_S, open_link, open_stage_links
from .stage_messages import BEAT_S, Digest, StageBootstrap, StageCommand, StageReport, Stop

SYNC_DEBUG_ENV = "SPECKERNEL_STAGE_SYNC_DEBUG"
"""Set to 1 in the engine core's environment (the stages inherit it): every decode step of every
stage runs under `torch.cuda.set_sync_debug_mode("error")`, so one that waits on the device fails
its stage (the GPU tests run PP=2 so)."""
CORE_SEND_TIMEOUT_S = 30.0
"""How long the last stage's send of a token frame may wait for the engine core to take one."""


def _watch_parent(parent: int) -> None:
    """The engine core is gone: nothing will stop this stage but itself."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.2)


class Publisher:
    """The last stage's token frames, sent from a thread of their own: the step loop hands over a
    launched step and goes on to the next, and only this thread waits for the step's copy to the
    host (polling the device, so no call here synchronises it either)."""

    POLL_S = 50e-6

    def __init__(self, send: Callable[[TokenFrame], None], max_rows: int, k: int,
                 on_error: Callable[[BaseException], None]) -> None:
        self.send, self.max_rows, self.k, self.on_error = send, max_rows, k, on_error
        self.queue: queue.Queue[tuple[StepFrame, PendingStep] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="speckernel-publisher", daemon=True)
        self.thread.start()

    def put(self, frame: StepFrame, pending: PendingStep) -> None:
        self.queue.put((frame, pending))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            frame, pending = item
            try:
                while not pending.ready():
                    time.sleep(self.POLL_S)
                self.send(frame_from_result(frame, pending.result(), self.max_rows, self.k))
            except BaseException as e:  # the stage cannot go on: the engine core must hear of it
                log.get("stage").exception("publish_failed", step_id=frame.step_id)
                self.on_error(e)
                return

    def close(self) -> None:
        """Sends what is queued, then stops (giving up after CORE_SEND_TIMEOUT_S)."""
        self.queue.put(None)
        self.thread.join(CORE_SEND_TIMEOUT_S)


class Stage:
    """One stage's step loop: runs every StepFrame it is handed, in order; the last stage hands
    each launched step to its publisher."""

    def __init__(self, boot: StageBootstrap, rank: int, world: int, platform: Platform, links: StageLinks,
                 publish: Callable[[TokenFrame], None] | None = None,
                 on_error: Callable[[BaseException], None] = lambda e: os._exit(1), sync_debug: bool = False) -> None:
        self.boot, self.rank, self.world = boot, rank, world
        self.sync_debug = sync_debug
        """Decode steps run under the device's sync check (`SYNC_DEBUG_ENV`)."""
        self.num_sync_checked = 0
        config = boot.config
        self.device = platform.device
        dtype = parse_dtype(config.dtype) if config.dtype else platform.default_dtype()
        checked = check(config)
        model = load_model(checked.path, dtype, self.device, boot.max_model_len + boot.lookahead_slots)
        start, end = split_layers(model.cfg.num_layers, world)[rank]
        self.slice = StageSlice(rank, world, start, end)
        model.keep_layers(start, end, embed=self.slice.first or self.slice.last)
        spec = check_speculator(checked, model.cfg, platform, dtype)
        k = config.num_speculative_tokens if spec is not None else 0
        speculator = None
        if spec is not None and self.slice.last:  # drafters live on the last stage only
            speculator = build_speculator(config, spec, platform, boot.max_model_len, boot.num_blocks,
                                          boot.draft_kv_bytes)
        self.speculator = type(speculator).__name__ if speculator is not None else ""
        self.drafter_bytes = held_bytes(speculator)
        self.k = k
        attention = platform.attention_backend(config.block_size, config.max_num_batched_tokens,
                                               max_rows=config.max_num_seqs + 1,
                                               max_blocks=boot.blocks_per_request,
                                               batch_invariant=config.batch_invariant)
        use_kernels(model, platform, config, head=self.slice.last)
        self.runner = StageRunner(model, self.device, boot.num_blocks, config.block_size, attention,
                                  num_slots=config.max_num_seqs, max_model_len=boot.max_model_len,
                                  speculator=speculator, num_speculative_tokens=k,
                                  use_triton=platform.capabilities.triton, force_host_drafts=config.force_host_drafts,
                                  max_num_tokens=config.max_num_batched_tokens, stage=self.slice, links=links,
                                  hidden_layers=spec.caps.target_hidden_layers if spec is not None else ())
        in_step = speculator is not None and drafting_kind(type(speculator)) == "in_step"
        with torch.inference_mode():
            self.runner.graphs = capture_graphs(self.runner, platform, config, boot.max_model_len, k, in_step)
            warm_kernels(self.runner, self.runner.kv_cache[0], platform, model.cfg.num_heads, k,
                         min(config.max_num_batched_tokens, boot.max_model_len))
        self.max_rows = config.max_num_seqs
        self.publisher = None
        if self.slice.last:
            assert publish is not None
            self.publisher = Publisher(publish, self.max_rows, k, on_error)
        self.digest = hashlib.sha256()
        self.num_steps = 0
        self.busy_s = 0.0

    def run_step(self, frame: StepFrame) -> None:
        started = time.perf_counter()
        try:
            meta_digest(self.digest, frame_meta(frame, self.max_rows, self.k))
            self.num_steps += 1
            with self._no_sync(frame):
                pending = self.runner.launch(frame)
            if self.publisher is not None:
                self.publisher.put(frame, pending)
        finally:
            self.busy_s += time.perf_counter() - started

    @contextlib.contextmanager
    def _no_sync(self, frame: StepFrame) -> Iterator[None]:
        """With `sync_debug`, a decode or verification step that synchronises the device with the
        host raises (`torch.cuda.set_sync_debug_mode("error")`) and so ends the stage."""
        decode = bool(frame.rows) and all(r.sampling is not None and r.num_tokens == 1 + r.num_drafts
                                          for r in frame.rows)
        checked = self.sync_debug and decode and self.device.type == "cuda"
        with syncs_fail(checked):
            yield
        self.num_sync_checked += checked

    def close(self) -> None:
        """Publishes what is launched (token windows still owed to the first stage are dropped:
        their steps' output is the engine core's already)."""
        if self.publisher is not None:
            self.publisher.close()

    def report(self, ready: bool = False) -> StageReport:
        graphs = self.runner.graphs if ready else None
        replays = self.runner.graphs.num_replays if self.runner.graphs is not None else 0
        return StageReport(rank=self.rank, ready=ready, num_steps=self.num_steps, num_graph_steps=replays,
                           meta_digest=self.digest.hexdigest(),
                           busy_s=self.busy_s, speculator=self.speculator, drafter_bytes=self.drafter_bytes,
                           num_sync_checked=self.num_sync_checked,
                           prefill_tokens=list(graphs.prefill) if graphs is not None else [],
                           prompt_batches=list(graphs.prompt_batches) if graphs is not None else [])


def _beat(ctx: zmq.Context[Any], address: str, rank: int) -> None:
    """Beats from a socket of its own while the process runs: a stage that stops (SIGSTOP, a
    frozen host) falls silent, while one that waits on a dead peer still beats and the peer is
    the one named."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    beat = msgspec.msgpack.encode(StageReport(rank=rank, beat=True))
    while True:
        try:
            sock.send(beat, zmq.NOBLOCK)
        except zmq.ZMQError:  # the core is gone or not reading yet: the next beat tries again
            pass
        time.sleep(BEAT_S)


def _say(ctx: zmq.Context[Any], address: str, report: StageReport) -> None:
    """One report from a socket of its own (any thread may say a stage failed)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(msgspec.msgpack.encode(report))
    sock.close()


def open_links(boot: StageBootstrap, platform: Platform, plan: StageGroup, rank: int,
               world: int) -> tuple[Any, dict[int, Transport], Transport | None]:
    """The rendezvous store (stage 0 serves it: keep it while the stage runs), this stage's ends of
    its links to other stages (by peer rank) and, on the last stage, of its link to the engine
    core, all of the configured transport. The addresses of the links between stages come from
    the rendezvous (MASTER_ADDR, MASTER_PORT, as torchrun sets them)."""
    config = boot.config
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False)
    base = TransportContext(rank=rank, peer=rank, world=world, device=str(platform.device),
                            dist_backend="gloo" if plan.host_staged else platform.capabilities.dist_backend,
                            max_rows=config.max_num_seqs, max_k=boot.k, address="", timeout_s=None,
                            max_frame_bytes=engine_frame_limit(config))
    ends = open_stage_links(boot.transport, store, base, config.pipeline_host)
    to_core = None
    if rank == world - 1:
        # Token frames only, to a host-side end: no device backend to form with the engine core.
        to_core = open_link(boot.transport, msgspec.structs.replace(
            base, peer=-1, device="cpu", dist_backend="gloo", address=boot.results, bind=False,
            timeout_s=CORE_SEND_TIMEOUT_S))
    return store, ends, to_core


def main() -> None:
    boot = msgspec.json.decode(sys.stdin.buffer.read(), type=StageBootstrap)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    log.configure(boot.config.log_level)
    if boot.threads:
        torch.set_num_threads(boot.threads)
    platform = registry.pick_platform(boot.config.platform)
    plan = plan_group(platform, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    platform = platform.on_device(plan.device_index)
    if platform.device.type != "cpu":  # kernels launch on the current device, as torchrun's workers set it
        torch.get_device_module(platform.device).set_device(platform.device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.MAXMSGSIZE, engine_frame_limit(boot.config))  # a larger frame drops the link
    commands.connect(boot.commands[rank])
    reports = ctx.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 2000)
    reports.connect(boot.reports)
    decoder = msgspec.msgpack.Decoder(StageCommand)
    threading.Thread(target=_beat, args=(ctx, boot.reports, rank), daemon=True).start()

    def failed(e: BaseException) -> None:
        _say(ctx, boot.reports, StageReport(rank=rank, error=f"{type(e).__name__}: {e}"))
        os._exit(1)

    try:
        _rendezvous, ends, to_core = open_links(boot, platform, plan, rank, world)  # held: stage 0 serves it
        links = StageLinks(prev=ends.get(rank - 1), next=ends.get(rank + 1),
                           tokens=ends.get(world - 1 if rank == 0 else 0) if rank in (0, world - 1) else None)
        stage = Stage(boot, rank, world, platform, links, publish=to_core.send_frame if to_core else None,
                      on_error=failed, sync_debug=os.environ.get(SYNC_DEBUG_ENV) == "1")
    except Exception as e:
        reports.send(msgspec.msgpack.encode(StageReport(rank=rank, error=f"{type(e).__name__}: {e}")))
        raise
    reports.send(msgspec.msgpack.encode(stage.report(ready=True)))
    with torch.inference_mode():
        while True:
            cmd = decoder.decode(commands.recv())
            if isinstance(cmd, Stop):
                break
            if isinstance(cmd, Digest):
                reports.send(msgspec.msgpack.encode(stage.report()))
                continue
            stage.run_step(cmd.frame)
    stage.close()
    for end in [*ends.values(), *([to_core] if to_core is not None else [])]:
        try:
            end.close()
        except Exception:  # a peer that left first: nothing is owed at a stop
            pass
    reports.close()
    commands.close(linger=0)
    os._exit(0)  # a transport's teardown can wait on peers that already left


if __name__ == "__main__":
    main()
