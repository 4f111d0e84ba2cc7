"""The request's state machine: random sequences of its transitions keep the invariants that
`speckernel.kernel.request` states, and so do the scheduler and the ledger, which move requests
only through those transitions.

The machine drives one request at a time (a fresh one after each finish) through what the
scheduler and the ledger would do to it: admission, rows scheduled (prompt chunks, decode rows
with the drafts it holds, run-ahead rows behind a placeholder), results applied oldest first
(drafts accepted or not, stop tokens, a failed row), drafts reset, preemption and finishing. It
keeps its own record of the rows in flight and of the output, and checks the request against it
after every transition. The seeded walk checks the same invariants on every live request of a
real Scheduler + Ledger (the ledger's harness), so the two cannot drift apart.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from speckernel.kernel.frame import RowResult, ScheduledRow
from speckernel.kernel.request import Request, Status
from speckernel.kernel.spec_policy import SpecPolicy
from speckernel.sampling_params import RowSampling, SamplingParams
from tests.kernel.ledger_oracle import Harness

EOS = 2
STOP = 3
SAMPLING = RowSampling(1.0, 0, 1.0, 0, 0)


@dataclass(frozen=True)
class Flight:
    step_id: int
    row: ScheduledRow

    @property
    def samples(self) -> bool:
        return self.row.sampling is not None


def check_invariants(req: Request, flights: list[ScheduledRow]) -> None:
    """What the transitions promise, for a request and the rows of its generation in flight."""
    counts = {"num_computed_tokens": req.num_computed_tokens, "in_flight": req.in_flight,
              "num_placeholders": req.num_placeholders, "num_unverified": req.num_unverified,
              "num_draft_slots": req.num_draft_slots, "num_preemptions": req.num_preemptions}
    assert all(v >= 0 for v in counts.values()), f"key {req.key}: a negative count in {counts}"
    sampling = [r for r in flights if r.sampling is not None]
    assert req.in_flight == len(flights), f"key {req.key}: in_flight {req.in_flight}, {len(flights)} rows in flight"
    assert req.num_placeholders == len(sampling), \
        f"key {req.key}: {req.num_placeholders} placeholders, {len(sampling)} sampling rows in flight"
    assert req.num_unverified == sum(r.num_drafts for r in sampling), \
        f"key {req.key}: {req.num_unverified} unverified, drafts in flight {[r.num_drafts for r in sampling]}"
    assert (req.slot >= 0) == (req.status is Status.RUNNING), f"key {req.key}: slot {req.slot} while {req.status}"
    assert len(req.output_token_ids) <= req.params.max_tokens and req.num_tokens <= req.max_total_tokens
    assert req.spec.num_accepted_tokens <= req.spec.num_draft_tokens
    if req.status is Status.FINISHED:
        assert not (req.in_flight or req.draft_token_ids or req.num_draft_slots), f"key {req.key}: finished, holds some"
        return
    if req.status is Status.WAITING:
        assert req.num_computed_tokens == 0 and not req.draft_token_ids and not req.num_draft_slots, \
            f"key {req.key}: waiting with {req.num_computed_tokens} computed or drafts held"
    if req.num_placeholders:  # every known token scheduled, every sampled token and draft in flight but the last
        expected = req.num_tokens + req.num_placeholders + req.num_unverified - 1
        assert req.num_computed_tokens == expected, \
            f"key {req.key}: {req.num_computed_tokens} computed with a placeholder in flight, expected {expected}"
    else:
        assert req.num_computed_tokens < req.num_tokens, \
            f"key {req.key}: {req.num_computed_tokens} computed of {req.num_tokens} tokens, nothing sampling"


class RequestMachine(RuleBasedStateMachine):
    """One request at a time through random transitions, the way the scheduler and the ledger call them."""

    def __init__(self) -> None:
        super().__init__()
        self.generations = itertools.count(1)
        self.keys = itertools.count(1)
        self.steps = itertools.count()
        self.req: Request
        self.flights: list[Flight] = []
        self.history: list[int] = []
        """The output the request must hold: every token applied, cut at the first stop."""
        self.generation = 0
        self.slot = -1

    def renew(self) -> int:
        """The next generation (the scheduler's engine-wide counter); rows in flight go stale."""
        self.flights.clear()
        return next(self.generations)

    @initialize(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        prompt = data.draw(st.lists(st.integers(10, 99), min_size=1, max_size=12), label="prompt")
        max_total = len(prompt) + data.draw(st.integers(1, 12), label="room")
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 10), label="max_tokens"),
                                ignore_eos=data.draw(st.booleans(), label="ignore_eos"), stop_token_ids=(STOP,))
        self.req = Request(next(self.keys), prompt, params, 0, (EOS,), max_total)
        self.history = []
        self.req.enqueue(self.renew())

    @precondition(lambda self: self.req.status is Status.FINISHED)
    @rule(data=st.data())
    def next_request(self, data: st.DataObject) -> None:
        self.new_request(data)

    @precondition(lambda self: self.req.status is Status.WAITING)
    @rule(slot=st.integers(0, 7))
    def admit(self, slot: int) -> None:
        self.req.admit(slot)
        self.slot = slot

    @precondition(lambda self: self.req.status is Status.RUNNING and len(self.flights) < 4)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        """A prompt chunk or decode row on known tokens (nothing sampling in flight), or a run-ahead
        row on the placeholder a row in flight samples; either verifies drafts the request holds."""
        req = self.req
        known = req.num_tokens - req.num_computed_tokens
        if req.num_placeholders:
            n, placeholders, samples = 0, 1, True
        else:
            n, placeholders = data.draw(st.integers(1, known), label="n"), 0
            samples = n == known
        held = len(req.draft_token_ids) + req.num_draft_slots if samples else 0
        drafts = data.draw(st.integers(0, held), label="drafts")
        host = min(drafts, len(req.draft_token_ids))
        row = ScheduledRow(req.key, req.generation, req.slot, req.num_computed_tokens,
                           req.token_ids(req.num_computed_tokens, req.num_computed_tokens + n), [],
                           SAMPLING if samples else None, req.draft_token_ids[:host], drafts - host, placeholders)
        step_id = next(self.steps)
        assert req.schedule_row(step_id, n + placeholders, row.num_drafts) is samples
        assert not req.draft_token_ids and not req.num_draft_slots, "scheduling a row takes the drafts held"
        assert req.last_scheduled_step == step_id
        self.flights.append(Flight(step_id, row))

    @precondition(lambda self: self.req.status is Status.RUNNING and self.flights and self.flights[-1].samples)
    @rule(k=st.integers(0, 3))
    def expect_device_drafts(self, k: int) -> None:
        """Run-ahead: the frame just scheduled will propose k drafts that stay on the device."""
        self.req.expect_device_drafts(k)

    @precondition(lambda self: self.flights)
    @rule(data=st.data())
    def apply(self, data: st.DataObject) -> None:
        """The oldest row in flight comes back: failed, or with its accepted drafts, its sampled
        tokens (stop tokens among them) and drafts for the next row."""
        req, flight = self.req, self.flights.pop(0)
        before = req.last_applied_step
        req.land_row(flight.step_id, flight.samples, flight.row.num_drafts)
        assert req.last_applied_step == flight.step_id > before
        if data.draw(st.integers(0, 15), label="error") == 0:
            self.finish_with("error")
            return
        d = flight.row.num_drafts
        accepted = data.draw(st.integers(0, d), label="accepted")
        sampled = data.draw(st.lists(st.sampled_from([EOS, STOP, 50, 51, 52]), min_size=accepted + 1,
                                     max_size=accepted + 1), label="sampled") if flight.samples else []
        next_ids = data.draw(st.none() | st.lists(st.integers(10, 99), max_size=3), label="next_draft_ids")
        row = RowResult(req.key, req.generation, sampled, d, accepted, next_ids,
                        data.draw(st.integers(0, 3), label="num_next_drafts"))
        held = (list(req.draft_token_ids), req.num_draft_slots)
        new, reason = req.apply_result(row, d)
        expected_reason = None
        for i, token in enumerate(sampled):
            self.history.append(token)
            expected_reason = self.stop_reason(token)
            if expected_reason is not None:
                assert new == sampled[: i + 1]
                break
        else:
            assert new == sampled
        assert (reason, req.output_token_ids) == (expected_reason, self.history)
        if reason is not None:
            self.finish_with(reason)
        elif self.flights:
            assert (req.draft_token_ids, req.num_draft_slots) == held, "a successor in flight took the drafts"
        elif next_ids is not None:
            assert req.draft_token_ids == next_ids
        else:
            assert req.num_draft_slots == row.num_next_drafts

    def stop_reason(self, token: int) -> str | None:
        req = self.req
        if token == STOP or (token == EOS and not req.params.ignore_eos):
            return "stop"
        if len(self.history) >= req.params.max_tokens or len(req.prompt_token_ids) + len(self.history) >= \
                req.max_total_tokens:
            return "length"
        return None

    @rule()
    def reset_drafts(self) -> None:
        self.req.reset_drafts()
        assert not self.req.draft_token_ids and not self.req.num_draft_slots

    @precondition(lambda self: self.req.status is Status.RUNNING)
    @rule(blocks=st.lists(st.integers(0, 99), max_size=3))
    def preempt(self, blocks: list[int]) -> None:
        req = self.req
        req.grant_blocks(blocks)
        held = list(req.block_ids)
        assert req.release_blocks() == held and req.block_ids == []
        preemptions = req.num_preemptions
        assert req.preempt(self.renew()) == self.slot
        assert req.status is Status.WAITING and req.num_preemptions == preemptions + 1

    @precondition(lambda self: self.req.status is not Status.FINISHED)
    @rule(reason=st.sampled_from(["abort", "stop", "length"]))
    def finish(self, reason: str) -> None:
        self.finish_with(reason)

    def finish_with(self, reason: str) -> None:
        running = self.req.status is Status.RUNNING
        assert self.req.finish(reason, self.renew()) == (self.slot if running else -1)
        assert self.req.status is Status.FINISHED and self.req.finish_reason == reason

    @invariant()
    def generation_grows(self) -> None:
        assert self.req.generation >= self.generation, "generation went back"
        self.generation = self.req.generation

    @invariant()
    def keeps_its_promises(self) -> None:
        check_invariants(self.req, [f.row for f in self.flights])
        if self.flights:
            assert self.req.last_scheduled_step == self.flights[-1].step_id
            assert self.req.last_applied_step < self.flights[0].step_id


SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def test_random_transitions_keep_the_invariants() -> None:
    run_state_machine_as_test(RequestMachine, settings=SETTINGS)


def test_a_roll_back_skipped_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejected draft positions left counted as computed: the machine must fail (derandomized, so
    it finds the break every run)."""
    monkeypatch.setattr(Request, "roll_back", lambda self, num_rejected: None)
    broken = settings(SETTINGS, phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError, match=r"computed with a placeholder in flight|nothing sampling"):
        run_state_machine_as_test(RequestMachine, settings=broken)


WALKS = [(None, False, False), ("fixed", True, False), ("variable", False, False), ("fixed", True, True)]
"""(draft width, async scheduling, run-ahead)"""


@pytest.mark.parametrize(("width", "async_scheduling", "run_ahead"), WALKS)
def test_scheduler_and_ledger_keep_the_invariants(width: str | None, async_scheduling: bool,
                                                  run_ahead: bool) -> None:
    """A seeded walk of a real Scheduler + Ledger: after every step, every live request holds."""
    rng = random.Random(7)
    policy = None if width is None else SpecPolicy(num_speculative_tokens=3, lookahead_slots=1,
                                                   variable_width=width == "variable", run_ahead=run_ahead)
    h = Harness(policy, async_scheduling, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=10)
    for _ in range(600):
        action = rng.randint(0, 19)
        if action < 2:
            h.add(rng.randint)
        elif action == 2 and h.sched.running:
            h.preempt(rng.randint)
        elif action == 3 and h.sched.requests:
            h.abort(rng.randint)
        elif h.in_flight and (not h.can_schedule() or rng.randint(0, 1)):
            h.apply(rng.randint)
        elif h.can_schedule():
            h.schedule()
        for req in h.sched.requests.values():
            check_invariants(req, [r for f in h.in_flight for r in f.rows
                                   if (r.key, r.generation) == (req.key, req.generation)])
    assert h.ledger.spec.num_draft_tokens or width is None, "the walk never verified a draft"
