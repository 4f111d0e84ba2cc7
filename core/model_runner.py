"""Runs one StepFrame on the device: forward, sample or verify, then propose the next drafts.

Fixed-width drafts stay in a device-side store between steps: the frame carries only their
count and the runner splices them into the next input on the device. Draft IDs are copied to
the host only when the frame asks for it (variable width, structured output).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from .frame import RowResult, ScheduledRow, StepFrame, StepResult
from .models.llama import LlamaModel
from .models.paged import build_metadata, new_kv_cache
from .sampler import sample_on_device
from .speculator import ProposeRow, Speculator
from .verify import verify


@dataclass
class StoredDrafts:
    generation: int
    token_ids: torch.Tensor
    """[K] int64 on the device."""
    probs: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, num_blocks: int, block_size: int,
                 speculator: Speculator | None = None, num_speculative_tokens: int = 0,
                 use_triton: bool = False) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_cache = new_kv_cache(model.cfg, num_blocks, block_size, model.embed.weight.dtype, device)
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.use_triton = use_triton
        self.drafts: dict[str, StoredDrafts] = {}
        self.last_sampled: dict[str, tuple[int, torch.Tensor]] = {}
        """Async scheduling: each request's latest sampled token, still on the device."""

    def _row_input(self, row: ScheduledRow) -> torch.Tensor:
        pieces = [torch.tensor(row.token_ids, dtype=torch.int64).to(self.device)]
        if row.num_placeholder_inputs:
            generation, token = self.last_sampled[row.req_id]
            assert generation == row.generation, "placeholder input belongs to another generation"
            pieces.append(token)
        pieces.append(torch.tensor(row.draft_token_ids, dtype=torch.int64).to(self.device))
        if row.num_draft_slots:
            stored = self.drafts[row.req_id]
            assert stored.generation == row.generation, "device drafts belong to another generation"
            pieces.append(stored.token_ids[: row.num_draft_slots])
        return torch.cat(pieces)

    def _input_ids(self, frame: StepFrame) -> torch.Tensor:
        if not any(r.num_draft_slots or r.num_placeholder_inputs for r in frame.rows):
            ids = [t for r in frame.rows for t in r.token_ids + r.draft_token_ids]
            return torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return torch.cat([self._row_input(r) for r in frame.rows])

    def forward(self, frame: StepFrame) -> torch.Tensor:
        meta = build_metadata([(r.start_pos, r.num_tokens, r.block_ids) for r in frame.rows],
                              self.block_size, self.device)
        return self.model(self._input_ids(frame), self.kv_cache, meta)

    @torch.inference_mode()
    def execute(self, frame: StepFrame) -> StepResult:
        for req_id in frame.finished_req_ids:
            self.drafts.pop(req_id, None)
            self.last_sampled.pop(req_id, None)
            if self.speculator is not None:
                self.speculator.release(req_id)
        hidden = self.forward(frame)
        ends = torch.tensor([r.num_tokens for r in frame.rows]).cumsum(0).tolist()
        sampling_rows = [(i, r) for i, r in enumerate(frame.rows) if r.sampling is not None]
        k = max((r.num_drafts for _, r in sampling_rows), default=0)
        if k == 0:
            logits = self.model.logits(hidden[[ends[i] - 1 for i, _ in sampling_rows]])
            on_device = sample_on_device(logits, [r.sampling for _, r in sampling_rows])  # type: ignore[misc]
            for j, (_, r) in enumerate(sampling_rows):
                self.last_sampled[r.req_id] = (r.generation, on_device[j : j + 1])
            tokens = [[t] for t in on_device.tolist()]
            accepted = [0] * len(sampling_rows)
        else:
            tokens, accepted = self._verify(frame, hidden, ends, sampling_rows, k)
        out: dict[int, tuple[list[int], int]] = {
            i: (tokens[j], accepted[j]) for j, (i, _) in enumerate(sampling_rows)}
        result_rows = [RowResult(r.req_id, r.generation, out.get(i, ([], 0))[0], r.num_drafts,
                                 out.get(i, ([], 0))[1]) for i, r in enumerate(frame.rows)]
        if self.speculator is None:
            return StepResult(frame.step_id, result_rows)
        if not sampling_rows:  # prefill chunks only: nothing to draft from yet
            return StepResult(frame.step_id, result_rows, k0=frame.skip_drafts)
        return self._propose(frame, result_rows, sampling_rows)

    def _verify(self, frame: StepFrame, hidden: torch.Tensor, ends: list[int],
                sampling_rows: list[tuple[int, ScheduledRow]], k: int) -> tuple[list[list[int]], list[int]]:
        positions, draft_ids, probs = [], [], []
        sampled_drafts = self.speculator is not None and self.speculator.capabilities.sampled_drafts
        for i, row in sampling_rows:
            d = row.num_drafts
            first = ends[i] - 1 - d
            positions.append([first + min(j, d) for j in range(k + 1)])
            ids = torch.full((k,), -1, dtype=torch.int64, device=self.device)
            q = torch.zeros(k, self.model.cfg.vocab_size, device=self.device) if sampled_drafts else None
            if d:
                stored = self.drafts.get(row.req_id)
                ids[:d] = (stored.token_ids[:d] if row.num_draft_slots and stored is not None
                           else torch.tensor(row.draft_token_ids, device=self.device))
                if q is not None and stored is not None and stored.probs is not None:
                    q[:d] = stored.probs[:d]
            draft_ids.append(ids)
            if q is not None:
                probs.append(q)
        logits = self.model.logits(hidden[torch.tensor(positions, device=self.device)])
        out, nacc = verify(logits, torch.stack(draft_ids), [r.sampling for _, r in sampling_rows],  # type: ignore[misc]
                           torch.stack(probs) if probs else None, use_triton=self.use_triton)
        host_tokens, host_nacc = out.tolist(), nacc.tolist()
        return [[t for t in row if t >= 0] for row in host_tokens], host_nacc

    def _propose(self, frame: StepFrame, rows: list[RowResult],
                 sampling_rows: list[tuple[int, ScheduledRow]]) -> StepResult:
        assert self.speculator is not None
        spec = self.speculator
        propose_rows = [
            ProposeRow(r.req_id, r.generation, r.start_pos, r.token_ids, rows[i].sampled, r.block_ids,
                       r.sampling.temperature, r.sampling.seed)  # type: ignore[union-attr]
            for i, r in sampling_rows
        ]
        if frame.skip_drafts and spec.capabilities.supports_k0:
            spec.sync(propose_rows)
            return StepResult(frame.step_id, rows, k0=True)
        drafts = spec.propose(propose_rows, self.k)
        if frame.skip_drafts:  # the speculator cannot skip drafting: its drafts are dropped
            return StepResult(frame.step_id, rows, k0=True)
        for j, (_, r) in enumerate(sampling_rows):
            probs = drafts.probs[j] if drafts.probs is not None else None
            self.drafts[r.req_id] = StoredDrafts(r.generation, drafts.token_ids[j], probs)
        host = drafts.token_ids.tolist() if frame.host_drafts else None
        for j, (i, _) in enumerate(sampling_rows):
            if host is None:
                rows[i] = msgspec.structs.replace(rows[i], num_next_drafts=self.k)
            else:
                cut = next((n for n, t in enumerate(host[j]) if t < 0), len(host[j]))
                rows[i] = msgspec.structs.replace(rows[i], next_draft_ids=host[j][:cut])
        return StepResult(frame.step_id, rows, num_host_draft_copies=int(host is not None))

    @torch.inference_mode()
    def prompt_logits(self, frame: StepFrame) -> torch.Tensor:
        """Logits of every position of a frame (tests compare them with a reference model)."""
        return self.model.logits(self.forward(frame))
