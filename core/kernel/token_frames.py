"""StepResult <-> TokenFrame: what the last pipeline stage publishes and what the ledger applies.

A frame's metadata comes from its StepFrame alone (`frame_meta`), so the stage that builds it,
the engine core and the first stage compute the same one; `result_from_frame` refuses a frame
whose metadata is not the StepFrame's, so output is applied to the (slot, generation) it was
built for or not at all.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..transport import EMPTY, FAILED, PLACEHOLDER, SAMPLED, TokenFrame
from .frame import RowResult, StepFrame, StepResult


class FrameMismatchError(RuntimeError):
    """A token frame that does not belong to the step it arrived for: a kernel or transport bug."""


def frame_meta(step: StepFrame, max_rows: int, max_k: int) -> TokenFrame:
    """The frame of `step` with its metadata set and no data yet."""
    n = len(step.rows)
    if n > max_rows:
        raise ValueError(f"step {step.step_id} has {n} rows; frames hold {max_rows}")
    frame = TokenFrame.empty(step.step_id, max_rows, max_k)
    frame.req_ids[:n] = [r.key for r in step.rows]
    frame.generations[:n] = [r.generation for r in step.rows]
    frame.slots[:n] = [r.slot for r in step.rows]
    frame.kinds[:n] = [PLACEHOLDER if r.sampling is None else SAMPLED for r in step.rows]
    return frame


def meta_digest(digest: Any, frame: TokenFrame) -> None:
    """Folds a frame's metadata into a running hash: ranks that ran the same steps agree on it."""
    digest.update(msgspec.msgpack.encode([frame.step_id, frame.req_ids.tolist(), frame.generations.tolist(),
                                          frame.slots.tolist(), frame.kinds.tolist()]))


def frame_from_result(step: StepFrame, result: StepResult, max_rows: int, max_k: int) -> TokenFrame:
    """The last stage's frame of a step's result (drafts reach the host under pipelining)."""
    frame = msgspec.structs.replace(frame_meta(step, max_rows, max_k), k0=result.k0)
    for i, (sched, row) in enumerate(zip(step.rows, result.rows, strict=True)):
        if row.error is not None:
            frame.kinds[i] = FAILED
            continue
        if sched.sampling is None:
            continue
        frame.tokens[i, : len(row.sampled)] = row.sampled
        frame.lengths[i] = len(row.sampled)
        frame.accepted[i] = row.num_accepted
        drafts = row.next_draft_ids or []
        frame.drafts[i, : len(drafts)] = drafts[:max_k]
    return frame


def result_from_frame(step: StepFrame, frame: TokenFrame) -> StepResult:
    """The StepResult the ledger applies, after checking the frame is `step`'s."""
    expected = frame_meta(step, len(frame.req_ids), frame.drafts.shape[1])
    if not expected.same_meta(frame):
        raise FrameMismatchError(f"token frame for step {frame.step_id} does not match step {step.step_id}'s rows")
    # Fixed-width drafts stayed on the device (the last stage sent them to the first): the host
    # knows only their count, K for every row that sampled, unless the step skipped drafting.
    on_device = step.num_speculative_tokens if not step.host_drafts and not frame.k0 else 0
    rows = []
    for i, sched in enumerate(step.rows):
        kind = int(frame.kinds[i])
        if kind == FAILED:
            rows.append(RowResult(sched.key, sched.generation, [], sched.num_drafts,
                                  error=f"step {step.step_id} failed on a pipeline stage"))
        elif kind == PLACEHOLDER:
            rows.append(RowResult(sched.key, sched.generation, [], sched.num_drafts))
        elif kind == SAMPLED:
            n = int(frame.lengths[i])
            drafts = frame.drafts[i]
            cut = int(np.argmax(drafts < 0)) if (drafts < 0).any() else len(drafts)
            next_ids = drafts[:cut].tolist() if step.host_drafts else None
            rows.append(RowResult(sched.key, sched.generation, frame.tokens[i, :n].tolist(), sched.num_drafts,
                                  int(frame.accepted[i]), next_draft_ids=next_ids, num_next_drafts=on_device))
        else:
            raise FrameMismatchError(f"step {step.step_id}: row {i} is empty in its token frame")
    if (frame.kinds[len(step.rows):] != EMPTY).any():
        raise FrameMismatchError(f"step {step.step_id}: token frame has rows past the step's")
    return StepResult(step.step_id, rows, k0=frame.k0)
