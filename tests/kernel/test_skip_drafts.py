"""K=0 steps: skip drafts exactly when no scheduled request could ever verify them."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from speckernel.kernel.block_manager import BlockManager
from speckernel.kernel.request import Request
from speckernel.kernel.scheduler import Scheduler
from speckernel.kernel.spec_policy import SpecPolicy
from speckernel.sampling_params import SamplingParams

request_state = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 8),  # max_tokens
    st.integers(0, 8),  # outputs already emitted
    st.integers(0, 3),  # drafts held for the next step
)


def could_verify_later(req: Request) -> bool:
    """Oracle from the request's own stop rule: after this step emits one token (every draft
    rejected, no EOS), is the request still running, so that a later step verifies drafts?"""
    after = copy.deepcopy(req)
    after.output_token_ids.append(0)
    return after.stop_reason(0) is None


@settings(max_examples=400, deadline=None)
@given(states=st.lists(request_state, min_size=1, max_size=6), budget=st.integers(1, 64),
       max_total=st.integers(8, 64))
def test_skip_drafts_both_directions(states, budget: int, max_total: int) -> None:  # type: ignore[no-untyped-def]
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=8, max_num_batched_tokens=budget,
                      spec=SpecPolicy(num_speculative_tokens=3, lookahead_slots=3, variable_width=False))
    for i, (prompt_len, max_tokens, emitted, drafts) in enumerate(states):
        emitted = min(emitted, max_tokens - 1)
        if prompt_len + emitted >= max_total:
            continue
        req = Request(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0,
                      (99_999,), max_total)
        req.output_token_ids = list(range(emitted))
        sched.add(req)
        if emitted:  # a decode request: everything but the last token is computed
            sched.waiting.remove(req)
            sched.running.append(req)
            req.status = req.status.RUNNING
            req.num_computed_tokens = req.num_tokens - 1
            req.num_draft_slots = drafts
    frame = sched.schedule()
    if frame is None:
        return
    usable = [r for r in frame.rows
              if r.sampling is not None and could_verify_later(sched.requests[r.key])]
    assert frame.skip_drafts == (not usable)
    for row in frame.rows:
        if row.sampling is None:  # a non-final prefill chunk proposes nothing a step could use
            assert row.start_pos + len(row.token_ids) < sched.requests[row.key].num_tokens


def test_no_skip_switch_never_skips() -> None:
    sched = Scheduler(BlockManager(64, 4), 4, 4, SpecPolicy(num_speculative_tokens=2, lookahead_slots=2,
                                                             variable_width=False, skip_drafts=False))
    sched.add(Request(1, list(range(1, 20)), SamplingParams(max_tokens=1), 0, (), 100))
    frame = sched.schedule()
    assert frame is not None and not frame.skip_drafts
