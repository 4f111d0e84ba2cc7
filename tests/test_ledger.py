"""The frame ledger: output lands on exactly the request state of the frame that produced it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from speckernel.block_manager import BlockManager
from speckernel.frame import RowResult, StepFrame, StepResult
from speckernel.ledger import Ledger, LedgerError
from speckernel.request import Request, Status
from speckernel.sampling_params import SamplingParams
from speckernel.scheduler import Scheduler

NUM_BLOCKS = 24


class LedgerMachine(RuleBasedStateMachine):
    """Random add / schedule / apply (any frame in flight) / abort / preempt interleavings,
    up to four frames in flight, checked against an independent record of every token."""

    async_scheduling = False

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(BlockManager(NUM_BLOCKS, 4), max_num_seqs=4, max_num_batched_tokens=12,
                               async_scheduling=self.async_scheduling)
        self.ledger = Ledger(self.sched)
        self.in_flight: list[StepFrame] = []
        self.ids = itertools.count()
        self.tokens = itertools.count(10_000)
        self.origin: dict[int, tuple[int, str, int]] = {}  # token → (step_id, req_id, generation)
        self.expected: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}

    @rule(prompt_len=st.integers(1, 14), max_tokens=st.integers(1, 6), reuse=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, reuse: bool) -> None:
        finished = [rid for rid, r in self.reqs.items() if r.status is Status.FINISHED]
        rid = finished[0] if reuse and finished else f"r{next(self.ids)}"
        req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0, (), 10_000)
        self.reqs[rid] = req
        self.expected[rid] = []
        self.sched.add(req)

    @precondition(lambda self: len(self.in_flight) < 4)
    @rule()
    def schedule(self) -> None:
        frame = self.sched.schedule()
        if frame is not None:
            self.ledger.submit(frame)
            self.in_flight.append(frame)

    def ready(self) -> list[int]:
        """Frames that may complete now: per request, frames complete in step order (one runner,
        or a pipeline); across requests, in any order."""
        ready = []
        for i, frame in enumerate(self.in_flight):
            ids = {r.req_id for r in frame.rows}
            if not any(f.step_id < frame.step_id and ids & {r.req_id for r in f.rows} for f in self.in_flight):
                ready.append(i)
        return ready

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def apply(self, data: st.DataObject) -> None:
        frame = self.in_flight.pop(data.draw(st.sampled_from(self.ready())))
        rows = []
        for row in frame.rows:
            sampled = []
            if row.sampling is not None:
                token = next(self.tokens)
                self.origin[token] = (frame.step_id, row.req_id, row.generation)
                sampled = [token]
            rows.append(RowResult(row.req_id, row.generation, sampled))
            live = self.sched.requests.get(row.req_id)
            if live is not None and live.generation == row.generation:
                self.expected[row.req_id].extend(sampled)
        self.ledger.apply(StepResult(frame.step_id, rows))

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish(self.sched.requests[rid], "abort")

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.sched.preempt(data.draw(st.sampled_from(self.sched.running)))

    @invariant()
    def output_came_from_own_frames_in_step_order(self) -> None:
        for rid, req in self.reqs.items():
            assert req.output_token_ids == self.expected[rid][: len(req.output_token_ids)]
            steps = [self.origin[t][0] for t in req.output_token_ids]
            assert steps == sorted(steps) and len(set(steps)) == len(steps)
            assert all(self.origin[t][1] == rid for t in req.output_token_ids)
            if req.status is not Status.FINISHED:
                assert req.output_token_ids == self.expected[rid]
            assert len(req.output_token_ids) <= req.params.max_tokens

    @invariant()
    def in_flight_counts_match_frames(self) -> None:
        for rid, req in self.sched.requests.items():
            rows = sum(1 for f in self.in_flight for r in f.rows if (r.req_id, r.generation) == (rid, req.generation))
            assert req.in_flight == rows

    @invariant()
    def placeholders_match_sampling_rows_in_flight(self) -> None:
        for rid, req in self.sched.requests.items():
            rows = [r for f in self.in_flight for r in f.rows if (r.req_id, r.generation) == (rid, req.generation)]
            assert req.num_placeholders == sum(r.sampling is not None for r in rows)
            assert req.in_flight <= (2 if self.async_scheduling else 1)

    @invariant()
    def blocks_are_conserved(self) -> None:
        held = [b for r in self.sched.requests.values() for b in r.block_ids]
        assert len(held) == len(set(held))
        assert len(held) + self.sched.blocks.num_free == NUM_BLOCKS
        for req in self.reqs.values():
            if req.status is Status.FINISHED:
                assert req.block_ids == []


class AsyncLedgerMachine(LedgerMachine):
    """The same, with async scheduling: decode requests run ahead on placeholder inputs."""

    async_scheduling = True

    @invariant()
    def async_rows_happen(self) -> None:
        for frame in self.in_flight:
            for row in frame.rows:
                if row.num_placeholder_inputs:
                    assert row.token_ids == [] and row.sampling is not None


for machine in (LedgerMachine, AsyncLedgerMachine):
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase
TestAsyncLedgerMachine = AsyncLedgerMachine.TestCase


def test_async_machine_really_overlaps() -> None:
    """The async machine must exercise placeholder rows, or it proves nothing new."""
    sched = Scheduler(BlockManager(16, 4), 4, 16, async_scheduling=True)
    sched.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=5), 0, (), 100))
    first = sched.schedule()
    second = sched.schedule()
    assert first is not None and second is not None
    assert second.rows[0].num_placeholder_inputs == 1 and second.rows[0].start_pos == 3
    assert sched.schedule() is None  # at most one frame ahead


def one_frame_in_flight() -> tuple[Scheduler, Ledger, StepFrame]:
    sched = Scheduler(BlockManager(8, 4), 4, 16)
    ledger = Ledger(sched)
    sched.add(Request("a", [1, 2], SamplingParams(max_tokens=3), 0, (), 100))
    frame = sched.schedule()
    assert frame is not None
    ledger.submit(frame)
    return sched, ledger, frame


def test_result_for_a_frame_not_in_flight_is_rejected() -> None:
    sched, ledger, frame = one_frame_in_flight()
    result = StepResult(frame.step_id, [RowResult("a", frame.rows[0].generation, [5])])
    ledger.apply(result)
    with pytest.raises(LedgerError):
        ledger.apply(result)
    frame = sched.schedule()
    assert frame is not None
    ledger.submit(frame)
    with pytest.raises(LedgerError, match="do not match"):
        ledger.apply(StepResult(frame.step_id, [RowResult("a", 10**6, [5])]))


def test_stale_rows_are_discarded_after_abort_and_id_reuse() -> None:
    sched, ledger, frame = one_frame_in_flight()
    sched.finish(sched.requests["a"], "abort")
    reused = Request("a", [3, 4], SamplingParams(max_tokens=3), 0, (), 100)
    sched.add(reused)  # same id, new request: the old frame's row must not land on it
    assert ledger.apply(StepResult(frame.step_id, [RowResult("a", frame.rows[0].generation, [5])])) == []
    assert reused.output_token_ids == [] and ledger.num_stale_rows == 1
