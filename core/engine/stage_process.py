"""Entry point of a pipeline stage process: `python -m speckernel.engine.stage_process`.

It joins the stages' torch.distributed group through the env:// rendezvous (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, as torchrun sets them), reads its StageBootstrap on stdin, loads its
slice of the target (the last stage also builds the speculator), says it is ready, then runs
every StepFrame the engine core sends, in order. The last stage publishes each step's
TokenFrame to the engine core (zmq transport) and to the first stage (torch_dist transport),
which writes the sampled tokens and drafts into its token buffer before a step that reads them.
It exits on Stop, and by itself when the process that started it is gone.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from typing import Any, cast

import msgspec
import torch
import torch.distributed as dist
import zmq

from .. import log, registry
from ..kernel.frame import StepFrame
from ..kernel.token_frames import FrameMismatchError, frame_from_result, frame_meta, meta_digest
from ..models.loader import load_model
from ..platform import Platform, parse_dtype
from ..runner.stage_runner import HiddenLink, StageRunner, StageSlice, split_layers
from ..wire.limits import engine_frame_limit
from .check import check
from .speculation import build_speculator, check_speculator, held_bytes
from .stage_group import StageGroup, plan_group
from .stage_messages import BEAT_S, Digest, StageBootstrap, StageCommand, StageReport, Stop


def _watch_parent(parent: int) -> None:
    """The engine core is gone: nothing will stop this stage but itself."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.2)


class Stage:
    def __init__(self, boot: StageBootstrap, rank: int, world: int, platform: Platform, plan: StageGroup) -> None:
        self.boot, self.rank, self.world = boot, rank, world
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
        hidden_layers = spec.caps.target_hidden_layers if spec is not None else ()
        self.k = k
        group = dist.group.WORLD
        self.link = HiddenLink(group, rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None,
                               host_staged=plan.host_staged)
        attention = platform.attention_backend(config.block_size, config.max_num_batched_tokens,
                                               max_rows=config.max_num_seqs + 1,
                                               batch_invariant=config.batch_invariant)
        model.use_batch_invariant_ops(config.batch_invariant)
        self.runner = StageRunner(model, self.device, boot.num_blocks, config.block_size, attention,
                                  num_slots=config.max_num_seqs, max_model_len=boot.max_model_len,
                                  speculator=speculator, num_speculative_tokens=k, use_triton=False,
                                  max_num_tokens=config.max_num_batched_tokens, stage=self.slice, link=self.link)
        if not self.slice.last:
            self.runner.hidden_layers = hidden_layers
            self.runner.before = sorted(layer for layer in hidden_layers if layer < start)
        self.max_rows = config.max_num_seqs
        transport_cls = registry.load("transport", "torch_dist")
        self.to_first: Any = None
        if world > 1 and (self.slice.first or self.slice.last):
            self.to_first = cast(Any, transport_cls)(group, world - 1 if self.slice.first else 0, self.max_rows, k)
        self.to_core: Any = None
        if self.slice.last:
            self.to_core = cast(Any, registry.load("transport", "zmq"))(
                boot.results, bind=False, send_timeout_s=None, max_frame_bytes=engine_frame_limit(config))
        self.history: dict[int, StepFrame] = {}
        self.seen = -1
        self.digest = hashlib.sha256()
        self.num_steps = 0
        self.busy_s = 0.0

    def run_step(self, frame: StepFrame) -> None:
        started = time.perf_counter()
        try:
            self._run_step(frame)
        finally:
            self.busy_s += time.perf_counter() - started

    def _run_step(self, frame: StepFrame) -> None:
        meta = frame_meta(frame, self.max_rows, self.k)
        meta_digest(self.digest, meta)
        self.num_steps += 1
        if self.slice.first and not self.slice.last:
            need = max((r.prev_step_id for r in frame.rows), default=-1)
            while self.seen < need:
                got = self.to_first.recv_frame()
                step = self.history.pop(got.step_id, None)
                if step is None or not frame_meta(step, self.max_rows, self.k).same_meta(got):
                    raise FrameMismatchError(f"stage 0 got a token frame for step {got.step_id} it did not run")
                self.runner.write_frame(step, got)
                self.seen = got.step_id
            self.history[frame.step_id] = frame
        pending = self.runner.launch(frame)
        if self.slice.last:
            out = frame_from_result(frame, pending.result(), self.max_rows, self.k)
            self.to_core.send_frame(out)
            if self.to_first is not None:
                self.to_first.send_frame(out)

    def report(self, ready: bool = False) -> StageReport:
        return StageReport(rank=self.rank, ready=ready, num_steps=self.num_steps, meta_digest=self.digest.hexdigest(),
                           busy_s=self.busy_s, speculator=self.speculator, drafter_bytes=self.drafter_bytes)


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
    dist.init_process_group(plan.backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.MAXMSGSIZE, engine_frame_limit(boot.config))  # a larger frame drops the link
    commands.connect(boot.commands[rank])
    reports = ctx.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 2000)
    reports.connect(boot.reports)
    decoder = msgspec.msgpack.Decoder(StageCommand)
    threading.Thread(target=_beat, args=(ctx, boot.reports, rank), daemon=True).start()
    try:
        stage = Stage(boot, rank, world, platform, plan)
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
    stage.link.flush()
    reports.close()
    commands.close(linger=0)
    os._exit(0)  # the process group's teardown can wait on peers that already left


if __name__ == "__main__":
    main()
