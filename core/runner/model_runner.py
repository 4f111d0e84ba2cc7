"""Runs one StepFrame on the device: forward, sample or verify, then the speculator's pass.

The host packs a step's plan (positions, slots, block tables, each row's slot, draft count,
output position and sampling values, the host-known tokens) into one staging array, copied
to the device in one go (`AttentionBackend.prepare`). Everything else is derived on the
device: input ids gathered from the token buffer, logit positions, draft ids, where outputs
go. So the device part of a step has fixed shapes once padded, and a captured graph
(`StepGraphs`) replays it for every decode or verification step of its size.

The only device-to-host transfer of a step is its sampled tokens and accepted counts, copied
into pinned memory behind an event: `launch` returns before the device has run the step, and
`PendingStep.result` waits only when the ledger needs the tokens. A `device_only` speculator
drafts inside the step (and its graph); its drafts stay on the device unless the host must see
them. With run-ahead, a row scheduled before its predecessor's accepted counts reached the host
is planned as if every draft was accepted (`ScheduledRow.shifted`), and the device moves it
back by the drafts that predecessor rejected.

A failure is scoped to rows: when launching a step raises, its rows run again one by one
and only the rows that fail alone fail; a row whose predecessor step did not complete for its
slot fails without running. A failure of the speculator's own pass fails no row: the target's
tokens of the step stand, the drafts it would have proposed are -1 (never accepted), and the
step result says so (`StepResult.speculator_error`), so the engine can count it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from .. import log as logmod
from ..attention import AttentionBackend, AttentionMetadata
from ..kernel.frame import RowResult, ScheduledRow, StepFrame, StepResult
from ..models.llama import LlamaModel
from ..models.paged import new_kv_cache
from ..outputs import TokenLogprobs
from ..platform import HostGate
from ..plugin import Drafts, Speculator, TargetModel, TargetStates
from .host_copy import to_device
from .penalties import count_history
from .sampler import SamplingTensors, sample_on_device, token_logprobs
from .step_graphs import StepGraphs
from .step_shape import DeviceOutputs, StepShape
from .token_pool import TokenPool
from .verify import drafted_counts, verify

log = logmod.get("runner")

# Columns of the per-row plan the host sends with each step.
SLOT, NUM_DRAFTS, OUT_POS, SAMPLES, SEED, POSITION, TOP_K, TEMPERATURE, TOP_P, SHIFTED, REPETITION, FREQUENCY, \
    PRESENCE = range(13)
ROW_FIELDS = 13


def confirmed_lens(seq_lens: torch.Tensor, num_drafts: torch.Tensor, samples: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """Each row's confirmed tokens after its step, on the device: the context it attended minus
    its drafts, plus the accepted ones and the bonus token where it sampled."""
    return seq_lens - num_drafts + torch.where(samples, accepted + 1, 0)


def logprobs_of(values: list[list[float]], ids: list[list[int]], count: int, top: int) -> list[TokenLogprobs]:
    """One row's first `count` output positions as TokenLogprobs, each with its `top` alternatives
    (the step computed as many as its most demanding row asked for)."""
    return [TokenLogprobs(v[0], t[:top], v[1 : 1 + top]) for v, t in zip(values[:count], ids[:count], strict=True)]


class PendingDrafts(NamedTuple):
    """A deferred speculator's drafts, not written by the host yet: stored behind their gate at
    the next launch, after its host work and before its tokens enter the token buffer."""

    gate: HostGate
    staging: torch.Tensor
    """[rows, K] host memory the speculator fills before it opens the gate."""
    rows: list[int]
    """Staging rows of the rows that sampled."""
    keys: list[tuple[int, int]]
    """Their (slot, generation): a slot with another generation in the next step is another request's."""
    starts: list[int]
    """Where each row's drafts go (its confirmed length)."""


