"""The frame ledger: where model output reaches request state.

A result is applied row by row, each row atomically, through the request's own transitions
(`request.py` lists them): the row leaves flight (`land_row`), then its rejected draft positions
are rolled back, the speculation counters count, the confirmed tokens land (stop conditions
checked token by token) and the drafts for the next step are held (`apply_result`). Rows whose
(key, generation) no longer match a live request are discarded, so output never lands on a
request that was preempted, aborted or finished since the frame was scheduled. A row that failed
on the device fails its own request only.

The ledger is the only caller of the transitions that take model output (`land_row`,
`apply_result`); the scheduler calls those that carry out its own plan (scheduling a row,
admission, preemption, finishing) and, with run-ahead, counts the drafts a frame in flight will
propose before its result arrives (`expect_device_drafts`). Neither writes a request field itself.
"""

from __future__ import annotations

from ..wire.messages import RequestDelta
from .frame import RowResult, ScheduledRow, StepFrame, StepResult
from .request import Request, SpecCounters
from .scheduler import Scheduler


class LedgerError(RuntimeError):
    """A result that no frame in flight produced: a kernel bug, never user input."""


class Ledger:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.in_flight: dict[int, StepFrame] = {}
        self.num_stale_rows = 0
        self.num_generated_tokens = 0
        self.num_k0_steps = 0
        self.num_host_draft_copies = 0
        self.num_async_rows = 0
        """Rows scheduled on a placeholder input while the frame producing it was in flight."""
        self.spec = SpecCounters()

    def submit(self, frame: StepFrame) -> None:
        self.in_flight[frame.step_id] = frame

    def apply(self, result: StepResult) -> list[RequestDelta]:
        frame = self.in_flight.pop(result.step_id, None)
        if frame is None:
            raise LedgerError(f"result for step {result.step_id}, which is not in flight")
        scheduled = [(r.key, r.generation) for r in frame.rows]
        if [(r.key, r.generation) for r in result.rows] != scheduled:
            raise LedgerError(f"step {result.step_id}: result rows do not match the frame's rows")
        self.num_k0_steps += result.k0
        self.num_host_draft_copies += result.num_host_draft_copies
        deltas: list[RequestDelta] = []
        for sched_row, row in zip(frame.rows, result.rows, strict=True):
            req = self.scheduler.requests.get(row.key)
            if req is None or req.generation != row.generation:
                self.num_stale_rows += 1
                continue
            if (delta := self._apply_row(result.step_id, req, sched_row, row)) is not None:
                deltas.append(delta)
        return deltas

    def _apply_row(self, step_id: int, req: Request, sched_row: ScheduledRow, row: RowResult) -> RequestDelta | None:
        """One live row of step step_id: its request's state moves on; the delta to send, if any."""
        if req.last_applied_step >= step_id:
            raise LedgerError(f"step {step_id} applied to {row.key} after step {req.last_applied_step}")
        self.num_async_rows += sched_row.num_placeholder_inputs > 0
        req.land_row(step_id, sched_row.sampling is not None, sched_row.num_drafts)
        if row.error is not None:
            self.scheduler.finish(req, "error")
            return RequestDelta(req.key, [], "error", row.error)
        if row.num_accepted > row.num_drafts or row.num_drafts != sched_row.num_drafts:
            raise LedgerError(f"step {step_id}: {row.key} accepted more drafts than it verified")
        drafted = row.num_drafts if row.num_drafted is None else row.num_drafted  # padding is no draft
        self.spec.record(drafted, row.num_accepted, sched_row.num_forced)
        new, reason = req.apply_result(row, drafted, sched_row.num_forced)
        self.num_generated_tokens += len(new)
        logprobs = None if row.logprobs is None else row.logprobs[: len(new)]
        if reason is not None:
            self.scheduler.finish(req, reason)
            return RequestDelta(req.key, new, reason, stats=req.spec.summary(), logprobs=logprobs)
        return RequestDelta(req.key, new, logprobs=logprobs) if new else None
