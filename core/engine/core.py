"""The engine core: owns the model, the scheduler and the ledger, and runs the step loop.

The loop is plain anyio: messages from the frontend land in a deque while a step runs on a
worker thread (torch releases the GIL), then the result goes through the ledger and the
deltas go out. The same object serves in-process embedding and its own process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import msgspec
import numpy as np

from .. import log, registry
from ..attention import AttentionBackend
from ..config import EngineConfig
from ..errors import InvalidInputError, PromptTooLongError
from ..kernel.block_manager import BlockManager
from ..kernel.frame import StepFrame, StepResult
from ..kernel.grammars import Grammars
from ..kernel.kv_plan import KvPlan, plan_kv_cache
from ..kernel.ledger import Ledger
from ..kernel.request import Request
from ..kernel.scheduler import Scheduler
from ..kernel.spec_governor import SpecGovernor
from ..kernel.spec_policy import SpecPolicy, lookahead_slots, spec_policy
from ..models.checkpoint import load_tokenizer, read_config
from ..models.loader import load_model
from ..models.paged import kv_bytes_per_block
from ..ops.jit_watch import WATCH as JIT_WATCH
from ..platform import parse_dtype
from ..plugin import Speculator, SpeculatorCapabilities, drafting_kind
from ..runner.late_masks import LateMasks
from ..runner.model_runner import ModelRunner
from ..runner.step_graphs import StepGraphs
from ..sampling_params import sampling_params
from ..wire.messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    FrontendMessage,
    Malformed,
    RequestDelta,
    Shutdown,
    UtilityCall,
    UtilityResult,
    check_wire,
)
from .check import Checked, check, check_pipeline
from .data_parallel import IDLE_WAKE_S, DataParallelGroup, Vote, votes_to_skip
from .device_gaps import DeviceGaps
from .fast_path import capture_graphs, use_kernels, warm_kernels
from .heap import frozen_while_serving
from .host_times import HostTimes
from .runner import PendingResult, Runner
from .speculation import Speculation, build_speculator, check_speculator
from .stages import Pipeline

LANDING_POLL_S = 0.002
"""How long the serving loop looks again for a frame it launched before a thread waits for it
(`landing`); a frame launched by a runner thread gets a thread at once."""

SPECULATOR_FAILURE_LIMIT = 8
"""Consecutive steps whose speculator pass raised, after which the engine serves without it."""
DP_VOTES_KEPT = 4096
"""A data-parallel rank's latest votes kept for inspection (tests); its counters count them all."""
DEVICE_SETUP = threading.Lock()
"""Held while a core loads its weights, captures its graphs and warms its kernels. Cores built at
once in one process (in-process data-parallel ranks) would otherwise capture while another
allocates or synchronizes on the same device, which breaks the capture (CUDA's global capture
mode): the engines then ran every step eagerly."""


