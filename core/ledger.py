"""The frame ledger: the only place where model output changes request state.

A result is applied atomically; rows whose (req_id, generation) no longer match a live request
are discarded, so output never lands on a request that was preempted, aborted, finished, or
whose id was reused since the frame was scheduled.
"""

from __future__ import annotations

from .frame import StepFrame, StepResult
from .messages import RequestDelta
from .scheduler import Scheduler


class LedgerError(RuntimeError):
    """A result that no frame in flight produced: a kernel bug, never user input."""


class Ledger:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.in_flight: dict[int, StepFrame] = {}
        self.num_stale_rows = 0
        self.num_generated_tokens = 0

    def submit(self, frame: StepFrame) -> None:
        self.in_flight[frame.step_id] = frame

    def apply(self, result: StepResult) -> list[RequestDelta]:
        frame = self.in_flight.pop(result.step_id, None)
        if frame is None:
            raise LedgerError(f"result for step {result.step_id}, which is not in flight")
        scheduled = [(r.req_id, r.generation) for r in frame.rows]
        if [(r.req_id, r.generation) for r in result.rows] != scheduled:
            raise LedgerError(f"step {result.step_id}: result rows do not match the frame's rows")
        deltas: list[RequestDelta] = []
        for row in result.rows:
            req = self.scheduler.requests.get(row.req_id)
            if req is None or req.generation != row.generation:
                self.num_stale_rows += 1
                continue
            req.in_flight -= 1
            if result.error is not None:
                self.scheduler.finish(req, "error")
                deltas.append(RequestDelta(req.req_id, [], "error", result.error))
                continue
            new: list[int] = []
            reason = None
            for token in row.sampled:
                req.output_token_ids.append(token)
                new.append(token)
                reason = req.stop_reason(token)
                if reason is not None:
                    break
            self.num_generated_tokens += len(new)
            if reason is not None:
                self.scheduler.finish(req, reason)
            if new or reason is not None:
                deltas.append(RequestDelta(req.req_id, new, reason))
        return deltas
