"""Runs one StepFrame on the device: forward, sample or verify, then the speculator's pass.

All of a step's input ids are gathered from the token buffer: the host writes the tokens it
knows first, while placeholder inputs (async scheduling) and drafts are already there, put by
the step that made them. Drafts are written back into the buffer right after each request's
confirmed tokens; their IDs reach the host only when the frame asks (variable width,
structured output).

A failure is scoped to rows: when a step raises, its rows run again one by one and only the
rows that fail alone fail; a row whose predecessor step did not complete for its slot fails
without running.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from . import log as logmod
from .attention import AttentionBackend
from .frame import RowResult, ScheduledRow, StepFrame, StepResult
from .models.llama import LlamaModel
from .models.paged import new_kv_cache
from .plugin import Speculator, TargetModel, TargetStates
from .sampler import sample_on_device
from .token_pool import TokenPool
from .verify import verify

log = logmod.get("runner")


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, num_blocks: int, block_size: int,
                 attention: AttentionBackend, num_slots: int, max_model_len: int,
                 speculator: Speculator | None = None, max_k: int = 0, use_triton: bool = False) -> None:
        self.model = model
        self.device = device
        self.attention = attention
        self.kv_cache = new_kv_cache(model.cfg, num_blocks, block_size, model.embed.weight.dtype, device)
        self.speculator = speculator
        self.use_triton = use_triton
        # Room for the context, K drafts past it, and one spare column that catches padding.
        self.pool = TokenPool(num_slots, max_model_len + max_k + 2, device)
        caps = speculator.capabilities if speculator is not None else None
        self.hidden_layers = caps.target_hidden_layers if caps is not None else ()
        self.draft_probs: torch.Tensor | None = None
        if caps is not None and caps.sampled_drafts:
            self.draft_probs = torch.zeros(num_slots, max(max_k, 1), model.cfg.vocab_size, device=device)
        self.target: TargetModel | None = None
        if caps is not None and (caps.uses_target_kv or caps.uses_target_weights):
            weights = caps.uses_target_weights
            self.target = TargetModel(model.cfg, model.embed if weights else None, model.norm if weights else None,
                                      model.logits if weights else None,
                                      self.kv_cache if caps.uses_target_kv else None)

    @torch.inference_mode()
    def execute(self, frame: StepFrame) -> StepResult:
        results: list[RowResult | None] = [None] * len(frame.rows)
        runnable = []
        for i, row in enumerate(frame.rows):
            if row.prev_step_id >= 0 and not self.pool.ran(row.slot, row.generation, row.prev_step_id):
                results[i] = self._failed(row, f"step {row.prev_step_id}, whose output this row reads, failed")
            else:
                runnable.append(i)
        k0, copies = self._run(frame, runnable, results)
        return StepResult(frame.step_id, [r for r in results if r is not None], k0=k0,
                          num_host_draft_copies=copies)

    def _run(self, frame: StepFrame, idx: list[int], results: list[RowResult | None]) -> tuple[bool, int]:
        """Runs rows idx of frame into results; returns (k0, host draft copies)."""
        if not idx:
            return frame.skip_drafts, 0
        try:
            out = self._execute(msgspec.structs.replace(frame, rows=[frame.rows[i] for i in idx]))
        except Exception as e:
            log.exception("step_rows_failed", step_id=frame.step_id, rows=len(idx))
            if len(idx) == 1:
                results[idx[0]] = self._failed(frame.rows[idx[0]], f"{type(e).__name__}: {e}")
                return False, 0
            # Rows are independent (KV and token-buffer writes depend only on the row), so each
            # runs again alone: only the rows that fail by themselves fail.
            k0, copies = False, 0
            for i in idx:
                k, c = self._run(frame, [i], results)
                k0, copies = k0 or k, copies + c
            return k0, copies
        for i, row in zip(idx, out.rows, strict=True):
            results[i] = row
        return out.k0, out.num_host_draft_copies

    def _failed(self, row: ScheduledRow, error: str) -> RowResult:
        self.pool.failed(row.slot)
        return RowResult(row.key, row.generation, [], row.num_drafts, error=error)

    def _execute(self, frame: StepFrame) -> StepResult:
        rows = frame.rows
        lens = [r.num_tokens for r in rows]
        query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        slots = np.asarray([r.slot for r in rows], np.int64)
        starts = np.asarray([r.start_pos for r in rows], np.int64)
        # Host-known tokens go into the buffer; then every input id is gathered from it.
        host_n = np.asarray([len(r.token_ids) for r in rows], np.int64)
        host_slots = np.repeat(slots, host_n)
        host_pos = np.concatenate([np.arange(r.start_pos, r.start_pos + len(r.token_ids)) for r in rows])
        host_vals = np.fromiter((t for r in rows for t in r.token_ids), np.int64, int(host_n.sum()))
        self.pool.write_host(host_slots, host_pos.astype(np.int64), host_vals)
        meta = self.attention.prepare([(r.start_pos, r.num_tokens, r.block_ids) for r in rows])
        tok_slots = torch.from_numpy(np.repeat(slots, lens)).to(self.device, non_blocking=True)
        input_ids = self.pool.tokens[tok_slots, meta.positions]
        hidden, captured = self.model.forward_with_hidden(input_ids, self.kv_cache, meta, self.hidden_layers)

        sampling_idx = [i for i, r in enumerate(rows) if r.sampling is not None]
        slot_index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        num_drafts = [r.num_drafts for r in rows]
        tokens: dict[int, list[int]] = {}
        accepted_host = [0] * len(rows)
        accepted = torch.zeros(len(rows), dtype=torch.int64, device=self.device)
        # Rows that sample, and their slots, as device indices made once for the whole step.
        idx = torch.tensor(sampling_idx, dtype=torch.int64, device=self.device)
        sample_slots = slot_index[idx]
        if sampling_idx:
            out, nacc = self._sample(frame, hidden, query_start, sampling_idx, sample_slots)
            accepted[idx] = nacc
            # Confirmed tokens land right after each row's last verified input (-1 past the end).
            first = torch.tensor([starts[i] + lens[i] - num_drafts[i] for i in sampling_idx], device=self.device)
            self.pool.write(sample_slots, first, out)
            host_out, host_nacc = out.tolist(), nacc.tolist()
            for j, i in enumerate(sampling_idx):
                tokens[i] = [t for t in host_out[j] if t >= 0]
                accepted_host[i] = host_nacc[j]
        result_rows = [RowResult(r.key, r.generation, tokens.get(i, []), num_drafts[i], accepted_host[i])
                       for i, r in enumerate(rows)]
        k0, copies = False, 0
        if self.speculator is not None:
            seq_lens = [starts[i] + lens[i] - num_drafts[i] + (accepted_host[i] + 1 if i in tokens else 0)
                        for i in range(len(rows))]
            states = TargetStates(
                tokens=self.pool.tokens, slots=slots.tolist(), slot_index=slot_index,
                generations=[r.generation for r in rows], start_pos=starts.tolist(),
                query_start=query_start.tolist(), positions=meta.positions, num_drafts=num_drafts,
                accepted=accepted, seq_lens=[int(n) for n in seq_lens], samples=[i in tokens for i in range(len(rows))],
                sampling=[r.sampling for r in rows], block_tables=[r.block_ids for r in rows],
                hidden=captured, target=self.target)
            k0, copies = self._speculate(frame, states, result_rows, sampling_idx, idx, sample_slots)
        for r in rows:
            self.pool.completed(r.slot, r.generation, frame.step_id)
        return StepResult(frame.step_id, result_rows, k0=k0, num_host_draft_copies=copies)

    def _sample(self, frame: StepFrame, hidden: torch.Tensor, query_start: np.ndarray, sampling_idx: list[int],
                sample_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S, K+1] -1 padded, accepted [S]) for the rows that sample."""
        rows = frame.rows
        sampling = [rows[i].sampling for i in sampling_idx]
        k = max(rows[i].num_drafts for i in sampling_idx)
        ends = query_start[1:]
        if k == 0:
            logits = self.model.logits(hidden[torch.from_numpy(ends[sampling_idx] - 1).to(self.device)])
            out = sample_on_device(logits, sampling)  # type: ignore[arg-type]
            return out[:, None], torch.zeros_like(out)
        # Verify: logits at each row's last host token and its drafts, padded to K + 1.
        positions, draft_pos = [], []
        for i in sampling_idx:
            d = rows[i].num_drafts
            first = int(ends[i]) - 1 - d
            positions.append([first + min(j, d) for j in range(k + 1)])
            p0 = rows[i].start_pos + rows[i].num_tokens - d
            draft_pos.append([p0 + j if j < d else -1 for j in range(k)])
        dpos = torch.tensor(draft_pos, device=self.device)
        draft_ids = torch.where(dpos >= 0, self.pool.tokens[sample_slots[:, None], dpos.clamp(min=0)], -1)
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs[sample_slots, :k]
        logits = self.model.logits(hidden[torch.tensor(positions, device=self.device)])
        return verify(logits, draft_ids, sampling, probs, use_triton=self.use_triton)  # type: ignore[arg-type]

    def _speculate(self, frame: StepFrame, states: TargetStates, rows: list[RowResult],
                   sampling_idx: list[int], idx: torch.Tensor, sample_slots: torch.Tensor) -> tuple[bool, int]:
        """Runs the speculator's pass over every row; returns (k0, host draft copies)."""
        assert self.speculator is not None
        spec = self.speculator
        k = frame.num_speculative_tokens
        if not sampling_idx or (frame.skip_drafts and spec.capabilities.supports_k0):
            spec.sync(states)
            return frame.skip_drafts, 0
        drafts = spec.propose(states, k)
        if frame.skip_drafts:  # the speculator cannot skip drafting: its drafts are dropped
            return True, 0
        ids = drafts.token_ids[idx]
        start = torch.tensor([states.seq_lens[i] for i in sampling_idx], device=self.device)
        self.pool.write(sample_slots, start, ids)
        if self.draft_probs is not None and drafts.probs is not None:
            self.draft_probs[sample_slots, :k] = drafts.probs[idx].float()
        if not frame.host_drafts:
            for i in sampling_idx:
                rows[i] = msgspec.structs.replace(rows[i], num_next_drafts=k)
            return False, 0
        for j, drafted in zip(sampling_idx, ids.tolist(), strict=True):
            cut = next((n for n, t in enumerate(drafted) if t < 0), len(drafted))
            rows[j] = msgspec.structs.replace(rows[j], next_draft_ids=drafted[:cut])
        return False, 1

    @torch.inference_mode()
    def prompt_logits(self, frame: StepFrame) -> torch.Tensor:
        """Logits of every position of a frame whose rows carry all their tokens (tests compare
        them with a reference model)."""
        ids = torch.tensor([t for r in frame.rows for t in r.token_ids], device=self.device)
        meta = self.attention.prepare([(r.start_pos, r.num_tokens, r.block_ids) for r in frame.rows])
        return self.model.logits(self.model(ids, self.kv_cache, meta))