class InFlight(NamedTuple):
    """A frame handed to its launch, with when it was scheduled (the governor times it)."""

    frame: StepFrame
    started: float
    launched: Future[PendingResult]
    late: LateMasks | None = None
    """Its run-ahead grammar rows' masks, delivered once the frames before it are applied."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        checked = check(config)  # everything knowable without weights, as the frontend checked it
        self.config = config = checked.config
        self.log = log.get("engine_core")
        self.platform = registry.pick_platform(config.platform)
        self.device_apart = self.platform.device.type != "cpu"
        """The device runs a step while the host goes on (the CPU runs it as the host launches it):
        where late masks and launching on the loop pay off by default."""
        self.dtype = parse_dtype(config.dtype) if config.dtype else self.platform.default_dtype()
        self.model_cfg = read_config(checked.path)
        self.kernel_builds_at_ready = 0
        if self.platform.capabilities.triton and JIT_WATCH.install():
            JIT_WATCH.sealed = False  # this engine's start-up builds are expected
        # What the speculator can serve for this target and platform fails here, before any weight is read.
        spec = self._check_speculator(checked)
        k = config.num_speculative_tokens if spec is not None else 0
        caps = spec.caps if spec is not None else None
        with DEVICE_SETUP:  # the device work of start-up, one core at a time per process
            kv = plan_kv_cache(
                config, context=checked.max_model_len,
                target_bytes_per_block=kv_bytes_per_block(self.model_cfg, config.block_size, self.dtype),
                lookahead_slots=lookahead_slots(caps, k),
                draft_kv_bytes_per_token=spec.cls.draft_kv_bytes_per_token(spec.ctx) if spec is not None else 0,
                # Data-parallel ranks on one host share its device: each takes its share of what is
                # free (rank processes start at once, so each would otherwise plan on memory
                # another takes).
                budget_bytes=lambda: self.platform.kv_budget_bytes() // config.data_parallel_size)
            self.kv = kv
            self.max_model_len = kv.max_model_len
            attention = self.platform.attention_backend(config.block_size, config.max_num_batched_tokens,
                                                        max_rows=config.max_num_seqs + 1,
                                                        max_blocks=kv.blocks_per_request(k),
                                                        batch_invariant=config.batch_invariant)
            self.drafts_in_step = spec is not None and drafting_kind(spec.cls) == "in_step"
            """The speculator drafts inside the step (its pass is in the step's graphs): an `InStepSpeculator`."""
            policy = spec_policy(caps, attention, config, in_step=self.drafts_in_step)
            pipeline = config.pipeline_parallel_size > 1
            self.speculator: Speculator | None = None
            self.runner: Runner
            if pipeline:
                # The stages hold the weights, the KV and the drafter; the core keeps the requests.
                if policy is not None:  # the first stage learns a step's drafts from its frame, never ahead of it
                    policy = msgspec.structs.replace(policy, run_ahead=False)
                self.runner = Pipeline(config, checked, kv, k, self.platform.capabilities)
            else:
                self.runner = self._local_runner(checked, spec, kv, k, attention, policy)
            self.scheduler = Scheduler(BlockManager(kv.num_blocks, config.block_size),
                                       config.max_num_seqs, config.max_num_batched_tokens, policy,
                                       async_scheduling=config.async_scheduling, pipeline=pipeline,
                                       prompt_tokens_apart=self._prompt_tokens_apart(),
                                       prompt_steps_per_decode=config.prompt_steps_per_decode,
                                       prompt_batch=self._prompt_batch(),
                                       grammar_drafts=config.forced_drafts(k, caps is not None and caps.sampled_drafts))
            late = config.late_masks if config.late_masks is not None else self.device_apart
            self.scheduler.late_masks_ok = late and config.async_scheduling and not pipeline \
                and config.data_parallel_size == 1
            self.ledger = Ledger(self.scheduler)
            self.governor = self._governor(caps, k)  # times the graphs: on the device too
            if self.governor is not None:
                self.scheduler.draft_gate = self.governor.allow
        self.dp: DataParallelGroup | None = None
        self.dp_votes: deque[Vote] = deque(maxlen=DP_VOTES_KEPT)
        """The latest steps of a data-parallel rank: dummy or not, its K=0 vote, the agreement."""
        self.num_dp_k0_agreed = 0
        if config.data_parallel_size > 1:
            self.dp = DataParallelGroup(config.data_parallel_rank, config.data_parallel_size,
                                        config.data_parallel_port, join_timeout_s=config.startup_timeout_s)
        self.seeds = np.random.default_rng(config.seed)
        self.speculator_failure_limit = SPECULATOR_FAILURE_LIMIT
        self.num_speculator_failures = 0
        """Steps whose speculator pass raised (their target tokens stood; they had no drafts)."""
        self.speculator_failures_in_a_row = 0
        self.speculator_off: str | None = None
        """Why the engine switched its speculator off (the last error), or None while it runs."""
        path = checked.path
        self.grammars = Grammars(lambda: load_tokenizer(path).tok.to_str(), self.model_cfg.vocab_size,
                                 self.model_cfg.eos_token_ids)
        self.compiling: deque[tuple[Request, Future[Any]]] = deque()
        """Structured-output requests whose grammar compiles on the grammar thread, in arrival order."""
        self.inbox: deque[FrontendMessage | Malformed] = deque()
        self.wakeup: anyio.Event | None = None  # made inside the loop that runs the core
        self.running = True
        self.num_steps = 0
        self.gaps = DeviceGaps()
        self.late_pending: dict[int, tuple[InFlight, LateMasks]] = {}
        """Frames in flight whose late masks are not delivered yet, by step id."""
        self.launch_on_loop = False
        """The serving loop launches frames on its own thread (`_launches_on_loop`)."""
        self.num_late_mask_steps = 0
        self.late_mask_wait_s = 0.0
        """How long the late masks held their steps' sampling (the device waited on the host)."""
        self.host = HostTimes()
        self.num_prompt_tokens = 0
        self.started = time.monotonic()
        self.log.info("engine_core_ready", platform=self.platform.name, dtype=str(self.dtype),
                      num_kv_blocks=kv.num_blocks, max_model_len=self.max_model_len, model=str(checked.path))

    def _local_runner(self, checked: Checked, spec: Speculation | None, kv: KvPlan, k: int,
                      attention: AttentionBackend, policy: SpecPolicy | None) -> ModelRunner:
        """The whole target in this process: weights, speculator, runner, graphs."""
        config = self.config
        model = load_model(checked.path, self.dtype, self.platform.device, kv.max_model_len + kv.lookahead_slots)
        self.speculator = self._build_speculator(spec, kv) if spec is not None else None
        runner = ModelRunner(model, self.platform.device, kv.num_blocks, config.block_size, attention,
                             num_slots=config.max_num_seqs, max_model_len=self.max_model_len,
                             speculator=self.speculator, num_speculative_tokens=k,
                             use_triton=self.platform.capabilities.triton,
                             force_host_drafts=config.force_host_drafts,
                             max_num_tokens=config.max_num_batched_tokens,
                             run_ahead=policy is not None and policy.run_ahead,
                             grammar_drafts=config.forced_drafts(k, spec is not None and spec.caps.sampled_drafts))
        use_kernels(model, self.platform, config)
        self.runner = runner
        runner.graphs = self._capture_graphs(runner, spec.caps if spec is not None else None, k)
        self._warm_kernels(runner, k)
        return runner

    def _governor(self, caps: SpeculatorCapabilities | None, k: int) -> SpecGovernor | None:
        """The speculation governor, with its step costs timed on the captured graphs where the
        speculator drafts inside the step (its whole cost is in them); None where it is off."""
        adaptive, graphs = self.config.adaptive_speculation, self.runner.graphs
        timed = caps is not None and self.drafts_in_step and graphs is not None
        if caps is None or adaptive is False or (adaptive is None and not timed):
            return None
        governor = SpecGovernor()
        if timed and graphs is not None:
            governor.step_costs = graphs.step_costs(k, propose=k, plain_propose=0 if caps.supports_k0 else k)
            self.log.info("step_costs", costs={b: [round(1e3 * s, 3) for s in c]
                                               for b, c in governor.step_costs.items()})
        return governor

    def _prompt_graphs(self) -> tuple[list[int], list[tuple[int, int]]]:
        """Token buckets of the captured one-prompt graphs and (rows, tokens) of the several-prompt
        ones: the runner's own, or those every pipeline stage captured."""
        if isinstance(self.runner, Pipeline):
            return self.runner.prompt_graphs
        graphs = self.runner.graphs
        return ([], []) if graphs is None else (graphs.prefill, graphs.prompt_batches)

    def _prompt_tokens_apart(self) -> int:
        """The largest captured prompt graph's tokens, where prompts run apart (0: they share
        steps with decode rows, as they must where no graph serves them anyway)."""
        prefill, _ = self._prompt_graphs()
        if not self.config.prompts_apart or not prefill:
            return 0
        return max(prefill)

    def _prompt_batch(self) -> tuple[int, int]:
        """(rows, tokens) of the largest several-prompt graph, where prompts run apart ((1, 0): none)."""
        _, batches = self._prompt_graphs()
        if not self._prompt_tokens_apart() or not batches:
            return (1, 0)
        return max(r for r, _ in batches), max(t for _, t in batches)

    def close(self) -> None:
        """Stops what the core started (the pipeline's stage processes)."""
        if isinstance(self.runner, Pipeline):
            self.runner.close()

    def _check_speculator(self, checked: Checked) -> Speculation | None:
        """The named speculator's own checks against this target, and what it declares for it."""
        spec = check_speculator(checked, self.model_cfg, self.platform, self.dtype)
        if spec is None:
            return None
        if self.config.pipeline_parallel_size > 1:  # what the class declared was checked before; now this target's
            check_pipeline(self.config, self.model_cfg.num_layers, spec.cls, caps=spec.caps)
        return spec

    def _build_speculator(self, spec: Speculation, kv: KvPlan) -> Speculator:
        return build_speculator(self.config, spec, self.platform, kv.max_model_len, kv.num_blocks, kv.draft_kv_bytes)

    def _capture_graphs(self, runner: ModelRunner, caps: SpeculatorCapabilities | None, k: int) -> StepGraphs | None:
        return capture_graphs(runner, self.platform, self.config, self.max_model_len, k, self.drafts_in_step)

    def _warm_kernels(self, runner: ModelRunner, k: int) -> None:
        builds = warm_kernels(runner, runner.kv_cache[0], self.platform, self.model_cfg.num_heads, k,
                              min(self.config.max_num_batched_tokens, self.max_model_len))
        if self.platform.capabilities.triton:
            self.kernel_builds_at_ready = builds

    def ready_message(self) -> CoreReady:
        return CoreReady(platform=self.platform.name, dtype=str(self.dtype).removeprefix("torch."),
                         max_model_len=self.max_model_len,
                         num_kv_blocks=self.scheduler.blocks.num_blocks,
                         block_size=self.scheduler.blocks.block_size,
                         vocab_size=self.model_cfg.vocab_size)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> RequestDelta | None:
        """Admits a request, or returns its error delta: bad input never reaches the scheduler."""
        if isinstance(msg.prompt_token_ids, list | tuple):  # an in-process caller's list, checked as on the wire
            ids = np.asarray(msg.prompt_token_ids)
            msg = msgspec.structs.replace(msg, prompt_token_ids=ids if ids.size else ids.astype(np.int64))
        try:
            try:
                check_wire(msg)
            except ValueError as e:
                raise InvalidInputError(str(e)) from None
            prompt = msg.prompt_token_ids.tolist()
            if not prompt:
                raise InvalidInputError("prompt is empty")
            if len(prompt) >= self.max_model_len:
                raise PromptTooLongError(
                    f"prompt has {len(prompt)} tokens; the context holds {self.max_model_len} "
                    "(prompt plus at least one generated token)")
            if any(not 0 <= t < self.model_cfg.vocab_size for t in prompt):
                raise InvalidInputError(f"prompt token ids must lie in [0, {self.model_cfg.vocab_size})")
            params = sampling_params(msg.params, self.model_cfg.vocab_size,
                                     pipeline=self.config.pipeline_parallel_size > 1)
            if msg.key in self.scheduler.requests:
                raise InvalidInputError(f"request key {msg.key} is already running")
        except InvalidInputError as e:
            return RequestDelta(msg.key, [], "error", f"{type(e).__name__}: {e}")
        seed = params.seed if params.seed is not None else int(self.seeds.integers(2**62))
        req = Request(msg.key, prompt, params, seed, self.model_cfg.eos_token_ids, self.max_model_len)
        self.num_prompt_tokens += len(prompt)
        if params.structured is not None:
            self.compiling.append((req, self.grammars.compile(params.structured)))
        else:
            self.scheduler.add(req)
        return None

    def admit_compiled(self, wait: bool = False) -> list[RequestDelta]:
        """Hands the requests whose grammar has compiled to the scheduler, in arrival order (with
        wait, waits for them all); a grammar that failed fails its request."""
        errors: list[RequestDelta] = []
        while self.compiling and (wait or self.compiling[0][1].done()):
            req, compiled = self.compiling.popleft()
            if req.finish_reason == "abort":
                continue
            try:
                req.attach_grammar(self.grammars.matcher(compiled))
            except Exception as e:
                self.log.warning("grammar_failed", key=req.key, error=str(e))
                errors.append(RequestDelta(req.key, [], "error", f"InvalidSamplingParamsError: {e}"))
                continue
            self.scheduler.add(req)
        return errors

    def abort(self, keys: list[int]) -> None:
        for key in keys:
            req = self.scheduler.requests.get(key)
            if req is not None:
                self.scheduler.finish(req, "abort")
        for req, _ in self.compiling:
            if req.key in keys:
                req.cancel()

    def stats(self) -> dict[str, Any]:
        blocks = self.scheduler.blocks
        parallel = self._parallel_stats()
        return {
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.compiling),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.ledger.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_stale_rows": self.ledger.num_stale_rows,
            "num_async_rows": self.ledger.num_async_rows,
            "num_graph_steps": self._graph_steps(parallel),
            "num_kernel_builds_after_warmup": JIT_WATCH.num_compiles - self.kernel_builds_at_ready,
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free,
            "uptime_s": time.monotonic() - self.started,
            **self.gaps.stats(),
            "num_late_mask_steps": self.num_late_mask_steps,
            "late_mask_wait_s": self.late_mask_wait_s,
            **self.host.stats(),
            "device_s": self.runner.device_s,
            **parallel,
            "spec": self.ledger.spec.summary() | {
                "speculator": self.config.speculator,
                "num_speculative_tokens": self.scheduler.spec.num_speculative_tokens if self.scheduler.spec else 0,
                "num_k0_steps": self.ledger.num_k0_steps,
                "num_host_draft_copies": self.ledger.num_host_draft_copies,
                "num_governor_vetoes": self.governor.num_vetoed if self.governor is not None else 0,
                "num_invalid_drafts": self.scheduler.num_invalid_drafts,
                "num_speculator_failures": self.num_speculator_failures,
                "speculator_off": self.speculator_off is not None,
                "speculator_off_error": self.speculator_off,
                "plugin": _plugin_stats(self.speculator),
            },
        }

    def _graph_steps(self, parallel: dict[str, Any]) -> int:
        """Steps replayed as device graphs: this process's, or under pipeline stages the last stage's
        (0 while no stage has reported)."""
        if self.runner.graphs is not None:
            return self.runner.graphs.num_replays
        per_stage = parallel.get("pipeline", {}).get("num_graph_steps", [])
        return int(per_stage[-1]) if per_stage else 0

    def _parallel_stats(self) -> dict[str, Any]:
        """Per stage: the seconds it ran steps (the rest were bubbles); per data-parallel rank: its
        steps, dummy steps, padding it skipped, and the seconds of its turns and of its votes."""
        found: dict[str, Any] = {}
        if isinstance(self.runner, Pipeline):
            reports, _ = self.runner.digests()
            found["pipeline"] = {"stages": len(reports), "transport": self.runner.transport,
                                 "busy_s": [r.busy_s for r in reports],
                                 "num_steps": [r.num_steps for r in reports],
                                 "num_graph_steps": [r.num_graph_steps for r in reports]}
        if self.dp is not None:
            found["data_parallel"] = self.dp.stats() | {"num_k0_agreed": self.num_dp_k0_agreed}
        return found

    # --- stepping ---------------------------------------------------------------------------

    def execute(self, frame: StepFrame) -> StepResult:
        return self.runner.execute(frame)  # a failing row fails its own request only

    def step(self) -> list[RequestDelta]:
        """One synchronous step (tests and the sync path of the loop share it)."""
        errors = self.admit_compiled(wait=not self.scheduler.requests)
        frame = self.scheduler.schedule()
        if frame is None:
            return errors
        self.ledger.submit(frame)
        started = time.perf_counter()
        return errors + self._apply(self.execute(frame), frame, started)

    def _apply(self, result: StepResult, frame: StepFrame | None = None, started: float = 0.0) -> list[RequestDelta]:
        """Applies a step's result; with its frame and launch time, the governor learns from it."""
        with self.host.timed("apply"):
            return self._apply_result(result, frame, started)

    def _apply_result(self, result: StepResult, frame: StepFrame | None, started: float) -> list[RequestDelta]:
        self.num_steps += 1
        self._count_speculator(result.speculator_error)
        before = self.ledger.num_generated_tokens
        deltas = self.ledger.apply(result)
        if self.governor is not None and frame is not None and all(
                r.sampling is not None and r.num_tokens == 1 + r.num_drafts for r in frame.rows):
            # Decode and verification steps only: a prefill chunk's cost says nothing about drafts.
            self.governor.record(len(frame.rows), any(r.num_drafts for r in frame.rows),
                                 self.ledger.num_generated_tokens - before, time.perf_counter() - started)
        if self.governor is not None and frame is not None:
            verified = [out.num_accepted + 1 for row, out in zip(frame.rows, result.rows, strict=True)
                        if row.num_drafts and row.sampling is not None and out.error is None]
            self.governor.record_rows(len(verified), sum(verified))
        return deltas

    def _count_speculator(self, error: str | None) -> None:
        """A speculator whose pass raised on `speculator_failure_limit` steps in a row is switched
        off for the engine: the scheduler drafts no more and the runner never calls it again.
        The requests go on without drafts (their output is the target's either way)."""
        if error is None:
            self.speculator_failures_in_a_row = 0
            return
        self.num_speculator_failures += 1
        self.speculator_failures_in_a_row += 1
        if self.speculator_off is not None or self.speculator_failures_in_a_row < self.speculator_failure_limit:
            return
        self.speculator_off = error
        self.scheduler.stop_speculation()
        self.runner.stop_speculation()
        self.log.warning("speculator_switched_off", speculator=self.config.speculator,
                         failed_steps=self.speculator_failures_in_a_row, error=error,
                         detail="every step's speculator pass raised; requests continue without drafts")

    # --- the loop ---------------------------------------------------------------------------

    def deliver(self, msg: FrontendMessage | Malformed) -> None:
        self.inbox.append(msg)
        if self.wakeup is not None:
            self.wakeup.set()

    def _handle_inbox(self) -> tuple[list[RequestDelta], list[UtilityResult]]:
        """Total: a message that fails to apply is logged with its traceback and answered with an
        error where it has a key or call id; it never ends the loop."""
        errors: list[RequestDelta] = []
        results: list[UtilityResult] = []
        while self.inbox:
            msg = self.inbox.popleft()
            try:
                self._handle(msg, errors, results)
            except Exception as e:
                self.log.exception("message_failed", message=type(msg).__name__)
                self._refuse(type(msg).__name__, getattr(msg, "key", getattr(msg, "call_id", None)),
                             f"{type(e).__name__}: {e}", errors, results)
        return errors, results

    def _handle(self, msg: FrontendMessage | Malformed, errors: list[RequestDelta],
                results: list[UtilityResult]) -> None:
        match msg:
            case AddRequest():
                delta = self.add_request(msg)
                if delta is not None:
                    errors.append(delta)
            case AbortRequests(keys=ids):
                self.abort(ids)
            case UtilityCall(call_id=cid, method=method):
                if method == "stats":
                    results.append(UtilityResult(cid, self.stats()))
                else:
                    results.append(UtilityResult(cid, error=f"unknown utility method {method!r}"))
            case Shutdown():
                self.running = False
            case Malformed(kind=kind, ident=ident, error=error):
                self._refuse(kind, ident, f"malformed {kind or 'message'} frame: {error}", errors, results)

    def _refuse(self, kind: str, ident: int | None, error: str, errors: list[RequestDelta],
                results: list[UtilityResult]) -> None:
        """Fails the request or call a bad message names, so its caller does not wait for ever."""
        if ident is None:
            return
        if kind == "AddRequest" and ident not in self.scheduler.requests:
            errors.append(RequestDelta(ident, [], "error", f"InvalidInputError: {error}"))
        elif kind == "UtilityCall":
            results.append(UtilityResult(ident, error=error))

    async def run(self, emit: Callable[[CoreMessage], Awaitable[None]]) -> None:
        """Steps until a Shutdown message arrives; `emit` sends a message to the frontend.

        Each turn answers the inbox, schedules frames (up to `pipeline_depth` in flight, launched
        in order by one thread: this loop's where `launch_on_loop` holds, a runner thread's
        otherwise), then takes the oldest frame's result (`landing`: on the loop where its copy
        has reached the host or soon does, else from a worker thread that waits) and applies it.
        At depth 2 frame N+1 is scheduled and launched while frame N runs; results are applied
        in step order all the same. With nothing to run, the loop sleeps until a message comes."""
        with frozen_while_serving():
            await self._serve(emit)

    async def _serve(self, emit: Callable[[CoreMessage], Awaitable[None]]) -> None:
        self.wakeup = anyio.Event()
        if self.dp is not None:
            try:
                await self._run_data_parallel(emit, self.dp)
            finally:
                self.close()
            return
        depth = self.pipeline_depth()
        self.launch_on_loop = self._launches_on_loop(depth)
        in_flight: deque[InFlight] = deque()
        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speckernel-runner")
        try:
            while self.running:
                await self._answer_inbox(emit)
                if not self.running:
                    break
                if self.compiling and (refused := self.admit_compiled()):
                    await emit(CoreOutputs(refused))
                while len(in_flight) < depth and (frame := self._schedule()) is not None:
                    in_flight.append(self._submit(frame, runner))
                if not in_flight:
                    self.gaps.no_work()
                    await self._idle()
                    continue
                oldest = in_flight.popleft()
                result = await landing(oldest.launched, LANDING_POLL_S if self.launch_on_loop else 0.0)
                self.gaps.applied(len(in_flight))
                deltas = self._apply(result, oldest.frame, oldest.started)
                self._deliver_late_masks(result.step_id, oldest.late)
                if deltas:
                    await emit(CoreOutputs(deltas))
        finally:
            for _, late in self.late_pending.values():
                late.release()
            self.late_pending.clear()
            runner.shutdown(wait=True, cancel_futures=True)
            self.grammars.close()
            self.close()

    async def _run_data_parallel(self, emit: Callable[[CoreMessage], Awaitable[None]], dp: DataParallelGroup) -> None:
        """Lockstep with the other ranks, overlapped as the single loop is: each turn schedules a
        frame (or none: a dummy step), joins the one all-reduce, launches the frame with the
        agreed K=0 flag on the runner thread, and waits for the oldest frame only once
        `pipeline_depth` are in flight. At depth 2 the next frame is scheduled and voted on while
        the device runs the one before. With no work anywhere the ranks idle until a message
        reaches any of them; a rank told to shut down makes them all stop at the same turn."""
        depth = self.pipeline_depth()
        in_flight: deque[InFlight] = deque()
        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speckernel-runner")
        try:
            while True:
                await self._answer_inbox(emit)
                if self.compiling and (refused := self.admit_compiled()):
                    await emit(CoreOutputs(refused))
                frame = self._schedule() if self.running and len(in_flight) < depth else None
                skip = votes_to_skip(frame)
                has_work = frame is not None or bool(in_flight) or bool(self.scheduler.requests)
                agreed = await anyio.to_thread.run_sync(
                    dp.agree, len(frame.rows) if frame is not None else 0, not skip, has_work, not self.running)
                if agreed.stopping:
                    return
                self.dp_votes.append(Vote(frame is None, skip, agreed.skip_drafts))
                self.num_dp_k0_agreed += agreed.skip_drafts
                if frame is not None:
                    if not agreed.skip_drafts:
                        frame = self.scheduler.draft_anyway(frame)  # a peer drafts this step: so does this rank
                    self.ledger.submit(frame)
                    in_flight.append(InFlight(frame, time.perf_counter(), runner.submit(self._launch, frame)))
                elif agreed.any_work:
                    dp.num_dummy_steps += 1  # nothing to launch here; the step is the vote
                if in_flight and (frame is None or len(in_flight) >= depth):
                    oldest = in_flight.popleft()
                    result = await anyio.to_thread.run_sync(_finish, oldest.launched)
                    self.gaps.applied(len(in_flight))
                    deltas = self._apply(result, oldest.frame, oldest.started)
                    if deltas:
                        await emit(CoreOutputs(deltas))
                elif not in_flight and not agreed.any_work:
                    self.gaps.no_work()
                    await self._idle_data_parallel(dp)
        finally:
            runner.shutdown(wait=True, cancel_futures=True)
            self.grammars.close()

    async def _idle_data_parallel(self, dp: DataParallelGroup) -> None:
        """No rank has work: waits until a message reaches this rank or any other (a peer that
        gets one wakes the rest through the store), or IDLE_WAKE_S passes; then the ranks vote."""
        key = dp.wake_key()
        async with anyio.create_task_group() as tg:
            async def mine() -> None:
                await self._idle()
                await anyio.to_thread.run_sync(dp.wake, key)  # ends every rank's wait, this one's too

            async def theirs() -> None:
                await anyio.to_thread.run_sync(dp.wait_for_wake, key, IDLE_WAKE_S)
                tg.cancel_scope.cancel()

            tg.start_soon(mine)
            tg.start_soon(theirs)

    def _schedule(self) -> StepFrame | None:
        with self.host.timed("schedule"):
            return self.scheduler.schedule()

    def _submit(self, frame: StepFrame, runner: ThreadPoolExecutor) -> InFlight:
        """The frame to the ledger and to its launch (`_start`). A frame with rows run ahead under a
        grammar gets late masks: its launch stages them behind a gate that `_deliver_late_masks`
        opens."""
        self.ledger.submit(frame)
        late = None
        if any(r.mask_later for r in frame.rows):
            assert isinstance(self.runner, ModelRunner), "late masks need the runner in this process"
            late = self.runner.late_masks[frame.step_id] = LateMasks(self.platform.host_gate())
        submitted = InFlight(frame, time.perf_counter(), self._start(frame, runner), late)
        if late is not None:
            self.late_pending[frame.step_id] = (submitted, late)
        return submitted

    def _start(self, frame: StepFrame, runner: ThreadPoolExecutor) -> Future[PendingResult]:
        """The frame's launch: here, on the loop's thread, where `launch_on_loop` holds; on the
        runner thread otherwise. Either way a failed launch is the future's exception."""
        if not self.launch_on_loop:
            return runner.submit(self._launch, frame)
        launched: Future[PendingResult] = Future()
        try:
            launched.set_result(self._launch(frame))
        except Exception as e:
            launched.set_exception(e)
        return launched

    def _deliver_late_masks(self, applied: int, late: LateMasks | None) -> None:
        """Step `applied` was applied (late: its own late masks, now passed): the late masks of
        every frame whose rows read nothing later are computed (the grammars consume the tokens
        just applied) and delivered."""
        if late is not None:
            self.num_late_mask_steps += 1
            self.late_mask_wait_s += late.held_s
        for step_id, (pending, waiting) in list(self.late_pending.items()):
            if all(r.prev_step_id <= applied for r in pending.frame.rows if r.mask_later):
                with self.host.timed("masks"):
                    masks = self.scheduler.late_masks(pending.frame)
                waiting.deliver(masks, pending.launched.done)
                del self.late_pending[step_id]

    def _launch(self, frame: StepFrame) -> PendingResult:
        """A frame's launch, timed (its host time, and the device's gaps)."""
        with self.host.timed("launch"):
            pending = self.runner.launch(frame)
        self.host.num_rows += len(frame.rows)
        self.gaps.launched()
        return pending

    def _launches_on_loop(self, depth: int) -> bool:
        """`EngineConfig.launch_on_loop` where it applies: frames run ahead (depth 2) on a runner
        in this process whose launches never wait for the device (the CPU runs the step as it
        launches it, and a gate that blocks the issuing thread waits for a host this loop is)."""
        return (self.config.launch_on_loop and depth == 2 and isinstance(self.runner, ModelRunner)
                and self.device_apart and not self.platform.host_gate().blocks_host)

    def pipeline_depth(self) -> int:
        """Frames in flight at once: 2 with async scheduling, where requests can run ahead. A
        speculative request without run-ahead waits for its frame, and a second frame would then
        hold only the rest of the batch, halving every step."""
        spec = self.scheduler.spec
        if self.scheduler.pipeline:  # the batch queue: a frame per stage, with async scheduling
            return self.config.pipeline_parallel_size if self.scheduler.async_scheduling else 1
        return 2 if self.scheduler.async_scheduling and (spec is None or spec.run_ahead) else 1

    async def _answer_inbox(self, emit: Callable[[CoreMessage], Awaitable[None]]) -> None:
        """Applies every queued message; sends the utility results, then the refused requests."""
        errors, results = self._handle_inbox()
        for r in results:
            await emit(r)
        if errors:
            await emit(CoreOutputs(errors))

    async def _idle(self) -> None:
        """Nothing to run: waits for a message (unless one came meanwhile), then re-arms the wakeup."""
        assert self.wakeup is not None
        if self.compiling:  # a grammar compiles on its thread: look again soon
            with anyio.move_on_after(0.002):
                await self.wakeup.wait()
        elif not self.inbox:
            await self.wakeup.wait()
        self.wakeup = anyio.Event()


