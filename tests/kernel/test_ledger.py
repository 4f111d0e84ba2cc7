"""The frame ledger: output lands on exactly the request state of the frame that produced it.

The state machines drive Scheduler + Ledger + BlockManager through random add / schedule /
apply / abort / preempt interleavings, with and without speculation (fixed and variable width,
lookahead slots, K=0 steps), sync and async, and run-ahead (fixed width, async: a speculative
request's next row planned as if its frame in flight accepts every draft), and check every
scheduled row and every apply against the model-free oracle in `ledger_oracle.py`.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speckernel.kernel.block_manager import BlockManager
from speckernel.kernel.frame import RowResult, ScheduledRow, StepFrame, StepResult
from speckernel.kernel.ledger import Ledger, LedgerError
from speckernel.kernel.request import Request, Status
from speckernel.kernel.scheduler import Scheduler
from speckernel.kernel.spec_policy import SpecPolicy
from speckernel.sampling_params import SamplingParams

pytest.register_assert_rewrite("tests.ledger_oracle")
from tests.kernel.ledger_oracle import EOS, Harness, Pick  # noqa: E402


def drawing(data: st.DataObject) -> Pick:
    """Random choices from hypothesis, so that failures shrink."""
    return lambda lo, hi: data.draw(st.integers(lo, hi))


class LedgerMachine(RuleBasedStateMachine):
    """Random interleavings, up to three frames in flight, every row and apply checked by the oracle."""

    width: str | None = None
    """None: no speculator; 'fixed' or 'variable' draft width."""
    async_scheduling = False
    run_ahead = False
    prompts_apart = False
    """Prompts in steps of their own (`Scheduler.prompt_tokens_apart`, drawn from 2 to 8 tokens),
    up to 1-4 of them (drawn) between two decode steps while several wait, and (drawn) steps of
    up to 1-4 prompts and 2x-3x those tokens while several wait (`Scheduler.prompt_batch`)."""

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness

    @initialize(k=st.integers(1, 3), lookahead=st.integers(0, 3), skip=st.booleans(), seqs=st.integers(2, 4),
                budget=st.integers(4, 16), blocks=st.integers(8, 20), apart=st.integers(2, 8),
                turns=st.integers(1, 4), batch_rows=st.integers(1, 4), batch_scale=st.integers(2, 3))
    def setup(self, k: int, lookahead: int, skip: bool, seqs: int, budget: int, blocks: int, apart: int,
              turns: int, batch_rows: int, batch_scale: int) -> None:
        policy = None
        if self.width is not None:
            policy = SpecPolicy(num_speculative_tokens=k, lookahead_slots=lookahead,
                                variable_width=self.width == "variable", skip_drafts=skip,
                                run_ahead=self.run_ahead)
        self.h = Harness(policy, self.async_scheduling, num_blocks=blocks, max_num_seqs=seqs,
                         max_num_batched_tokens=budget, prompt_tokens_apart=apart if self.prompts_apart else 0,
                         prompt_steps_per_decode=turns, prompt_batch=(batch_rows, batch_scale * apart))

    @rule(data=st.data(), n=st.integers(1, 4))
    def add(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            self.h.add(drawing(data))

    @rule(data=st.data(), n=st.integers(1, 12))
    def run(self, data: st.DataObject, n: int) -> None:
        """Several schedule / apply steps in a row, so that requests get far enough to draft,
        verify and finish within a short example."""
        pick = drawing(data)
        for _ in range(n):
            if self.h.in_flight and (not self.h.can_schedule() or pick(0, 1)):
                self.h.apply(pick)
            elif self.h.can_schedule():
                self.h.schedule()
            self.h.check()

    @precondition(lambda self: self.h.can_schedule())
    @rule()
    def schedule(self) -> None:
        self.h.schedule()

    @precondition(lambda self: self.h.in_flight)
    @rule(data=st.data())
    def apply(self, data: st.DataObject) -> None:
        self.h.apply(drawing(data))

    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        self.h.drain(drawing(data))

    @precondition(lambda self: self.h.sched.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.h.abort(drawing(data))

    @precondition(lambda self: self.h.sched.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.h.preempt(drawing(data))

    @invariant()
    def matches_the_oracle(self) -> None:
        self.h.check()


class AsyncLedgerMachine(LedgerMachine):
    async_scheduling = True


class FixedLedgerMachine(LedgerMachine):
    width = "fixed"


class AsyncFixedLedgerMachine(LedgerMachine):
    width, async_scheduling = "fixed", True


class VariableLedgerMachine(LedgerMachine):
    width = "variable"


class AsyncVariableLedgerMachine(LedgerMachine):
    width, async_scheduling = "variable", True


class AsyncRunAheadLedgerMachine(LedgerMachine):
    width, async_scheduling, run_ahead = "fixed", True, True


class PromptsApartLedgerMachine(LedgerMachine):
    width, async_scheduling, run_ahead, prompts_apart = "fixed", True, True, True


class VariablePromptsApartLedgerMachine(LedgerMachine):
    width, prompts_apart = "variable", True


MACHINES = (LedgerMachine, AsyncLedgerMachine, FixedLedgerMachine, AsyncFixedLedgerMachine,
            VariableLedgerMachine, AsyncVariableLedgerMachine, AsyncRunAheadLedgerMachine,
            PromptsApartLedgerMachine, VariablePromptsApartLedgerMachine)
for machine in MACHINES:
    machine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestLedgerMachine = LedgerMachine.TestCase
TestAsyncLedgerMachine = AsyncLedgerMachine.TestCase
TestFixedLedgerMachine = FixedLedgerMachine.TestCase
TestAsyncFixedLedgerMachine = AsyncFixedLedgerMachine.TestCase
TestVariableLedgerMachine = VariableLedgerMachine.TestCase
TestAsyncVariableLedgerMachine = AsyncVariableLedgerMachine.TestCase
TestAsyncRunAheadLedgerMachine = AsyncRunAheadLedgerMachine.TestCase
TestPromptsApartLedgerMachine = PromptsApartLedgerMachine.TestCase
TestVariablePromptsApartLedgerMachine = VariablePromptsApartLedgerMachine.TestCase


# --- a seeded walk: the same checks, and proof that the harness reaches every case ---------------

WALK_CASES = [(None, False, False), (None, True, False), ("fixed", False, False), ("fixed", True, False),
              ("variable", False, False), ("variable", True, False), ("fixed", True, True)]
"""(draft width, async scheduling, run-ahead)"""


def walk(width: str | None, async_scheduling: bool, seed: int, steps: int = 1200,
         run_ahead: bool = False, **harness: Any) -> Counter[str]:
    """Six kernels of random shape, driven with a seeded RNG and drained; returns the oracle's
    tallies. harness: more of the Harness's settings."""
    rng = random.Random(seed)
    stats: Counter[str] = Counter()
    for _ in range(6):
        policy = None
        if width is not None:
            policy = SpecPolicy(num_speculative_tokens=rng.randint(1, 3), lookahead_slots=rng.randint(0, 3),
                                variable_width=width == "variable", skip_drafts=rng.random() < 0.8,
                                run_ahead=run_ahead)
        h = Harness(policy, async_scheduling, num_blocks=rng.randint(8, 12), max_num_seqs=rng.randint(3, 4),
                    max_num_batched_tokens=rng.randint(4, 16), **harness)
        for _ in range(steps // 6):
            action = rng.choices(["add", "schedule", "apply", "abort", "preempt"], [3, 10, 10, 0.5, 0.5])[0]
            if action == "add":
                h.add(rng.randint)
            elif action == "schedule" and h.can_schedule():
                h.schedule()
            elif action == "apply" and h.in_flight:
                h.apply(rng.randint)
            elif action == "abort" and h.sched.requests:
                h.abort(rng.randint)
            elif action == "preempt" and h.sched.running:
                h.preempt(rng.randint)
            h.check()
        h.drain(rng.randint)
        stats += h.stats
    return stats


@pytest.mark.parametrize(("width", "async_scheduling", "run_ahead"), WALK_CASES)
def test_seeded_walk_reaches_every_case(width: str | None, async_scheduling: bool, run_ahead: bool) -> None:
    """The state machines prove nothing about a case the harness cannot produce: a seeded walk
    with the same oracle must meet each one."""
    stats = walk(width, async_scheduling, seed=1234, run_ahead=run_ahead)
    wanted = ["finish_stop", "finish_length", "finish_error", "finish_abort", "context_boundary", "preempted",
              "preempted_by_scheduler", "slot_reused", "stale_rows", "prefill_chunks"]
    if async_scheduling and width is None:
        wanted += ["placeholder_rows", "two_in_flight"]
    if width is not None:
        wanted += ["rows_with_drafts", "accept_none", "accept_some", "accept_all", "eos_inside_drafts",
                   "stop_token_inside_drafts", "length_after_accepted_drafts", "k0_frames", "drafts_trimmed"]
    if run_ahead:
        # Run-ahead rows, behind frames that verify drafts, verifying drafts of their own, and
        # really moved back on the device (their predecessor rejected some drafts).
        wanted += ["placeholder_rows", "two_in_flight", "shifted_rows", "shifted_behind_drafts",
                   "shifted_rows_with_drafts", "shifted_moved_back"]
    else:
        assert not stats["shifted_rows"], "a shifted row without run-ahead"
    missing = [w for w in wanted if not stats[w]]
    assert not missing, f"never reached: {missing} ({dict(stats)})"


def test_seeded_walk_with_prompts_apart_reaches_steps_of_several_prompts() -> None:
    stats = walk("fixed", True, seed=99, prompt_tokens_apart=4, prompt_steps_per_decode=3, prompt_batch=(3, 10))
    missing = [w for w in ("prompt_frames", "several_prompt_frames", "preempted_by_scheduler", "accept_some")
               if not stats[w]]
    assert not missing, f"never reached: {missing} ({dict(stats)})"


# --- targeted cases -------------------------------------------------------------------------------


def make(key: int, prompt: list[int], max_tokens: int, max_total: int = 100) -> Request:
    return Request(key, prompt, SamplingParams(max_tokens=max_tokens), 0, (EOS,), max_total)


def spec_kernel(k: int = 3, variable: bool = False) -> tuple[Scheduler, Ledger]:
    sched = Scheduler(BlockManager(32, 4), 4, 32,
                      SpecPolicy(num_speculative_tokens=k, lookahead_slots=k, variable_width=variable))
    return sched, Ledger(sched)


def step(sched: Scheduler, ledger: Ledger, rows: list[RowResult] | None = None, **kw: object) -> StepFrame:
    frame = sched.schedule()
    assert frame is not None
    ledger.submit(frame)
    if rows is not None:
        ledger.apply(StepResult(frame.step_id, rows, **kw))  # type: ignore[arg-type]
    return frame


def test_rollback_resumes_right_after_the_last_accepted_draft() -> None:
    sched, ledger = spec_kernel()
    req = make(1, [11, 12, 13, 14], max_tokens=20)
    sched.add(req)
    prefill = step(sched, ledger)
    g = prefill.rows[0].generation
    ledger.apply(StepResult(prefill.step_id, [RowResult(1, g, [100], num_next_drafts=3)]))
    verify = step(sched, ledger)
    (row,) = verify.rows
    assert (row.start_pos, row.token_ids, row.num_draft_slots, row.prev_step_id) == (4, [100], 3, prefill.step_id)
    # Drafts 101, 102, 103 sat at positions 5, 6, 7: accept one, reject two, sample 200.
    ledger.apply(StepResult(verify.step_id, [RowResult(1, g, [101, 200], 3, 1, num_next_drafts=3)]))
    assert req.output_token_ids == [100, 101, 200] and req.num_computed_tokens == 6
    (row,) = step(sched, ledger).rows
    assert (row.start_pos, row.token_ids, row.num_draft_slots) == (6, [200], 3)


def test_eos_inside_accepted_drafts_ends_the_request_there() -> None:
    sched, ledger = spec_kernel(variable=True)
    req = make(1, [11, 12], max_tokens=20)
    sched.add(req)
    first = step(sched, ledger)
    g = first.rows[0].generation
    ledger.apply(StepResult(first.step_id, [RowResult(1, g, [100], next_draft_ids=[101, EOS, 103])]))
    verify = step(sched, ledger)
    assert verify.rows[0].draft_token_ids == [101, EOS, 103]
    deltas = ledger.apply(StepResult(verify.step_id, [RowResult(1, g, [101, EOS, 103, 104], 3, 3)]))
    assert req.output_token_ids == [100, 101, EOS] and req.finish_reason == "stop"
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [([101, EOS], "stop")]
    assert req.slot == -1 and sched.free_slots and sched.blocks.num_free == 32


def test_max_tokens_inside_accepted_drafts_truncates() -> None:
    """The scheduler never verifies drafts past max_tokens (the machines check that); should a
    frame do so anyway, the ledger still stops at max_tokens. The frame is built by hand."""
    sched, ledger = spec_kernel()
    req = make(1, [11, 12], max_tokens=3)
    sched.add(req)
    first = step(sched, ledger)
    g = first.rows[0].generation
    ledger.apply(StepResult(first.step_id, [RowResult(1, g, [100], num_next_drafts=3)]))
    row = ScheduledRow(1, g, req.slot, 2, [100], list(req.block_ids), first.rows[0].sampling, num_draft_slots=3)
    req.in_flight, req.num_placeholders, req.num_computed_tokens = 1, 1, 6  # what scheduling it would set
    ledger.submit(StepFrame(sched.next_step_id, [row]))
    deltas = ledger.apply(StepResult(sched.next_step_id, [RowResult(1, g, [101, 102, 103, 104], 3, 3)]))
    assert req.output_token_ids == [100, 101, 102] and req.finish_reason == "length"
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [([101, 102], "length")]


def test_k0_step_proposes_nothing_and_the_request_finishes() -> None:
    sched, ledger = spec_kernel()
    req = make(1, [11, 12], max_tokens=2)
    sched.add(req)
    first = step(sched, ledger)
    assert not first.skip_drafts
    g = first.rows[0].generation
    ledger.apply(StepResult(first.step_id, [RowResult(1, g, [100], num_next_drafts=3)]))
    last = step(sched, ledger)  # one token left: the 3 drafts could never count, none are proposed
    assert last.skip_drafts and last.rows[0].num_draft_slots == 0 and req.num_draft_slots == 0
    ledger.apply(StepResult(last.step_id, [RowResult(1, g, [101])], k0=True))
    assert req.finish_reason == "length" and ledger.num_k0_steps == 1


def test_failing_row_fails_only_its_request() -> None:
    sched, ledger = spec_kernel()
    a, b = make(1, [11, 12], 5), make(2, [13, 14], 5)
    sched.add(a)
    sched.add(b)
    frame = step(sched, ledger)
    ga, gb = (r.generation for r in frame.rows)
    deltas = ledger.apply(StepResult(frame.step_id, [RowResult(1, ga, [], error="boom"),
                                                     RowResult(2, gb, [100], num_next_drafts=3)]))
    assert [(d.key, d.finish_reason, d.error) for d in deltas] == [(1, "error", "boom"), (2, None, None)]
    assert a.status is Status.FINISHED and a.finish_reason == "error" and a.slot == -1
    assert b.status is Status.RUNNING and b.output_token_ids == [100] and b.num_draft_slots == 3


def test_async_machine_really_overlaps() -> None:
    """The async machine must exercise placeholder rows, or it proves nothing new."""
    sched = Scheduler(BlockManager(16, 4), 4, 16, async_scheduling=True)
    sched.add(make(1, [1, 2, 3], max_tokens=5))
    first = sched.schedule()
    second = sched.schedule()
    assert first is not None and second is not None
    row = second.rows[0]
    assert (row.num_placeholder_inputs, row.start_pos, row.prev_step_id) == (1, 3, first.step_id)
    assert sched.schedule() is None  # at most one frame ahead


def one_frame_in_flight() -> tuple[Scheduler, Ledger, StepFrame]:
    sched = Scheduler(BlockManager(8, 4), 4, 16)
    ledger = Ledger(sched)
    sched.add(make(1, [1, 2], max_tokens=3))
    frame = sched.schedule()
    assert frame is not None
    ledger.submit(frame)
    return sched, ledger, frame


def test_result_for_a_frame_not_in_flight_is_rejected() -> None:
    sched, ledger, frame = one_frame_in_flight()
    result = StepResult(frame.step_id, [RowResult(1, frame.rows[0].generation, [5])])
    ledger.apply(result)
    with pytest.raises(LedgerError):
        ledger.apply(result)
    frame = sched.schedule()
    assert frame is not None
    ledger.submit(frame)
    with pytest.raises(LedgerError, match="do not match"):
        ledger.apply(StepResult(frame.step_id, [RowResult(1, 10**6, [5])]))


def test_stale_row_never_lands_on_the_next_owner_of_its_slot() -> None:
    sched, ledger, frame = one_frame_in_flight()
    sched.finish(sched.requests[1], "abort")
    successor = make(2, [3, 4], max_tokens=3)
    sched.add(successor)
    (row,) = step(sched, ledger).rows
    assert row.slot == frame.rows[0].slot  # the slot is reused at once
    assert ledger.apply(StepResult(frame.step_id, [RowResult(1, frame.rows[0].generation, [5])])) == []
    assert successor.output_token_ids == [] and ledger.num_stale_rows == 1


# --- run-ahead ------------------------------------------------------------------------------------


def run_ahead_kernel(k: int = 2) -> tuple[Scheduler, Ledger]:
    sched = Scheduler(BlockManager(32, 4), 4, 32, SpecPolicy(num_speculative_tokens=k, lookahead_slots=k,
                                                             variable_width=False, run_ahead=True),
                      async_scheduling=True)
    return sched, Ledger(sched)


def test_run_ahead_row_is_planned_as_if_every_draft_is_accepted() -> None:
    sched, ledger = run_ahead_kernel()
    req = make(1, [11, 12, 13], max_tokens=20)
    sched.add(req)
    prefill = step(sched, ledger)  # samples output 0 at position 3, proposes 2 drafts on the device
    g = prefill.rows[0].generation
    (row,) = step(sched, ledger).rows  # at once: its input is that output, then the 2 drafts
    assert (row.start_pos, row.num_placeholder_inputs, row.num_draft_slots, row.shifted, row.prev_step_id) == (
        3, 1, 2, True, prefill.step_id)
    assert row.sampling is not None and row.sampling.position == 1
    ledger.apply(StepResult(prefill.step_id, [RowResult(1, g, [100], num_next_drafts=2)]))
    (row,) = step(sched, ledger).rows  # behind a row verifying 2 drafts: as if it accepts both
    assert (row.start_pos, row.num_draft_slots, row.shifted, row.prev_step_id) == (6, 2, True, prefill.step_id + 1)
    assert row.sampling is not None and row.sampling.position == 4
    assert (req.num_computed_tokens, req.num_unverified, req.num_placeholders) == (9, 4, 2)
    # The verify row accepts 1 of its 2 drafts: the row behind it really starts at 6 - 1 = 5, on
    # output 200, and samples output 4 - 1 = 3; its draft slots are its own frame's, not re-credited.
    ledger.apply(StepResult(prefill.step_id + 1, [RowResult(1, g, [101, 200], 2, 1, num_next_drafts=2)]))
    assert req.output_token_ids == [100, 101, 200]
    assert (req.num_computed_tokens, req.num_unverified, req.num_placeholders, req.num_draft_slots) == (8, 2, 1, 2)


def test_run_ahead_needs_room_even_if_every_draft_is_accepted() -> None:
    sched, ledger = run_ahead_kernel()
    req = make(1, [11, 12, 13], max_tokens=3)
    sched.add(req)
    prefill = step(sched, ledger)
    g = prefill.rows[0].generation
    ahead = step(sched, ledger)
    assert ahead.rows[0].shifted and ahead.rows[0].num_draft_slots == 1  # output 1 and a draft: max_tokens
    ledger.apply(StepResult(prefill.step_id, [RowResult(1, g, [100], num_next_drafts=2)]))
    # Output 1 and its draft may fill max_tokens: nothing runs ahead, though a rejected draft
    # would leave room for one more token.
    assert sched.schedule() is None
    ledger.apply(StepResult(ahead.step_id, [RowResult(1, g, [101], 1, 0, num_next_drafts=2)]))
    (row,) = step(sched, ledger).rows
    assert not row.shifted and (row.start_pos, row.token_ids, row.num_draft_slots) == (4, [101], 0)


def test_run_ahead_successor_of_a_k0_frame_gets_no_draft_slots_back() -> None:
    """A frame whose rows are sure to finish is K=0: the step before it, applied while it is in
    flight, must not hand its drafts back to the request (they are void)."""
    sched, ledger = run_ahead_kernel()
    req = make(1, [11, 12, 13], max_tokens=2)
    sched.add(req)
    prefill = step(sched, ledger)
    g = prefill.rows[0].generation
    last = step(sched, ledger)
    assert last.skip_drafts and last.rows[0].shifted and last.rows[0].num_draft_slots == 0
    ledger.apply(StepResult(prefill.step_id, [RowResult(1, g, [100], num_next_drafts=2)]))
    assert (req.draft_token_ids, req.num_draft_slots, req.num_computed_tokens) == ([], 0, 4)


def test_run_ahead_successor_keeps_no_host_drafts_of_its_predecessor() -> None:
    """A frame holding a structured-output request copies every row's drafts to the host. A
    request that ran ahead of such a frame verifies its own frame's drafts next, never those:
    the row behind it verifies K drafts, all on the device."""
    sched, ledger = run_ahead_kernel()
    x = make(1, [11, 12], max_tokens=20)
    y = Request(2, [13, 14], SamplingParams(max_tokens=20, structured_output=True), 0, (EOS,), 100)
    sched.add(x)
    sched.add(y)
    first = step(sched, ledger)
    assert first.host_drafts
    gx, gy = (r.generation for r in first.rows)
    ahead = step(sched, ledger)  # x alone: y (structured output) waits for its frame
    assert [(r.key, r.shifted, r.num_draft_slots) for r in ahead.rows] == [(1, True, 0)] and not ahead.host_drafts
    ledger.apply(StepResult(first.step_id, [RowResult(1, gx, [100], next_draft_ids=[101, 102]),
                                            RowResult(2, gy, [200], next_draft_ids=[201, 202])],
                            num_host_draft_copies=1))
    assert (x.draft_token_ids, x.num_draft_slots) == ([], 2), "drafts the row ahead overwrote stay with x"
    ledger.apply(StepResult(ahead.step_id, [RowResult(1, gx, [103], num_next_drafts=2)]))
    row = next(r for r in step(sched, ledger).rows if r.key == 1)
    assert (row.start_pos, row.token_ids, row.draft_token_ids, row.num_draft_slots) == (3, [103], [], 2)
