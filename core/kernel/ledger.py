"""The frame ledger: the only place where model output changes request state.

A result is applied atomically per row: confirmed tokens (stop conditions checked token by
token), the rollback of rejected draft positions, the drafts for the next step, and the
speculation counters. Rows whose (key, generation) no longer match a live request are
discarded, so output never lands on a request that was preempted, aborted or finished since
the frame was scheduled. A row that failed on the device fails its own request only.
"""

from __future__ import annotations

from ..wire.messages import RequestDelta
from .frame import StepFrame, StepResult
from .request import SpecCounters
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
            if req.last_applied_step >= result.step_id:
                raise LedgerError(f"step {result.step_id} applied to {row.key} after step {req.last_applied_step}")
            req.last_applied_step = result.step_id
            self.num_async_rows += sched_row.num_placeholder_inputs > 0
            req.in_flight -= 1
            req.num_placeholders -= sched_row.sampling is not None
            req.num_unverified -= sched_row.num_drafts if sched_row.sampling is not None else 0
            if row.error is not None:
                self.scheduler.finish(req, "error")
                deltas.append(RequestDelta(req.key, [], "error", row.error))
                continue
            if row.num_accepted > row.num_drafts or row.num_drafts != sched_row.num_drafts:
                raise LedgerError(f"step {result.step_id}: {row.key} accepted more drafts than it verified")
            req.num_computed_tokens -= row.num_drafts - row.num_accepted  # rejected positions are void
            drafted = row.num_drafts if row.num_drafted is None else row.num_drafted  # padding is no draft
            req.spec.record(drafted, row.num_accepted)
            self.spec.record(drafted, row.num_accepted)
            new: list[int] = []
            reason = None
            for token in row.sampled:
                req.output_token_ids.append(token)
                new.append(token)
                reason = req.stop_reason(token)
                if reason is not None:
                    break
            self.num_generated_tokens += len(new)
            logprobs = None if row.logprobs is None else row.logprobs[: len(new)]
            if reason is not None:
                self.scheduler.finish(req, reason)
                deltas.append(RequestDelta(req.key, new, reason, stats=req.spec.summary(), logprobs=logprobs))
                continue
            if req.in_flight:
                pass  # a run-ahead successor in flight already took (or skipped) these drafts
            elif row.next_draft_ids is not None:
                req.draft_token_ids = row.next_draft_ids
            else:
                req.num_draft_slots = row.num_next_drafts
            if new:
                deltas.append(RequestDelta(req.key, new, logprobs=logprobs))
        return deltas