def _plugin_stats(speculator: Speculator | None) -> dict[str, float]:
    """The speculator's own counters (`SpeculatorBase.stats`); none from a plugin without them."""
    stats = getattr(speculator, "stats", None)
    return dict(stats()) if callable(stats) else {}


def _landed(launched: Future[PendingResult]) -> bool:
    """The step's result needs no wait: its copy has reached the host (a full batch, where the
    host sets the pace, finds its frames landed long before it gets to them), or its launch failed
    and the error is there to raise."""
    return launched.done() and (launched.exception() is not None or launched.result().ready())


async def landing(launched: Future[PendingResult], poll_s: float) -> StepResult:
    """A launched frame's result. The loop looks again for up to poll_s between its other tasks
    (the frontend streams meanwhile) before a worker thread waits: where the loop launched the
    frame, one due within a fraction of a step is taken without the thread hop, whose two wake-ups
    cost a batch-1 step a tenth of its time."""
    deadline = time.perf_counter() + poll_s
    while not _landed(launched):
        if time.perf_counter() >= deadline:
            return await anyio.to_thread.run_sync(_finish, launched)
        await anyio.lowlevel.cancel_shielded_checkpoint()  # as uncancellable as the thread's wait
    return _finish(launched)


def _finish(launched: Future[PendingResult]) -> StepResult:
    """Waits for the step's launch, then for the device to run it."""
    return launched.result().result()
