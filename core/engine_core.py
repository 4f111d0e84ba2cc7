"""The engine core: owns the model, the scheduler and the ledger, and runs the step loop.

The loop is plain anyio: messages from the frontend land in a deque while a step runs on a
worker thread (torch releases the GIL), then the result goes through the ledger and the
deltas go out. The same object serves in-process embedding and its own process.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

from . import log, plugins
from .block_manager import BlockManager
from .config import EngineConfig
from .errors import InvalidInputError, PromptTooLongError
from .frame import RowResult, StepFrame, StepResult
from .ledger import Ledger
from .messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    FrontendMessage,
    RequestDelta,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from .model_runner import ModelRunner
from .models.builtin import resolve
from .models.loader import load_model, read_config
from .platform import parse_dtype
from .request import Request
from .scheduler import Scheduler

DEFAULT_MAX_MODEL_LEN = 4096
CPU_KV_BUDGET = 1 << 30
DEVICE_KV_FRACTION = 0.5


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        self.log = log.get("engine_core")
        self.platform = plugins.pick_platform(config.platform)
        self.dtype = parse_dtype(config.dtype) if config.dtype else self.platform.default_dtype()
        path = resolve(config.model)
        model_cfg = read_config(path)
        max_len = min(config.max_model_len or min(model_cfg.max_position, DEFAULT_MAX_MODEL_LEN),
                      model_cfg.max_position)
        per_block = ModelRunner.kv_bytes_per_block(model_cfg, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or self._blocks_from_budget(per_block)
        # One request must always fit alone, or preemption could never make progress.
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        self.model_cfg = model_cfg
        model = load_model(path, self.dtype, self.platform.device, self.max_model_len)
        self.runner = ModelRunner(model, self.platform.device, num_blocks, config.block_size)
        self.scheduler = Scheduler(BlockManager(num_blocks, config.block_size),
                                   config.max_num_seqs, config.max_num_batched_tokens)
        self.ledger = Ledger(self.scheduler)
        self.seeds = np.random.default_rng(config.seed)
        self.inbox: deque[FrontendMessage] = deque()
        self.wakeup: anyio.Event | None = None  # made inside the loop that runs the core
        self.running = True
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.started = time.monotonic()
        self.log.info("engine_core_ready", platform=self.platform.name, dtype=str(self.dtype),
                      num_kv_blocks=num_blocks, max_model_len=self.max_model_len, model=str(path))

    def _blocks_from_budget(self, per_block: int) -> int:
        budget = self.config.kv_cache_bytes
        if budget is None:
            free, _ = self.platform.memory_info()
            cpu = self.platform.capabilities.device_type == "cpu"
            budget = min(CPU_KV_BUDGET, free // 4) if cpu else int(free * DEVICE_KV_FRACTION)
        return max(1, budget // per_block)

    def ready_message(self) -> CoreReady:
        return CoreReady(platform=self.platform.name, dtype=str(self.dtype).removeprefix("torch."),
                         max_model_len=self.max_model_len,
                         num_kv_blocks=self.scheduler.blocks.num_blocks,
                         block_size=self.scheduler.blocks.block_size,
                         vocab_size=self.model_cfg.vocab_size)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> RequestDelta | None:
        """Admits a request, or returns its error delta: bad input never reaches the scheduler."""
        try:
            prompt = [int(t) for t in msg.prompt_token_ids]
            if not prompt:
                raise InvalidInputError("prompt is empty")
            if len(prompt) >= self.max_model_len:
                raise PromptTooLongError(
                    f"prompt has {len(prompt)} tokens; the context holds {self.max_model_len} "
                    "(prompt plus at least one generated token)")
            if any(not 0 <= t < self.model_cfg.vocab_size for t in prompt):
                raise InvalidInputError(f"prompt token ids must lie in [0, {self.model_cfg.vocab_size})")
            params = msg.params.validate(self.model_cfg.vocab_size)
            if msg.req_id in self.scheduler.requests:
                raise InvalidInputError(f"request id {msg.req_id!r} is already running")
        except InvalidInputError as e:
            return RequestDelta(msg.req_id, [], "error", f"{type(e).__name__}: {e}")
        seed = params.seed if params.seed is not None else int(self.seeds.integers(2**62))
        self.scheduler.add(Request(msg.req_id, prompt, params, seed, self.model_cfg.eos_token_ids,
                                   self.max_model_len))
        self.num_prompt_tokens += len(prompt)
        return None

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                self.scheduler.finish(req, "abort")

    def stats(self) -> dict[str, Any]:
        blocks = self.scheduler.blocks
        return {
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.ledger.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_stale_rows": self.ledger.num_stale_rows,
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free,
            "uptime_s": time.monotonic() - self.started,
            "spec": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                     "num_k0_steps": 0, "num_host_draft_copies": 0},
        }

    # --- stepping ---------------------------------------------------------------------------

    def execute(self, frame: StepFrame) -> StepResult:
        try:
            return self.runner.execute(frame)
        except Exception as e:  # a failed step fails its rows; the engine keeps serving
            self.log.exception("step_failed", step_id=frame.step_id)
            rows = [RowResult(r.req_id, r.generation, []) for r in frame.rows]
            return StepResult(frame.step_id, rows, error=f"{type(e).__name__}: {e}")

    def step(self) -> list[RequestDelta]:
        """One synchronous step (tests and the sync path of the loop share it)."""
        frame = self.scheduler.schedule()
        if frame is None:
            return []
        self.ledger.submit(frame)
        return self._apply(self.execute(frame))

    def _apply(self, result: StepResult) -> list[RequestDelta]:
        self.num_steps += 1
        return self.ledger.apply(result)

    # --- the loop ---------------------------------------------------------------------------

    def deliver(self, msg: FrontendMessage) -> None:
        self.inbox.append(msg)
        if self.wakeup is not None:
            self.wakeup.set()

    def _handle_inbox(self) -> tuple[list[RequestDelta], list[UtilityResult]]:
        errors: list[RequestDelta] = []
        results: list[UtilityResult] = []
        while self.inbox:
            msg = self.inbox.popleft()
            match msg:
                case AddRequest():
                    delta = self.add_request(msg)
                    if delta is not None:
                        errors.append(delta)
                case AbortRequests(req_ids=ids):
                    self.abort(ids)
                case UtilityCall(call_id=cid, method=method):
                    if method == "stats":
                        results.append(UtilityResult(cid, self.stats()))
                    else:
                        results.append(UtilityResult(cid, error=f"unknown utility method {method!r}"))
                case Shutdown():
                    self.running = False
        return errors, results

    async def run(self, emit: Callable[[CoreMessage], Awaitable[None]]) -> None:
        """Steps until a Shutdown message arrives; `emit` sends a message to the frontend."""
        self.wakeup = anyio.Event()
        while self.running:
            errors, results = self._handle_inbox()
            for r in results:
                await emit(r)
            if errors:
                await emit(CoreOutputs(errors))
            if not self.running:
                break
            frame = self.scheduler.schedule()
            if frame is None:
                if not self.inbox:
                    await self.wakeup.wait()
                self.wakeup = anyio.Event()
                continue
            self.ledger.submit(frame)
            result = await anyio.to_thread.run_sync(self.execute, frame)
            deltas = self._apply(result)
            if deltas:
                await emit(CoreOutputs(deltas))