class PendingStep:
    """A launched step: its RowResults once the device has run it."""

    def __init__(self, finish: Callable[[], StepResult]) -> None:
        self._finish = finish
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, num_blocks: int, block_size: int,
                 attention: AttentionBackend, num_slots: int, max_model_len: int,
                 speculator: Speculator | None = None, num_speculative_tokens: int = 0, use_triton: bool = False,
                 force_host_drafts: bool = False, max_num_tokens: int = 0, run_ahead: bool = False,
                 kv_layers: int | None = None) -> None:
        self.model = model
        self.device = device
        self.attention = attention
        kv_cfg = model.cfg if kv_layers is None else msgspec.structs.replace(model.cfg, num_layers=kv_layers)
        self.kv_cache = new_kv_cache(kv_cfg, num_blocks, block_size, model.embed.weight.dtype, device)
        self.speculator = speculator
        self.use_triton = use_triton
        self.force_host_drafts = force_host_drafts
        self.num_slots = num_slots
        # The plan buffer never moves under captured graphs.
        k = num_speculative_tokens
        tokens = max(max_num_tokens, num_slots * (k + 1))
        attention.reserve(tokens, num_slots, ROW_FIELDS, 3 * tokens)
        # Room for the context, K drafts past it, and one spare column that catches padding;
        # one spare row takes what padding rows of a device graph write.
        self.pool = TokenPool(num_slots + 1, max_model_len + k + 2, device)
        self.pool.tokens[num_slots] = 0  # padding rows read their inputs there: any valid id
        caps = speculator.capabilities if speculator is not None else None
        self.device_spec = caps is not None and caps.device_only
        self.run_ahead = run_ahead
        """Rows may be shifted (planned before their predecessor's accepted counts were known)."""
        self.rejected = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        """Per slot: drafts its latest step rejected, by which a shifted successor moves back."""
        self.hidden_layers = caps.target_hidden_layers if caps is not None else ()
        self.draft_probs: torch.Tensor | None = None
        if caps is not None and caps.sampled_drafts:
            self.draft_probs = torch.zeros(num_slots + 1, max(k, 1), model.cfg.vocab_size, device=device)
        self.target: TargetModel | None = None
        if caps is not None and (caps.uses_target_kv or caps.uses_target_weights):
            weights = caps.uses_target_weights
            self.target = TargetModel(model.cfg, model.embed if weights else None, model.norm if weights else None,
                                      model.logits if weights else None,
                                      self.kv_cache if caps.uses_target_kv else None)
        self.graphs: StepGraphs | None = None
        """Captured decode and verification steps, when the engine captured them."""
        self.pending_drafts: PendingDrafts | None = None
        """A deferred proposal, resolved by the next launch."""
        self.isolate_speculator = True
        """A raising speculator pass costs the step its drafts only (off while graphs are captured:
        a graph must hold the real pass, so a pass that raises there fails the capture)."""
        self.speculator_error: str | None = None
        """What the device-side speculator pass of the step being launched raised, if it did."""

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

        return PendingStep(finish)

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
        propose = 0
        if self.device_spec and sampling and frame.num_speculative_tokens:
            assert self.speculator is not None
            if not frame.skip_drafts or not self.speculator.capabilities.supports_k0:
                propose = frame.num_speculative_tokens
        return StepShape(rows=len(rows), tokens=frame.num_tokens,
                         verify_width=max((r.num_drafts for r in rows), default=0),
                         max_query_len=max((r.num_tokens for r in rows), default=0),
                         all_greedy=all(s.temperature == 0.0 for s in sampling),
                         any_filter=any(s.top_k > 0 or s.top_p < 1.0 for s in sampling),
                         any_penalty=any(s.penalized for s in sampling),
                         decode_like=all(r.sampling is not None and r.num_tokens == 1 + r.num_drafts for r in rows),
                         propose_width=propose, logprobs=max((s.logprobs for s in sampling), default=-1))

    def plan(self, frame: StepFrame, padded: StepShape | None) -> AttentionMetadata:
        """Packs the step's plan (padded to a captured shape, if given) and sends it to the device
        in one copy."""
        rows = frame.rows
        extra = np.zeros((len(rows), ROW_FIELDS), np.int64)
        floats = extra.view(np.float64)
        for i, r in enumerate(rows):
            s = r.sampling
            extra[i, :4] = (r.slot, r.num_drafts, r.start_pos + r.num_tokens - r.num_drafts, s is not None)
            extra[i, SHIFTED] = r.shifted
            if s is not None:
                extra[i, SEED:TOP_K + 1] = (s.seed, s.position, s.top_k)
                floats[i, TEMPERATURE], floats[i, TOP_P] = s.temperature, s.top_p
                floats[i, REPETITION:PRESENCE + 1] = (s.repetition_penalty, s.frequency_penalty, s.presence_penalty)
            else:
                floats[i, TOP_P] = floats[i, REPETITION] = 1.0
        host_n = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        n = int(host_n.sum())
        tail = np.empty(3 * n, np.int64)
        tail[:n] = np.repeat(extra[:, SLOT], host_n)
        tail[n : 2 * n] = np.concatenate([np.arange(r.start_pos, r.start_pos + len(r.token_ids)) for r in rows]) \
            if n else tail[:0]
        tail[2 * n :] = np.fromiter((t for r in rows for t in r.token_ids), np.int64, n)
        chunks = [(r.start_pos, r.num_tokens, r.block_ids) for r in rows]
        if padded is None:
            return self.attention.prepare(chunks, row_extra=extra, tail=tail)
        if padded.rows > len(rows):
            pad = np.zeros((padded.rows - len(rows), ROW_FIELDS), np.int64)
            pad[:, SLOT] = self.num_slots  # the spare row of the token buffer
            pad.view(np.float64)[:, [TOP_P, REPETITION]] = 1.0
            extra = np.concatenate([extra, pad])
        return self.attention.prepare(chunks, num_tokens=padded.tokens, num_rows=padded.rows, row_extra=extra,
                                      tail=tail, max_query_len=padded.max_query_len)

    def token_bitmask(self, frame: StepFrame, width: int) -> torch.Tensor | None:
        """[R, width + 1, W] int32 on the device: the rows' grammar bitmasks, all ones where a
        row or position has none; None for a step without structured output."""
        if not any(r.token_bitmask for r in frame.rows):
            return None
        words = (self.model.cfg.vocab_size + 31) // 32
        host = np.full((len(frame.rows), width + 1, words), -1, np.int32)
        for i, r in enumerate(frame.rows):
            if r.token_bitmask:
                mask = np.frombuffer(r.token_bitmask, np.int32).reshape(-1, words)
                host[i, : len(mask)] = mask
        return torch.from_numpy(host).to(self.device, non_blocking=True)

    def write_host_tokens(self, meta: AttentionMetadata) -> None:
        tail = meta.tail
        if tail is not None and tail.numel():
            n = tail.numel() // 3
            self.pool.tokens[tail[:n], tail[n : 2 * n]] = tail[2 * n :]

    def device_step(self, meta: AttentionMetadata, shape: StepShape, bitmask: torch.Tensor | None = None,
                    logprob_rows: torch.Tensor | None = None) -> DeviceOutputs:
        """Forward, then sample or verify, then the outputs into the token buffer: all on the
        device, with shapes fixed by `shape` (a graph captures exactly this). bitmask [R, width
        + 1, W]: the grammar's allowed tokens per sampled position (structured output, eager);
        logprob_rows [L]: the rows whose logprobs are computed (shape.logprobs top alternatives,
        eager), from the same logits the step sampled or verified with, at each position."""
        assert meta.row_extra is not None
        extra = meta.row_extra
        if self.run_ahead:
            self._move_back(meta)
        slot, num_drafts, out_pos = extra[:, SLOT], extra[:, NUM_DRAFTS], extra[:, OUT_POS]
        tokens = self.pool.tokens
        hidden, captured = self.forward(meta)
        floats = extra.view(torch.float64)
        st = SamplingTensors(temperature=floats[:, TEMPERATURE].float(), top_k=extra[:, TOP_K],
                             top_p=floats[:, TOP_P].float(), seed=extra[:, SEED], position=extra[:, POSITION],
                             all_greedy=shape.all_greedy, any_filter=shape.any_filter,
                             repetition_penalty=floats[:, REPETITION].float(),
                             frequency_penalty=floats[:, FREQUENCY].float(),
                             presence_penalty=floats[:, PRESENCE].float(), any_penalty=shape.any_penalty)
        # What each row said before this step's output (its drafts are added per position by
        # verify); its prompt is what precedes output token number POSITION.
        counts = count_history(tokens, slot, out_pos - extra[:, POSITION], out_pos, self.model.cfg.vocab_size) \
            if shape.any_penalty else None
        last = (meta.query_start[1:] - 1).clamp(min=0)
        width = shape.verify_width
        if width == 0:
            logits = self.model.logits(hidden[last])
            out = sample_on_device(logits, st, use_triton=self.use_triton,
                                   bitmask=None if bitmask is None else bitmask[:, 0], counts=counts)[:, None]
            logits = logits[:, None]
            nacc = real_drafts = torch.zeros_like(slot)
        else:
            cols = torch.arange(width + 1, device=self.device)
            index = (last - num_drafts)[:, None] + torch.minimum(cols[None, :], num_drafts[:, None])
            draft_pos = (out_pos[:, None] + cols[None, :width]).clamp(max=self.pool.width - 1)
            draft_ids = torch.where(cols[None, :width] < num_drafts[:, None], tokens[slot[:, None], draft_pos], -1)
            probs = None if self.draft_probs is None else self.draft_probs[slot, :width]
            logits = self.model.logits(hidden[index.clamp(min=0)])
            out, nacc = verify(logits, draft_ids, st, probs, use_triton=self.use_triton, bitmask=bitmask,
                               counts=counts)
            real_drafts = drafted_counts(draft_ids)  # -1 padding is verified (never accepted), not counted
        # Confirmed tokens land right after each row's last verified input; rows that do not
        # sample write into the spare last column, which nothing reads.
        samples = extra[:, SAMPLES] > 0
        self.pool.write(slot, torch.where(samples, out_pos, self.pool.width - 1), out)
        if self.run_ahead:
            self.rejected[slot] = torch.where(samples, num_drafts - nacc, 0)
        drafts = None
        if self.device_spec:
            seq_lens = confirmed_lens(meta.seq_lens, num_drafts, samples, nacc)
            try:
                drafts = self._device_speculate(meta, shape, slot, samples, nacc, seq_lens, captured)
            except Exception as e:
                if not self.isolate_speculator:
                    raise
                self.speculator_error = self._speculator_failed(e)
                if shape.propose_width:  # no drafts: -1 where they would have gone
                    drafts = torch.full((len(slot), shape.propose_width), -1, dtype=torch.int64, device=self.device)
                    self.pool.write(slot, torch.where(samples, seq_lens, self.pool.width - 1), drafts)
        packed = torch.cat([out, real_drafts[:, None].to(out.dtype), nacc[:, None].to(out.dtype)], dim=1)
        logprobs = logprob_ids = None
        if logprob_rows is not None and shape.logprobs >= 0:
            # Position j of a verifying row holds the target's logits for its output token j, the
            # ones plain decoding computes for that token: speculation leaves the logprobs as they were.
            logprobs, logprob_ids = token_logprobs(logits[logprob_rows], out[logprob_rows], shape.logprobs)
        return DeviceOutputs(packed, hidden, captured, drafts, logprobs, logprob_ids)

    def input_ids(self, meta: AttentionMetadata) -> torch.Tensor:
        """The step's input tokens, gathered from the token buffer. -1 (a draft slot a
        variable-width speculator left empty) reads as any valid id: no output that depends on
        it is ever accepted."""
        assert meta.row_extra is not None
        return self.pool.tokens[meta.row_extra[:, SLOT][meta.token_rows], meta.positions].clamp(min=0)

    def forward(self, meta: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final-norm hidden states of the step and the captured layers (a pipeline's last
        stage runs only its own layers, on what the stage before it sent)."""
        return self.model.forward_with_hidden(self.input_ids(meta), self.kv_cache, meta, self.hidden_layers)

    def _move_back(self, meta: AttentionMetadata) -> None:
        """Shifted rows were planned as if their predecessor accepted every draft: their
        positions, cache slots, context lengths, output position and sampling index move back,
        on the device, by the drafts it rejected."""
        extra = meta.row_extra
        assert extra is not None
        back = torch.where(extra[:, SHIFTED] > 0, self.rejected[extra[:, SLOT]], 0)
        real = meta.slot_mapping >= 0
        meta.positions.sub_(torch.where(real, back[meta.token_rows], 0))
        bs = self.attention.block_size
        pos = meta.positions
        slots = meta.block_tables[meta.token_rows, pos // bs] * bs + pos % bs
        meta.slot_mapping.copy_(torch.where(real, slots, -1))
        meta.seq_lens.sub_(back)
        extra[:, OUT_POS] -= back
        extra[:, POSITION] -= back

    def _device_speculate(self, meta: AttentionMetadata, shape: StepShape, slot: torch.Tensor,
                          samples: torch.Tensor, accepted: torch.Tensor, seq_lens: torch.Tensor,
                          captured: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """A device-only speculator's pass, inside the step: it sees device tensors only, and
        its drafts go into the token buffer right after each sampling row's confirmed tokens."""
        assert self.speculator is not None
        states = TargetStates(
            tokens=self.pool.tokens, slots=[], slot_index=slot, generations=[], start_pos=[], query_start=[],
            positions=meta.positions, num_drafts=[], accepted=accepted, seq_lens=[], samples=[], sampling=[],
            block_tables=[], hidden=captured, seq_lens_device=seq_lens, samples_device=samples, target=self.target,
            attention=meta)
        if not shape.propose_width:
            self.speculator.sync(states)
            return None
        drafts = self.speculator.propose(states, shape.propose_width)
        ids = self._in_vocab(drafts.token_ids)
        self.pool.write(slot, torch.where(samples, seq_lens, self.pool.width - 1), ids)
        if self.draft_probs is not None and drafts.probs is not None:
            self.draft_probs[slot, : shape.propose_width] = drafts.probs.float()
        return ids

    def _in_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids outside the vocabulary as -1 (never accepted): a speculator's bad id costs
        its draft, not the next step's embedding lookup (an index error, or a device fault)."""
        return torch.where((ids >= 0) & (ids < self.model.cfg.vocab_size), ids, -1)

    def _speculator_failed(self, e: Exception) -> str:
        """Logs a raising speculator pass with its traceback; its one-line description."""
        log.exception("speculator_pass_failed", error=f"{type(e).__name__}: {e}")
        return f"{type(e).__name__}: {e}"

    def stop_speculation(self) -> None:
        """From now on the steps run the target alone: the speculator is never called again (nor
        are graphs replayed that hold its pass); rows in flight verify the drafts they carry."""
        if self.device_spec:
            self.graphs = None
        self.speculator = None
        self.device_spec = False
        self.hidden_layers = ()
        self.pending_drafts = None

    def _launch(self, frame: StepFrame) -> PendingStep:
        rows = frame.rows
        self.speculator_error = None
        shape = self.step_shape(frame)
        bitmask = self.token_bitmask(frame, shape.verify_width)
        padded = self.graphs.padded(shape) if self.graphs is not None and bitmask is None else None
        meta = self.plan(frame, padded)
        self.resolve_drafts(frame)
        self.write_host_tokens(meta)
        asked = [i for i, r in enumerate(rows) if r.sampling is not None and r.sampling.logprobs >= 0]
        if padded is not None:
            assert self.graphs is not None
            out = self.graphs.replay(padded)
        else:
            logprob_rows = torch.tensor(asked, dtype=torch.int64, device=self.device) if asked else None
            out = self.device_step(meta, shape, bitmask, logprob_rows)
        for r in rows:
            self.pool.completed(r.slot, r.generation, frame.step_id)
        n = len(rows)
        k1 = out.packed.shape[1] - 2  # a padded step verifies its bucket's width: more columns than shape's
        # Drafts proposed inside the step count for the next one unless the step was K=0 (a
        # speculator that cannot skip drafting proposed all the same: its drafts are dropped).
        drafted = out.drafts is not None and not frame.skip_drafts
        host_drafts = drafted and frame.host_drafts
        copies = 0
        if out.drafts is not None and drafted and not frame.host_drafts and self.force_host_drafts:
            out.drafts[:n].tolist()  # what a kernel that ignored the fixed width would pay
            copies = 1
        packed = out.packed[:n]
        if host_drafts:
            assert out.drafts is not None
            packed = torch.cat([packed, out.drafts[:n]], dim=1)
            copies = 1
        host, event = packed.clone(), None
        lp_host = [] if out.logprobs is None or out.logprob_ids is None else [out.logprobs, out.logprob_ids]
        if self.device.type != "cpu":  # copy into pinned memory behind an event; wait only in finish()
            host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            lp_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for t in lp_host]
            event = torch.Event(self.device)
            event.record()
        next_k = out.drafts.shape[1] if drafted and out.drafts is not None else 0
        spec_error = self.speculator_error

        def finish() -> StepResult:
            if event is not None:
                event.synchronize()
            values = host.tolist()
            row_logprobs = dict(zip(asked, zip(lp_host[0].tolist(), lp_host[1].tolist(), strict=True),
                                    strict=True)) if lp_host else {}
            result_rows = []
            for i, (r, v) in enumerate(zip(rows, values, strict=True)):
                if r.sampling is None:
                    result_rows.append(RowResult(r.key, r.generation, [], r.num_drafts, 0))
                    continue
                row = RowResult(r.key, r.generation, [t for t in v[:k1] if t >= 0], r.num_drafts, v[k1 + 1],
                                num_next_drafts=0 if host_drafts else next_k, num_drafted=v[k1])
                if host_drafts:
                    drafted_ids = v[k1 + 2 :]
                    cut = next((m for m, tok in enumerate(drafted_ids) if tok < 0), len(drafted_ids))
                    row = msgspec.structs.replace(row, next_draft_ids=drafted_ids[:cut])
                if i in row_logprobs:
                    assert r.sampling is not None
                    row = msgspec.structs.replace(row, logprobs=logprobs_of(*row_logprobs[i], len(row.sampled),
                                                                            r.sampling.logprobs))
                result_rows.append(row)
            return StepResult(frame.step_id, result_rows, k0=frame.skip_drafts and self.speculator is not None,
                              num_host_draft_copies=copies, speculator_error=spec_error)

        if self.speculator is None or self.device_spec:
            return PendingStep(finish)
        # The speculator reads this step's metadata and outputs, which the next launch
        # overwrites: it runs now (it needs the accepted counts on the host anyway).
        plain = finish()
        try:
            done = self._speculate(frame, meta, out, plain)
        except Exception as e:
            if not self.isolate_speculator:
                raise
            done = self._without_drafts(frame, plain, self._speculator_failed(e))
        return PendingStep(lambda: done)

    def _without_drafts(self, frame: StepFrame, plain: StepResult, error: str) -> StepResult:
        """A step whose host-side speculator pass raised: its target tokens, no next drafts, and
        -1 where a run-ahead successor would read the drafts it counted on."""
        self.pending_drafts = None
        k = frame.num_speculative_tokens
        idx = [i for i, r in enumerate(frame.rows) if r.sampling is not None]
        if k and idx and not frame.skip_drafts:
            rows = [frame.rows[i] for i in idx]
            slots = torch.tensor([r.slot for r in rows], dtype=torch.int64, device=self.device)
            starts = torch.tensor([r.start_pos + r.num_tokens - r.num_drafts + plain.rows[i].num_accepted + 1
                                   for r, i in zip(rows, idx, strict=True)], dtype=torch.int64, device=self.device)
            self.pool.write(slots, starts, torch.full((len(idx), k), -1, dtype=torch.int64, device=self.device))
        rows_out = [msgspec.structs.replace(r, num_next_drafts=0, next_draft_ids=None) for r in plain.rows]
        return msgspec.structs.replace(plain, rows=rows_out, speculator_error=error)

    # --- the speculator's pass -------------------------------------------------------------

    def _speculate(self, frame: StepFrame, meta: AttentionMetadata, out: DeviceOutputs,
                   plain: StepResult) -> StepResult:
        assert self.speculator is not None
        rows = frame.rows
        n = len(rows)
        result_rows = list(plain.rows)
        starts = [r.start_pos for r in rows]
        lens = [r.num_tokens for r in rows]
        num_drafts = [r.num_drafts for r in rows]
        samples = [r.sampling is not None for r in rows]
        seq_lens = [starts[i] + lens[i] - num_drafts[i] + (result_rows[i].num_accepted + 1 if samples[i] else 0)
                    for i in range(n)]
        query_start = np.concatenate([[0], np.cumsum(lens)]).tolist()
        slots = [r.slot for r in rows]
        assert meta.row_extra is not None
        slot_index = meta.row_extra[:n, SLOT]
        accepted = out.packed[:n, -1]
        samples_device = meta.row_extra[:n, SAMPLES] > 0
        seq_lens_device = confirmed_lens(meta.seq_lens[:n], meta.row_extra[:n, NUM_DRAFTS], samples_device, accepted)
        t = query_start[-1]
        states = TargetStates(
            tokens=self.pool.tokens, slots=slots, slot_index=slot_index,
            generations=[r.generation for r in rows], start_pos=starts, query_start=query_start,
            positions=meta.positions[:t], num_drafts=num_drafts, accepted=accepted, seq_lens=seq_lens,
            samples=samples, sampling=[r.sampling for r in rows], block_tables=[r.block_ids for r in rows],
            hidden={layer: h[:t] for layer, h in out.captured.items()}, seq_lens_device=seq_lens_device,
            samples_device=samples_device, target=self.target, attention=meta)
        spec = self.speculator
        k = frame.num_speculative_tokens
        sampling_idx = [i for i in range(n) if samples[i]]
        if not sampling_idx or (frame.skip_drafts and spec.capabilities.supports_k0):
            spec.sync(states)
            return msgspec.structs.replace(plain, rows=result_rows, k0=frame.skip_drafts)
        drafts = spec.propose(states, k)
        if frame.skip_drafts:  # the speculator cannot skip drafting: its drafts are dropped
            return msgspec.structs.replace(plain, rows=result_rows, k0=True)
        if drafts.ready is not None and not frame.host_drafts:
            # Deferred: the next launch stores them behind the gate, after its host work.
            self.pending_drafts = PendingDrafts(drafts.ready, drafts.token_ids, sampling_idx,
                                                [(rows[i].slot, rows[i].generation) for i in sampling_idx],
                                                [seq_lens[i] for i in sampling_idx])
            for i in sampling_idx:
                result_rows[i] = msgspec.structs.replace(result_rows[i], num_next_drafts=k)
            return msgspec.structs.replace(plain, rows=result_rows)
        idx = torch.tensor(sampling_idx, dtype=torch.int64, device=self.device)
        ids = self._in_vocab(self._gated(drafts)[idx])
        sample_slots = slot_index[idx]
        start = torch.tensor([seq_lens[i] for i in sampling_idx], device=self.device)
        self.pool.write(sample_slots, start, ids)
        if self.draft_probs is not None and drafts.probs is not None:
            self.draft_probs[sample_slots, :k] = drafts.probs[idx].float()
        if not frame.host_drafts:
            copies = 0
            if self.force_host_drafts:  # what a kernel that ignored the fixed width would pay
                ids.tolist()
                copies = 1
            for i in sampling_idx:
                result_rows[i] = msgspec.structs.replace(result_rows[i], num_next_drafts=k)
            return msgspec.structs.replace(plain, rows=result_rows, num_host_draft_copies=copies)
        for j, drafted in zip(sampling_idx, ids.tolist(), strict=True):
            cut = next((m for m, tok in enumerate(drafted) if tok < 0), len(drafted))
            result_rows[j] = msgspec.structs.replace(result_rows[j], next_draft_ids=drafted[:cut])
        return msgspec.structs.replace(plain, rows=result_rows, num_host_draft_copies=1)

    def _gated(self, drafts: Drafts) -> torch.Tensor:
        """A proposal's drafts on the device; a deferred one's copied behind its gate (the host
        needs them now: it waits where the stream cannot)."""
        if drafts.ready is None:
            return drafts.token_ids
        drafts.ready.enqueue()
        drafts.ready.wait()
        return drafts.token_ids.to(self.device, non_blocking=True)

    def resolve_drafts(self, frame: StepFrame) -> None:
        """Stores a deferred proposal's drafts, in stream order behind its gate, before this
        step's tokens go into the token buffer: a row whose slot now holds another request
        (another generation) is dropped, so its draft never reaches the new owner."""
        pending, self.pending_drafts = self.pending_drafts, None
        if pending is None:
            return
        owner = {r.slot: r.generation for r in frame.rows}
        keep = [j for j, (slot, generation) in enumerate(pending.keys) if owner.get(slot, generation) == generation]
        # Where the kept drafts go reaches the device before the gate: a copy that waits for
        # its stream (one from pageable memory) issued behind it would hold the host there
        # until the reply came, with the step's launch still to do.
        where = None
        if keep:
            rows = [pending.rows[j] for j in keep]
            where = to_device(np.array([rows, [pending.keys[j][0] for j in keep], [pending.starts[j] for j in keep]],
                                       np.int64), self.device)
        pending.gate.enqueue()
        pending.gate.wait()
        if where is None:
            return
        ids = self._in_vocab(pending.staging.to(self.device, non_blocking=True))  # the reply's copy, behind the gate
        self.pool.write(where[1], where[2], ids[where[0]])

    @torch.inference_mode()
    def prompt_logits(self, frame: StepFrame) -> torch.Tensor:
        """Logits of every position of a frame whose rows carry all their tokens (tests compare
        them with a reference model)."""
        ids = torch.tensor([t for r in frame.rows for t in r.token_ids], device=self.device)
        meta = self.attention.prepare([(r.start_pos, r.num_tokens, r.block_ids) for r in frame.rows])
        return self.model.logits(self.model(ids, self.kv_cache, meta))
