"""Continuous batching with chunked prefill and preemption by recompute.

One `schedule()` reads top to bottom: running requests first (decode, or the next chunk of a
prefill), then waiting requests while the token budget and `max_num_seqs` allow. When blocks
run out, the most recently admitted running request is preempted: its blocks are freed, its
generation bumped, and it recomputes from its prompt plus the output it already has.
"""

from __future__ import annotations

import itertools
from collections import deque

from .block_manager import BlockManager
from .frame import RowSampling, ScheduledRow, StepFrame
from .request import Request, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.next_step_id = 0
        self.num_preemptions = 0
        # Generations come from one counter, so (req_id, generation) is never reused, even
        # when a caller reuses a request id after the first request finished.
        self.generations = itertools.count(1)

    def add(self, req: Request) -> None:
        req.generation = next(self.generations)
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.in_flight == 0 for r in self.running)

    def schedule(self) -> StepFrame | None:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.in_flight:  # its next input is the output of a frame not yet applied
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.blocks.ensure(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            rows.append(self._row(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.ensure(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        if not rows:
            return None
        frame = StepFrame(step_id=self.next_step_id, rows=rows)
        self.next_step_id += 1
        return frame

    def _row(self, req: Request, n: int) -> ScheduledRow:
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        req.in_flight += 1
        final = req.num_computed_tokens == req.num_tokens
        p = req.params
        sampling = (RowSampling(p.temperature, p.top_k, p.top_p, req.seed, len(req.output_token_ids))
                    if final else None)
        return ScheduledRow(req.req_id, req.generation, start, req.token_ids(start, start + n),
                            list(req.block_ids), sampling)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.in_flight = 0
        req.generation = next(self.generations)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Aborted or done: blocks back to the free list, generation bumped, forgotten."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.generation = next(self.generations)
        req.in_flight = 0
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.req_id, None)
