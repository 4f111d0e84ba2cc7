"""Runs one StepFrame on the device: forward, sample or verify, then the speculator's pass.

The host packs a step's plan (`step_plan.STEP`: each row's slot, draft count, output position
and sampling values; positions, slots, block tables; the host-known tokens) into one staging
array, copied to the device in one go (`AttentionBackend.prepare`). Everything else is derived
on the device: input ids gathered from the token buffer, logit positions, draft ids, where
outputs go. So the device part of a step has fixed shapes once padded, and a captured graph
(`StepGraphs`) replays it for every decode or verification step of its size.

`_launch` reads top to bottom: shape, plan, the drafting pass's work before the step, the step
(replayed or eager), its copy to the host, the drafting pass's work after it. The only
device-to-host transfer of a step is its sampled tokens and accepted counts (and the next drafts
where the host must see them), copied into pinned memory behind an event (`host_copy.StepCopy`):
`launch` returns before the device has run the step unless the speculator drafts after the step
(`drafting.AfterStepDrafting` waits for the counts), and `finish` folds the copy and the
drafting pass's outcome into the row results. With run-ahead, a row scheduled before its
predecessor's accepted counts reached the host is planned as if every draft was accepted
(`ScheduledRow.shifted`), and the device moves it back by the drafts that predecessor rejected.

A failure is scoped to rows: when launching a step raises, its rows run again one by one
and only the rows that fail alone fail; a row whose predecessor step did not complete for its
slot fails without running. A failure of the speculator's own pass fails no row: the target's
tokens of the step stand, the drafts it would have proposed are -1 (never accepted), and the
step result says so (`StepResult.speculator_error`), so the engine can count it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from .. import log as logmod
from ..attention import AttentionBackend, AttentionMetadata
from ..kernel.frame import RowResult, ScheduledRow, StepFrame, StepResult
from ..models.llama import LlamaModel
from ..models.paged import new_kv_cache
from ..outputs import TokenLogprobs
from ..plugin import Speculator, TargetModel
from .drafting import DraftingPass, NoDrafting, drafting_pass
from .host_copy import StepCopy, draft_lists
from .late_masks import LateMasks
from .penalties import count_history
from .sampler import SamplingTensors, sample_on_device, token_logprobs
from .step_graphs import StepGraphs
from .step_plan import STEP, Col
from .step_shape import DeviceOutputs, DraftingDeps, DraftOutcome, StepShape
from .token_masks import TokenMasks
from .token_pool import TokenPool
from .verify import drafted_counts, verify

log = logmod.get("runner")


def logprobs_of(values: list[list[float]], ids: list[list[int]], count: int, top: int) -> list[TokenLogprobs]:
    """One row's first `count` output positions as TokenLogprobs, each with its `top` alternatives
    (the step computed as many as its most demanding row asked for)."""
    return [TokenLogprobs(v[0], t[:top], v[1 : 1 + top]) for v, t in zip(values[:count], ids[:count], strict=True)]


class PendingStep:
    """A launched step: its RowResults once the device has run it."""

    def __init__(self, finish: Callable[[], StepResult], ready: Callable[[], bool] = lambda: True) -> None:
        self._finish = finish
        self._ready = ready
        self._result: StepResult | None = None

    def ready(self) -> bool:
        """`result` would not wait for the device (asks it; never waits)."""
        return self._result is not None or self._ready()

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, num_blocks: int, block_size: int,
                 attention: AttentionBackend, num_slots: int, max_model_len: int,
                 speculator: Speculator | None = None, num_speculative_tokens: int = 0, use_triton: bool = False,
                 force_host_drafts: bool = False, max_num_tokens: int = 0, run_ahead: bool = False,
                 kv_layers: int | None = None, grammar_drafts: int = 0) -> None:
        self.model = model
        self.device = device
        self.attention = attention
        kv_cfg = model.cfg if kv_layers is None else msgspec.structs.replace(model.cfg, num_layers=kv_layers)
        self.kv_cache = new_kv_cache(kv_cfg, num_blocks, block_size, model.embed.weight.dtype, device)
        self.use_triton = use_triton
        self.num_slots = num_slots
        # The plan buffer never moves under captured graphs.
        k = num_speculative_tokens
        width = max(k, grammar_drafts)  # the drafts a row verifies: a speculator's, or a grammar's forced tokens
        tokens = max(max_num_tokens, num_slots * (width + 1))
        self.max_tokens = tokens
        """The most tokens a step (padded or not) holds."""
        attention.reserve(tokens, num_slots, STEP.int_width, 3 * tokens, STEP.float_width)
        # Room for the context, K drafts past it, and one spare column that catches padding;
        # one spare row takes what padding rows of a device graph write.
        self.pool = TokenPool(num_slots + 1, max_model_len + k + 2, device)
        self.pool.tokens[num_slots] = 0  # padding rows read their inputs there: any valid id
        self.run_ahead = run_ahead
        """Rows may be shifted (planned before their predecessor's accepted counts were known)."""
        self.rejected = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        """Per slot: drafts its latest step rejected, by which a shifted successor moves back."""
        caps = speculator.capabilities if speculator is not None else None
        self.hidden_layers = caps.target_hidden_layers if caps is not None else ()
        deps = DraftingDeps(self.pool, device, model.cfg.vocab_size, force_host_drafts=force_host_drafts)
        if caps is not None and caps.sampled_drafts:
            deps.draft_probs = torch.zeros(num_slots + 1, max(k, 1), model.cfg.vocab_size, device=device)
        if caps is not None and (caps.uses_target_kv or caps.uses_target_weights):
            weights = caps.uses_target_weights
            deps.target = TargetModel(model.cfg, model.embed if weights else None, model.norm if weights else None,
                                      model.logits if weights else None,
                                      self.kv_cache if caps.uses_target_kv else None)
        self.deps = deps
        self.drafting: DraftingPass = drafting_pass(speculator, deps)
        """The speculator's pass for its kind (NoDrafting without one, or once it is switched off)."""
        self.masks = TokenMasks(num_slots + 1, width + 1, model.cfg.vocab_size, device, pinned=device.type != "cpu")
        """The grammars' bitmasks of the step, where its graphs (and eager steps) read them."""
        self.mask_widths: tuple[int, ...] = (0, width) if width else (0,)
        """Verify widths of the steps with a grammar that graphs may serve (none where the step
        does not sample: a pipeline stage before the last)."""
        self.late_masks: dict[int, LateMasks] = {}
        """Steps whose run-ahead grammar rows get their masks after launch, by step id: the engine
        puts one here before it submits the frame, the launch takes it."""
        self.graphs: StepGraphs | None = None
        """Captured decode and verification steps, when the engine captured them."""
        self.device_s: float | None = None if device.type == "cpu" else 0.0
        """Device time of the steps run here, from events around each step's device work (None on
        the CPU, where a step runs inside its launch)."""
        self.isolate_speculator = True
        """A raising speculator pass costs the step its drafts only (off while graphs are captured:
        a graph must hold the real pass, so a pass that raises there fails the capture)."""

    @property
    def speculator(self) -> Speculator | None:
        return self.drafting.speculator

    # --- launching -------------------------------------------------------------------------

    def execute(self, frame: StepFrame) -> StepResult:
        return self.launch(frame).result()

    @torch.inference_mode()
    def launch(self, frame: StepFrame) -> PendingStep:
        results: list[RowResult | None] = [None] * len(frame.rows)
        runnable = []
        for i, row in enumerate(frame.rows):
            if row.prev_step_id >= 0 and not self.pool.ran(row.slot, row.generation, row.prev_step_id):
                results[i] = self._failed(row, f"step {row.prev_step_id}, whose output this row reads, failed")
            else:
                runnable.append(i)
        parts = self._run(frame, runnable, results)

        def finish() -> StepResult:
            k0, copies, spec_error = frame.skip_drafts if not runnable else False, 0, None
            for idx, pending in parts:
                out = pending.result()
                for i, row in zip(idx, out.rows, strict=True):
                    results[i] = row
                k0, copies = k0 or out.k0, copies + out.num_host_draft_copies
                spec_error = spec_error or out.speculator_error
            return StepResult(frame.step_id, [r for r in results if r is not None], k0=k0,
                              num_host_draft_copies=copies, speculator_error=spec_error)

        return PendingStep(finish, lambda: all(pending.ready() for _, pending in parts))

    def _run(self, frame: StepFrame, idx: list[int],
             results: list[RowResult | None]) -> list[tuple[list[int], PendingStep]]:
        """Launches rows idx of frame; rows that fail to launch get their error in results."""
        if not idx:
            return []
        try:
            return [(idx, self._launch(msgspec.structs.replace(frame, rows=[frame.rows[i] for i in idx])))]
        except Exception as e:
            log.exception("step_rows_failed", step_id=frame.step_id, rows=len(idx))
            if len(idx) == 1:
                results[idx[0]] = self._failed(frame.rows[idx[0]], f"{type(e).__name__}: {e}")
                return []
            # Rows are independent (KV and token-buffer writes depend only on the row), so each
            # runs again alone: only the rows that fail by themselves fail.
            return [part for i in idx for part in self._run(frame, [i], results)]

    def _failed(self, row: ScheduledRow, error: str) -> RowResult:
        self.pool.failed(row.slot)
        return RowResult(row.key, row.generation, [], row.num_drafts, error=error)

    def step_shape(self, frame: StepFrame) -> StepShape:
        """The step's shape before padding, and whether it is a decode/verify step graphs fit."""
        rows = frame.rows
        sampling = [r.sampling for r in rows if r.sampling is not None]
        return StepShape(rows=len(rows), tokens=frame.num_tokens,
                         verify_width=max((r.num_drafts for r in rows), default=0),
                         max_query_len=max((r.num_tokens for r in rows), default=0),
                         all_greedy=all(s.temperature == 0.0 for s in sampling),
                         any_filter=any(s.top_k > 0 or s.top_p < 1.0 for s in sampling),
                         any_penalty=any(s.penalized for s in sampling),
                         decode_like=all(r.sampling is not None and r.num_tokens == 1 + r.num_drafts for r in rows),
                         propose_width=self.drafting.propose_width(frame),
                         logprobs=max((s.logprobs for s in sampling), default=-1),
                         constrained=bool(self.mask_widths) and any(r.token_bitmask or r.mask_later for r in rows))

    def plan(self, frame: StepFrame, padded: StepShape | None) -> AttentionMetadata:
        """Packs the step's plan (padded to a captured shape, if given) and sends it to the device
        in one copy."""
        rows = frame.rows
        plan = STEP.empty(padded.rows if padded is not None and padded.rows > len(rows) else len(rows))
        STEP.put(plan, Col.SLOT, self.num_slots)  # padding rows: the spare row of the token buffer
        n = len(rows)
        STEP.put(plan, Col.SLOT, [r.slot for r in rows], slice(0, n))
        STEP.put(plan, Col.NUM_DRAFTS, [r.num_drafts for r in rows], slice(0, n))
        STEP.put(plan, Col.OUT_POS, [r.start_pos + r.num_tokens - r.num_drafts for r in rows], slice(0, n))
        STEP.put(plan, Col.SAMPLES, [r.sampling is not None for r in rows], slice(0, n))
        STEP.put(plan, Col.SHIFTED, [r.shifted for r in rows], slice(0, n))
        sampling = [s for r in rows if (s := r.sampling) is not None]
        # A slice where every row samples (decode): numpy indexes a list of rows far more slowly.
        sampled = slice(0, n) if len(sampling) == n else [i for i, r in enumerate(rows) if r.sampling is not None]
        STEP.put_sampling(plan, sampled, sampling)
        tail = self._host_tokens(rows)
        chunks = [(r.start_pos, r.num_tokens, r.block_ids) for r in rows]
        if padded is None:
            return self.attention.prepare(chunks, row_extra=plan.ints, row_floats=plan.floats, tail=tail)
        return self.attention.prepare(chunks, num_tokens=padded.tokens, num_rows=padded.rows, row_extra=plan.ints,
                                      row_floats=plan.floats, tail=tail, max_query_len=padded.max_query_len)
    @staticmethod
    def _host_tokens(rows: list[ScheduledRow]) -> np.ndarray:
        """[3 * N] slots, positions and ids of what the host writes into the token buffer: each
        row's host tokens, and the drafts its grammar forced (after its placeholder inputs)."""
        spans = [(r.slot, r.start_pos, r.token_ids) for r in rows if r.token_ids]  # a run-ahead row has none
        spans += [(r.slot, r.start_pos + len(r.token_ids) + r.num_placeholder_inputs, r.draft_token_ids[: r.num_forced])
                  for r in rows if r.num_forced]
        if not spans:
            return np.empty(0, np.int64)
        slots, starts, ids = zip(*spans, strict=True)
        lens = np.fromiter(map(len, ids), np.int64, len(spans))
        total = int(lens.sum())
        tail = np.empty(3 * total, np.int64)
        tail[:total] = np.repeat(np.array(slots, np.int64), lens)
        # Each span's positions count up from its start: the flat index minus where its span begins.
        shift = np.array(starts, np.int64) - (np.cumsum(lens) - lens)
        tail[total : 2 * total] = np.repeat(shift, lens) + np.arange(total)
        tail[2 * total :] = np.fromiter(itertools.chain.from_iterable(ids), np.int64, total)
        return tail

    def write_host_tokens(self, meta: AttentionMetadata) -> None:
        tail = meta.tail
        if tail is not None and tail.numel():
            n = tail.numel() // 3
            self.pool.tokens[tail[:n], tail[n : 2 * n]] = tail[2 * n :]

    def device_step(self, meta: AttentionMetadata, shape: StepShape,
                    logprob_rows: torch.Tensor | None = None) -> DeviceOutputs:
        """Forward, then sample or verify, then the outputs into the token buffer, then the
        in-step drafting pass: all on the device, with shapes fixed by `shape` (a graph captures
        exactly this). A constrained shape applies the grammars' allowed tokens of every sampled
        position, from `masks` (filled before the step); logprob_rows [L]: the rows whose logprobs are
        computed (shape.logprobs top alternatives; None: every row's, as a captured graph does), from
        the same logits the step sampled or verified with, at each position."""
        return self.device_head(meta, shape, *self.device_body(meta, shape), logprob_rows)

    def device_body(self, meta: AttentionMetadata, shape: StepShape) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The step's forward: what needs no token mask (a step whose masks come late runs it
        before they are known)."""
        if self.run_ahead:
            self._move_back(meta)
        return self.forward(meta)

    def device_head(self, meta: AttentionMetadata, shape: StepShape, hidden: torch.Tensor,
                    captured: dict[int, torch.Tensor], logprob_rows: torch.Tensor | None = None) -> DeviceOutputs:
        """The step after its forward: sampling or verification (under the masks), the outputs
        into the token buffer, the in-step drafting pass."""
        plan = STEP.on_device(meta)
        slot, num_drafts, out_pos = STEP.of(plan, Col.SLOT), STEP.of(plan, Col.NUM_DRAFTS), STEP.of(plan, Col.OUT_POS)
        bitmask = self.masks.view(shape.rows, shape.verify_width + 1) if shape.constrained else None
        logits, out, nacc, real_drafts = self._sample_or_verify(meta, shape, hidden, bitmask)
        # Confirmed tokens land right after each row's last verified input; rows that do not
        # sample write into the spare last column, which nothing reads.
        samples = STEP.of(plan, Col.SAMPLES) > 0
        self.pool.write(slot, torch.where(samples, out_pos, self.pool.width - 1), out)
        if self.run_ahead:
            self.rejected[slot] = torch.where(samples, num_drafts - nacc, 0)
        drafted = self.drafting.in_step(meta, shape.propose_width, slot, samples, nacc, num_drafts, captured,
                                        self.isolate_speculator)
        packed = torch.cat([out, real_drafts[:, None].to(out.dtype), nacc[:, None].to(out.dtype)], dim=1)
        logprobs = logprob_ids = None
        if shape.logprobs >= 0:
            # Position j of a verifying row holds the target's logits for its output token j, the
            # ones plain decoding computes for that token: speculation leaves the logprobs as they were.
            # A graph computes every row's (logprob_rows None); an eager step only those that asked.
            picked = (logits, out) if logprob_rows is None else (logits[logprob_rows], out[logprob_rows])
            logprobs, logprob_ids = token_logprobs(*picked, shape.logprobs)
        return DeviceOutputs(packed, hidden, captured, drafted.drafts, logprobs, logprob_ids, drafted.error)

    def _sample_or_verify(self, meta: AttentionMetadata, shape: StepShape, hidden: torch.Tensor,
                          bitmask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The step's logits [R, W + 1, V], output tokens [R, W + 1], accepted and drafted counts [R]."""
        plan = STEP.on_device(meta)
        slot, num_drafts, out_pos = STEP.of(plan, Col.SLOT), STEP.of(plan, Col.NUM_DRAFTS), STEP.of(plan, Col.OUT_POS)
        st = SamplingTensors.from_plan(plan, STEP, shape.all_greedy, shape.any_filter, shape.any_penalty)
        # What each row said before this step's output (its drafts are added per position by
        # verify); its prompt is what precedes output token number POSITION.
        counts = count_history(self.pool.tokens, slot, out_pos - STEP.of(plan, Col.POSITION), out_pos,
                               self.model.cfg.vocab_size) if shape.any_penalty else None
        last = (meta.query_start[1:] - 1).clamp(min=0)
        width = shape.verify_width
        if width == 0:
            logits = self.model.logits(hidden[last])
            out = sample_on_device(logits, st, use_triton=self.use_triton,
                                   bitmask=None if bitmask is None else bitmask[:, 0], counts=counts)[:, None]
            nacc = torch.zeros_like(slot)
            return logits[:, None], out, nacc, nacc
        cols = torch.arange(width + 1, device=self.device)
        index = (last - num_drafts)[:, None] + torch.minimum(cols[None, :], num_drafts[:, None])
        draft_pos = (out_pos[:, None] + cols[None, :width]).clamp(max=self.pool.width - 1)
        draft_ids = torch.where(cols[None, :width] < num_drafts[:, None], self.pool.tokens[slot[:, None], draft_pos],
                                -1)
        probs = None if self.deps.draft_probs is None else self.deps.draft_probs[slot, :width]
        logits = self.model.logits(hidden[index.clamp(min=0)])
        out, nacc = verify(logits, draft_ids, st, probs, use_triton=self.use_triton, bitmask=bitmask, counts=counts)
        return logits, out, nacc, drafted_counts(draft_ids)  # -1 padding is verified (never accepted), not counted

    def input_ids(self, meta: AttentionMetadata) -> torch.Tensor:
        """The step's input tokens, gathered from the token buffer. -1 (a draft slot a
        variable-width speculator left empty) reads as any valid id: no output that depends on
        it is ever accepted."""
        return self.pool.tokens[STEP.of(STEP.on_device(meta), Col.SLOT)[meta.token_rows], meta.positions].clamp(min=0)

    def forward(self, meta: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final-norm hidden states of the step and the captured layers (a pipeline's last
        stage runs only its own layers, on what the stage before it sent)."""
        return self.model.forward_with_hidden(self.input_ids(meta), self.kv_cache, meta, self.hidden_layers)

    def _move_back(self, meta: AttentionMetadata) -> None:
        """Shifted rows were planned as if their predecessor accepted every draft: their
        positions, cache slots, context lengths, output position and sampling index move back,
        on the device, by the drafts it rejected."""
        plan = STEP.on_device(meta)
        back = torch.where(STEP.of(plan, Col.SHIFTED) > 0, self.rejected[STEP.of(plan, Col.SLOT)], 0)
        real = meta.slot_mapping >= 0
        meta.positions.sub_(torch.where(real, back[meta.token_rows], 0))
        bs = self.attention.block_size
        pos = meta.positions
        slots = meta.block_tables[meta.token_rows, pos // bs] * bs + pos % bs
        meta.slot_mapping.copy_(torch.where(real, slots, -1))
        meta.seq_lens.sub_(back)
        STEP.of(plan, Col.OUT_POS).sub_(back)
        STEP.of(plan, Col.POSITION).sub_(back)

    def stop_speculation(self) -> None:
        """From now on the steps run the target alone: the speculator is never called again (nor
        are graphs replayed that hold its pass); rows in flight verify the drafts they carry."""
        if self.drafting.in_graphs:
            self.graphs = None
        self.drafting = NoDrafting()
        self.hidden_layers = ()

    def _launch(self, frame: StepFrame) -> PendingStep:
        shape = self.step_shape(frame)
        padded = self.padded(frame, shape)
        late = self._late(frame)
        if late is not None and padded is not None and self.graphs is not None and not self.graphs.splits(padded):
            padded = None  # no graph to stop between forward and sampling: eagerly
        run = padded or shape
        between: Callable[[], None] | None = None
        if shape.constrained and late is None:
            self.masks.fill([r.token_bitmask for r in frame.rows], run.rows, run.verify_width + 1)
        elif late is not None:
            staged, host = self.masks.stage([r.token_bitmask for r in frame.rows], run.rows, run.verify_width + 1)
            late.staged(host)  # the engine may write the late masks from here on, while the forward runs
            between = functools.partial(self._late_copy, late, staged, run)
        meta = self.plan(frame, padded)
        self.drafting.before(frame)
        self.write_host_tokens(meta)
        self.receive(frame)
        asked = [i for i, r in enumerate(frame.rows) if r.sampling is not None and r.sampling.logprobs >= 0]
        clock = None if self.device_s is None else (torch.Event(self.device, enable_timing=True),
                                                    torch.Event(self.device, enable_timing=True))
        if clock is not None:
            clock[0].record()
        if padded is not None:
            assert self.graphs is not None
            out = self.graphs.replay(padded) if between is None else self.graphs.replay(padded, between)
            asked_rows = list(range(len(frame.rows))) if asked else []  # the graph computed every row's
        else:
            logprob_rows = torch.tensor(asked, dtype=torch.int64, device=self.device) if asked else None
            if between is None:
                out = self.device_step(meta, shape, logprob_rows)
            else:
                body = self.device_body(meta, shape)
                between()
                out = self.device_head(meta, shape, *body, logprob_rows)
            asked_rows = asked
        if clock is not None:
            clock[1].record()  # before the step's copy, so the copy's event passing means this one did
        for r in frame.rows:
            self.pool.completed(r.slot, r.generation, frame.step_id)
        copy = self._copy(frame, out, len(asked_rows))
        outcome = self.drafting.after(frame, meta, out, copy, self.isolate_speculator)
        return PendingStep(lambda: self._timed(clock, self.finish(frame, copy, outcome, asked_rows)), copy.ready)

    def _late(self, frame: StepFrame) -> LateMasks | None:
        """The late masks of a frame with rows run ahead under a grammar (`ScheduledRow.mask_later`)."""
        if not any(r.mask_later for r in frame.rows):
            return None
        late = self.late_masks.pop(frame.step_id, None)
        if late is None:  # a launch tried again row by row after a failure: the masks were the first try's
            raise RuntimeError(f"step {frame.step_id}: a row's grammar mask comes after launch, and none is expected")
        return late

    def _late_copy(self, late: LateMasks, staged: torch.Tensor, run: StepShape) -> None:
        """Between forward and sampling: the masks' copy, behind the gate the engine opens."""
        late.gate.enqueue()
        late.gate.wait()
        self.masks.send(staged, run.rows, run.verify_width + 1)

    def _timed(self, clock: tuple[torch.Event, torch.Event] | None, result: StepResult) -> StepResult:
        """Adds a finished step's device time (its events passed: reading them waits for nothing)."""
        if clock is not None and self.device_s is not None:
            self.device_s += clock[0].elapsed_time(clock[1]) / 1e3
        return result

    def padded(self, frame: StepFrame, shape: StepShape) -> StepShape | None:
        """The captured shape the step replays, or None (eager: no graphs, or none of its kind)."""
        if self.graphs is None:
            return None
        return self.graphs.padded(shape)

    def receive(self, frame: StepFrame) -> None:
        """What the step's device work reads beyond the plan and the token buffer arrives here, in
        stream order, right before it runs (a pipeline stage's residual stream); nothing here."""

    def _copy(self, frame: StepFrame, out: DeviceOutputs, num_logprob_rows: int) -> StepCopy:
        """The step's copy to the host, with the drafts proposed inside it where the host must see
        them (K=0: a speculator that cannot skip drafting proposed all the same; they are dropped),
        and the first num_logprob_rows rows of its logprobs."""
        n = len(frame.rows)
        host_drafts = out.drafts is not None and frame.host_drafts and not frame.skip_drafts
        logprobs = None if out.logprobs is None or out.logprob_ids is None or not num_logprob_rows else (
            out.logprobs[:num_logprob_rows], out.logprob_ids[:num_logprob_rows])
        return StepCopy(out.packed[:n], out.drafts[:n] if host_drafts and out.drafts is not None else None, logprobs)

    def finish(self, frame: StepFrame, copy: StepCopy, outcome: DraftOutcome, asked: list[int]) -> StepResult:
        """The step's row results: its copy (waited for here) and its drafting outcome, folded.
        asked: the row of each of the copy's logprobs (a row that did not ask for them gets none)."""
        values, width = copy.rows(), copy.width
        lp = copy.logprobs()
        row_logprobs = dict(zip(asked, zip(*lp, strict=True), strict=True)) if lp is not None else {}
        ids = outcome.ids if outcome.ids is not None else copy.drafts() if outcome.in_copy else None
        next_ids = None if ids is None else draft_lists(ids)
        rows = []
        for i, (r, v) in enumerate(zip(frame.rows, values, strict=True)):
            s = r.sampling
            if s is None:
                rows.append(RowResult(r.key, r.generation, [], r.num_drafts, 0))
                continue
            sampled = [t for t in v[:width] if t >= 0]
            rows.append(RowResult(
                r.key, r.generation, sampled, r.num_drafts, v[width + 1],
                next_draft_ids=None if next_ids is None else next_ids[i],
                num_next_drafts=0 if next_ids is not None else outcome.num_next, num_drafted=v[width],
                logprobs=logprobs_of(*row_logprobs[i], len(sampled), s.logprobs)
                if s.logprobs >= 0 and i in row_logprobs else None))
        return StepResult(frame.step_id, rows, k0=outcome.k0, num_host_draft_copies=outcome.copies,
                          speculator_error=outcome.error)

    @torch.inference_mode()
    def prompt_logits(self, frame: StepFrame) -> torch.Tensor:
        """Logits of every position of a frame whose rows carry all their tokens (tests compare
        them with a reference model)."""
        ids = torch.tensor([t for r in frame.rows for t in r.token_ids], device=self.device)
        meta = self.attention.prepare([(r.start_pos, r.num_tokens, r.block_ids) for r in frame.rows])
        return self.model.logits(self.model(ids, self.kv_cache, meta))
