"""A model-free oracle for Scheduler + Ledger + BlockManager, and a simulated runner.

The oracle never asks the ledger what a request's state should be: it keeps, per request, the
confirmed token history (prompt plus every token the simulated runner produced for a live row,
cut at the stop conditions it computes itself), the number of positions whose KV is valid, the
drafts outstanding (their token values, also for fixed width, where the kernel knows only the
count) and the rows in flight. From that record alone it predicts every scheduled row's start
position, host input tokens, placeholder inputs, drafts to verify, slot, `prev_step_id` and
`shifted`, and after every apply the deltas, the outputs and the counters.

Run-ahead (`SpecPolicy.run_ahead`): a row scheduled behind a frame in flight that verifies d
drafts is planned as if that frame accepts all d. The oracle predicts the planned (optimistic)
row, and learns the row's real start only when the frame before it is applied: planned start
minus the drafts that frame rejected. The simulated runner keeps its own token buffer per
(slot, generation) and the drafts each slot's latest step rejected, like the device: it moves a
shifted row back by that count, reads the row's inputs there, and writes what it samples at the
moved-back positions; every token the ledger delivers must sit at the history index where the
runner wrote it.

`Harness` drives one kernel through add / schedule / apply / abort / preempt with random
choices from a `Pick` (hypothesis draws in the state machine, `random.Random` in the seeded
walk), so both tests share one set of checks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from speckernel.kernel.block_manager import BlockManager
from speckernel.kernel.frame import RowResult, ScheduledRow, StepFrame, StepResult
from speckernel.kernel.ledger import Ledger
from speckernel.kernel.request import Request, Status
from speckernel.kernel.scheduler import Scheduler
from speckernel.kernel.spec_policy import SpecPolicy
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import RequestDelta

Pick = Callable[[int, int], int]
"""pick(lo, hi): a random integer in [lo, hi], both ends included."""

EOS = 2
STOP = 3
FRESH = 1000
"""Runner tokens are unique from here on (EOS and STOP excepted), so each names its origin."""


@dataclass(eq=False)
class Flight:
    """A row of a frame in flight, as the oracle recorded it when it was scheduled."""

    step_id: int
    row: ScheduledRow
    drafts: list[int | None]
    """Token values of the drafts the row verifies (the oracle's record, host or device); for a
    run-ahead row, None until the frame before it (which proposes them) has been applied."""
    samples: bool
    real_start: int | None
    """Where the row really starts: its start_pos, or for a run-ahead row start_pos minus the
    drafts the frame before it rejected (None until that frame is applied)."""


@dataclass(eq=False)
class Track:
    """The oracle's own record of one request."""

    req: Request
    """The kernel's object: only compared with the record, never used to build it."""
    prompt: list[int]
    params: SamplingParams
    max_total: int
    history: list[int]
    kv: int = 0
    """Positions [0, kv) hold valid KV once the applied frames have run (rejected drafts excluded)."""
    drafts: list[int | None] = field(default_factory=list)
    """Drafts the next row may verify; with run-ahead, those a frame in flight will propose
    (values unknown, None) count from the moment it is scheduled."""
    drafts_on_host: bool = False
    draft_step: int = -1
    """Step whose result proposed `drafts` (they sit in the token buffer since then)."""
    flights: list[Flight] = field(default_factory=list)
    slot: int | None = None
    generation: int | None = None
    generations: set[int] = field(default_factory=set)
    finished: str | None = None
    preemptions: int = 0
    origin_steps: list[int] = field(default_factory=list)
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.history) - len(self.prompt)

    @property
    def pending(self) -> int:
        """Tokens being sampled by rows in flight: their values are still on the device."""
        return sum(f.samples for f in self.flights)

    @property
    def unverified(self) -> int:
        """Drafts verified by rows in flight: a run-ahead row is planned as if all are accepted."""
        return sum(f.row.num_drafts for f in self.flights if f.samples)

    def stop_reason(self) -> str | None:
        """The stop rule, written from the sampling parameters (not from Request.stop_reason)."""
        token = self.history[-1]
        if token == EOS and not self.params.ignore_eos:
            return "stop"
        if token in self.params.stop_token_ids:
            return "stop"
        if self.num_output >= self.params.max_tokens or len(self.history) >= self.max_total:
            return "length"
        return None


class Oracle:
    def __init__(self, policy: SpecPolicy | None, async_scheduling: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, block_size: int, prompt_tokens_apart: int = 0,
                 prompt_batch: tuple[int, int] = (1, 0)) -> None:
        self.policy = policy
        self.prompt_tokens_apart = prompt_tokens_apart
        self.prompt_batch = prompt_batch
        self.async_scheduling = async_scheduling
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.tracks: dict[int, Track] = {}
        self.slot_owner: dict[int, int] = {}
        self.last_step_id = -1
        self.fresh = itertools.count(FRESH)
        self.origin: dict[int, tuple[int, int, int]] = {}
        """Unique runner token → (step id, key of the row it was produced for, the buffer position
        the runner wrote it at; -1 for a stale row)."""
        self.buffer: dict[tuple[int, int], dict[int, int]] = {}
        """The runner's token buffer: (slot, generation) → position → token."""
        self.rejected: dict[tuple[int, int], int] = {}
        """The runner's per (slot, generation): drafts its latest step rejected."""
        self.completed: dict[tuple[int, int], int] = {}
        """The runner's per (slot, generation): the latest step that completed there."""
        self.proposed: dict[tuple[int, int], list[int]] = {}
        self.num_stale_rows = 0
        self.num_k0_steps = 0
        self.num_generated = 0
        self.num_host_draft_copies = 0
        self.stats: Counter[str] = Counter()
        self.slots_seen: set[int] = set()

    # --- requests --------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.tracks[req.key] = Track(req, list(req.prompt_token_ids), req.params, req.max_total_tokens,
                                     list(req.prompt_token_ids))

    def _release(self, t: Track) -> None:
        if t.slot is not None:
            owner = self.slot_owner.pop(t.slot)
            assert owner == t.req.key, f"oracle: slot {t.slot} held by {owner}, not {t.req.key}"
            t.slot = None
        t.flights, t.drafts, t.drafts_on_host = [], [], False

    def preempted(self, t: Track) -> None:
        """Preemption by recompute: KV and slot gone, confirmed history kept."""
        self._release(t)
        t.kv = 0
        t.preemptions += 1
        self.stats["preempted"] += 1

    def finished(self, t: Track, reason: str) -> None:
        self._release(t)
        t.finished = reason
        self.stats[f"finish_{reason}"] += 1

    # --- schedule --------------------------------------------------------------------------

    def scheduled(self, frame: StepFrame | None) -> None:
        """Checks a new frame row by row against the record, then records its rows in flight."""
        for t in self.tracks.values():  # preemptions the scheduler decided on its own
            if t.finished is None and t.req.num_preemptions > t.preemptions:
                assert t.req.num_preemptions == t.preemptions + 1, "preempted twice in one schedule()"
                self.preempted(t)
                self.stats["preempted_by_scheduler"] += 1
        if frame is None:
            return
        assert frame.step_id > self.last_step_id, "step ids must strictly increase"
        self.last_step_id = frame.step_id
        policy = self.policy
        assert frame.num_speculative_tokens == (policy.num_speculative_tokens if policy else 0), "wrong K"
        assert len({r.key for r in frame.rows}) == len(frame.rows), "one row per request per frame"
        if self.prompt_tokens_apart:  # a prompt step holds prompt rows of at most that many tokens each
            prompt_rows = [r for r in frame.rows if r.num_tokens - r.num_drafts > 1]
            apart, (max_rows, batch_tokens) = self.prompt_tokens_apart, self.prompt_batch
            several = len(frame.rows) > 1
            assert not prompt_rows or all(r.num_tokens <= apart for r in frame.rows), \
                f"step {frame.step_id}: a prompt row runs past {apart} tokens"
            assert not prompt_rows or not several or (
                len(prompt_rows) == len(frame.rows) <= max_rows and frame.num_tokens <= batch_tokens), \
                f"step {frame.step_id}: a prompt shares its step with a decode row, or a prompt step is over its bounds"
            self.stats["prompt_frames"] += bool(prompt_rows)
            self.stats["several_prompt_frames"] += bool(prompt_rows) and several
        budget = self.max_num_batched_tokens
        may_use_drafts = False
        for row in frame.rows:
            t = self.tracks[row.key]
            self._check_row(frame.step_id, row, t, budget)
            budget -= row.num_tokens
            assert budget >= 0, f"step {frame.step_id} is over the token budget"
            if row.sampling is not None:  # t.pending now counts this row: emitted/projected are after it
                emitted, projected = t.num_output + t.pending, len(t.history) + t.pending
                may_use_drafts |= emitted < t.params.max_tokens and projected < t.max_total
        expect_skip = policy is not None and policy.skip_drafts and not may_use_drafts
        assert frame.skip_drafts == expect_skip, f"step {frame.step_id}: skip_drafts {frame.skip_drafts}"
        expect_host = policy is not None and (
            policy.variable_width or any(self.tracks[r.key].params.structured_output for r in frame.rows))
        assert frame.host_drafts == expect_host, f"step {frame.step_id}: host_drafts {frame.host_drafts}"
        if policy is not None and policy.run_ahead and not frame.skip_drafts and not frame.host_drafts:
            # Drafts proposed on the device after this frame: a run-ahead row may verify them
            # before the frame is applied, so they are outstanding now (values still unknown).
            for row in frame.rows:
                if row.sampling is not None:
                    t = self.tracks[row.key]
                    t.drafts, t.drafts_on_host = [None] * policy.num_speculative_tokens, False
                    t.draft_step = frame.step_id
        self.stats["frames"] += 1
        self.stats["k0_frames"] += frame.skip_drafts

    def _check_row(self, step_id: int, row: ScheduledRow, t: Track, budget: int) -> None:
        what = f"step {step_id} key {row.key}"
        assert t.finished is None, f"{what}: scheduled after it finished ({t.finished})"
        assert row.generation == t.req.generation, f"{what}: a new row carries an old generation"
        if t.slot is None:  # admission (or re-admission after preemption)
            assert not t.flights and t.kv == 0, f"{what}: admitted with frames in flight or KV kept"
            assert 0 <= row.slot < self.max_num_seqs, f"{what}: slot {row.slot} out of range"
            assert row.slot not in self.slot_owner, f"{what}: slot {row.slot} is held by {self.slot_owner[row.slot]}"
            assert row.generation not in t.generations, f"{what}: generation reused"
            self.slot_owner[row.slot] = row.key
            t.slot, t.generation = row.slot, row.generation
            t.generations.add(row.generation)
            self.stats["slot_reused"] += row.slot in self.slots_seen
            self.slots_seen.add(row.slot)
        assert row.slot == t.slot, f"{what}: slot {row.slot}, the request holds {t.slot}"
        assert row.generation == t.generation, f"{what}: generation changed without preemption"
        run_ahead = self.policy is not None and self.policy.run_ahead
        # Rows in flight count as if they accept every draft they verify (only a run-ahead row is
        # ever scheduled behind one that verifies drafts): `unverified` is 0 in the other modes.
        known, pending, unverified = len(t.history), t.pending, t.unverified
        projected = known + pending + unverified
        emitted = t.num_output + pending + unverified
        if t.flights:
            last = t.flights[-1]
            assert run_ahead or last.row.num_drafts == 0, \
                f"{what}: scheduled behind step {last.step_id}, acceptance unknown"
            assert last.real_start is not None, \
                f"{what}: scheduled behind step {last.step_id}, whose own start is not known yet"
            expect_start = last.real_start + last.row.num_tokens  # as if it accepts all its drafts
        else:
            expect_start = t.kv
        assert row.start_pos == expect_start, f"{what}: start_pos {row.start_pos}, valid KV ends at {expect_start}"
        n, p, d = len(row.token_ids), row.num_placeholder_inputs, row.num_drafts
        assert not n or row.start_pos + n <= known, f"{what}: host inputs past the confirmed history"
        assert row.token_ids == t.history[row.start_pos:row.start_pos + n], f"{what}: wrong input tokens"
        assert p or not t.flights, f"{what}: scheduled behind step {t.flights[-1].step_id} with no placeholder"
        if p:
            assert self.async_scheduling, f"{what}: placeholder input in sync mode"
            assert row.start_pos + n == known + unverified, f"{what}: placeholder where the host knows the token"
            assert row.start_pos + n + p <= projected, f"{what}: placeholder no frame in flight samples"
            assert emitted < t.params.max_tokens and projected < t.max_total, \
                f"{what}: scheduled ahead, but even if step {t.flights[-1].step_id} accepts all " \
                f"{unverified} drafts the request may not emit another token (output {emitted} of " \
                f"{t.params.max_tokens}, {projected} tokens of {t.max_total})"
            if self.policy is not None:
                assert run_ahead, f"{what}: a speculative request scheduled behind its frame without run-ahead"
                assert not t.params.structured_output, f"{what}: a structured-output request runs ahead"
                assert n == 0, f"{what}: a run-ahead row with host inputs"
            self.stats["placeholder_rows"] += 1
        expect_shifted = p > 0 and self.policy is not None
        assert row.shifted == expect_shifted, f"{what}: shifted={row.shifted}, expected {expect_shifted}"
        final = row.start_pos + n + p == projected
        assert (row.sampling is not None) == final, f"{what}: samples={row.sampling is not None}, final={final}"
        expect_d = 0
        if final:
            assert row.sampling is not None
            assert row.sampling.position == emitted and row.sampling.seed == t.req.seed, \
                f"{what}: samples output index {row.sampling.position}, expected {emitted}"
            room = min(budget - n - p, t.params.max_tokens - emitted - 1, t.max_total - projected - 1)
            expect_d = min(len(t.drafts), max(room, 0))
            self.stats["drafts_trimmed"] += expect_d < len(t.drafts)
        assert d == expect_d, f"{what}: verifies {d} drafts, outstanding {len(t.drafts)}, expected {expect_d}"
        if t.drafts_on_host:
            assert row.draft_token_ids == t.drafts[:d] and row.num_draft_slots == 0, f"{what}: wrong host drafts"
        else:
            assert row.draft_token_ids == [] and row.num_draft_slots == d, f"{what}: wrong draft slots"
        expect_prev = t.flights[-1].step_id if p else t.draft_step if d else -1
        assert row.prev_step_id == expect_prev, f"{what}: prev_step_id {row.prev_step_id}, expected {expect_prev}"
        lookahead = self.policy.lookahead_slots if self.policy is not None else 0
        need = min(row.start_pos + row.num_tokens + lookahead, t.max_total + lookahead)
        assert len(row.block_ids) * self.block_size >= need, f"{what}: blocks for {need} KV slots missing"
        assert row.block_ids == t.req.block_ids, f"{what}: the row names blocks the request does not hold"
        t.flights.append(Flight(step_id, row, t.drafts[:d], final, None if row.shifted else row.start_pos))
        t.drafts, t.drafts_on_host = [], False  # verified now, or void: the new token overwrites them
        assert len(t.flights) <= (2 if self.async_scheduling else 1), f"{what}: too many frames in flight"
        self.stats["two_in_flight"] += len(t.flights) == 2
        self.stats["rows_with_drafts"] += d > 0
        self.stats["shifted_rows"] += row.shifted
        self.stats["shifted_rows_with_drafts"] += row.shifted and d > 0
        self.stats["shifted_behind_drafts"] += row.shifted and unverified > 0
        self.stats["prefill_chunks"] += not final

    # --- the simulated runner ----------------------------------------------------------------

    def token(self, pick: Pick, step_id: int, key: int, pos: int = -1) -> int:
        kind = pick(0, 15)
        if kind == 0:
            return EOS
        if kind == 1:
            return STOP
        token = next(self.fresh)
        self.origin[token] = (step_id, key, pos)
        return token

    def _live(self, step_id: int, row: ScheduledRow) -> Flight | None:
        t = self.tracks[row.key]
        for f in t.flights:
            if f.step_id == step_id and f.row.generation == row.generation:
                return f
        return None

    def run(self, frame: StepFrame, pick: Pick) -> StepResult:
        """What a runner returns for the frame: per sampling row, a accepted drafts (the very
        tokens the row verifies) and one new token; then drafts for the next step."""
        policy, rows = self.policy, []
        for row in frame.rows:
            flight = self._live(frame.step_id, row)
            d = row.num_drafts
            if pick(0, 24) == 0:
                rows.append(RowResult(row.key, row.generation, [], d, error="boom"))
                continue
            if flight is None:  # a stale row: the runner still answers, the ledger must drop it
                if row.sampling is None:
                    rows.append(RowResult(row.key, row.generation, []))
                    continue
                a = pick(0, d)
                drafts = [self.token(pick, frame.step_id, row.key) for _ in range(d)]
                sampled = [*drafts[:a], self.token(pick, frame.step_id, row.key)]
                out = -1
            else:
                inputs = self._read_inputs(frame.step_id, row, flight)
                if row.sampling is None:
                    rows.append(RowResult(row.key, row.generation, []))
                    continue
                a = pick(0, d)
                n = len(row.token_ids) + row.num_placeholder_inputs
                drafts = inputs[n:]
                out = flight.real_start + n  # where the row's first output goes (its first draft's place)
                sampled = [*drafts[:a], self.token(pick, frame.step_id, row.key, out + a)]
                buf = self.buffer[(row.slot, row.generation)]
                for j, token in enumerate(sampled):
                    buf[out + j] = token
                self.rejected[(row.slot, row.generation)] = d - a
            next_ids, num_next = None, 0
            if policy is not None and not frame.skip_drafts:
                k = policy.num_speculative_tokens
                width = pick(0, k) if policy.variable_width else k
                at = out + a + 1 if out >= 0 else -1  # right after the new token
                proposal = [self.token(pick, frame.step_id, row.key, at + j if at >= 0 else -1) for j in range(width)]
                self.proposed[(frame.step_id, row.key)] = proposal
                if at >= 0:
                    for j, token in enumerate(proposal):
                        self.buffer[(row.slot, row.generation)][at + j] = token
                if frame.host_drafts:
                    next_ids = proposal
                else:
                    num_next = k
            rows.append(RowResult(row.key, row.generation, sampled, d, a, next_ids, num_next))
        copies = int(policy is not None and frame.host_drafts and not frame.skip_drafts
                     and any(r.sampling is not None for r in frame.rows))
        return StepResult(frame.step_id, rows, k0=policy is not None and frame.skip_drafts,
                          num_host_draft_copies=copies)

    def _read_inputs(self, step_id: int, row: ScheduledRow, flight: Flight) -> list[int]:
        """The device side of a live row: it refuses a row whose predecessor did not complete for
        its (slot, generation), moves a shifted row back by the drafts its predecessor rejected,
        writes the host inputs (and host drafts) into the buffer and reads every input from there.
        The inputs must be the confirmed history and the drafts the oracle recorded."""
        t, dev = self.tracks[row.key], (row.slot, row.generation)
        what = f"runner, step {step_id} key {row.key}"
        buf = self.buffer.setdefault(dev, {})
        if row.prev_step_id >= 0:
            assert self.completed.get(dev) == row.prev_step_id, \
                f"{what}: reads step {row.prev_step_id}, but step {self.completed.get(dev)} ran last in its slot"
        back = self.rejected.get(dev, 0) if row.shifted else 0
        start = row.start_pos - back
        assert start == flight.real_start, f"{what}: moved back to {start}, the oracle starts it at {flight.real_start}"
        n, p = len(row.token_ids), row.num_placeholder_inputs
        for i, token in enumerate([*row.token_ids, *([0] * p), *row.draft_token_ids]):
            if not n <= i < n + p:
                buf[start + i] = token
        missing = [pos for pos in range(start, start + row.num_tokens) if pos not in buf]
        assert not missing, f"{what}: reads positions {missing} that no step wrote"
        inputs = [buf[pos] for pos in range(start, start + row.num_tokens)]
        assert start + n + p == len(t.history) if row.sampling is not None else start + n <= len(t.history), \
            f"{what}: the row ends at {start + n + p}, the confirmed history at {len(t.history)}"
        assert inputs[:n + p] == t.history[start:start + n + p], f"{what}: inputs are not the confirmed history"
        assert inputs[n + p:] == flight.drafts, f"{what}: drafts {inputs[n + p:]} in the buffer, {flight.drafts} noted"
        if row.sampling is not None:
            assert row.sampling.position - back == t.num_output, \
                f"{what}: samples output {row.sampling.position} - {back}, the request has {t.num_output}"
        else:
            self.rejected[dev] = 0
        self.completed[dev] = step_id
        self.stats["shifted_moved_back"] += back > 0
        return inputs

    # --- apply -----------------------------------------------------------------------------

    def applied(self, frame: StepFrame, result: StepResult, deltas: list[RequestDelta]) -> None:
        """Updates the record from the result and checks the deltas the ledger emitted."""
        self.num_k0_steps += result.k0
        self.num_host_draft_copies += result.num_host_draft_copies
        expected: list[tuple[int, list[int], str | None, str | None]] = []
        for row, res in zip(frame.rows, result.rows, strict=True):
            t = self.tracks[row.key]
            proposal = self.proposed.pop((frame.step_id, row.key), [])
            flight = self._live(frame.step_id, row)
            if flight is None:
                self.num_stale_rows += 1
                self.stats["stale_rows"] += 1
                continue
            assert t.flights[0] is flight, "frames of one request apply in step order"
            t.flights.pop(0)
            if res.error is not None:
                self.finished(t, "error")
                expected.append((row.key, [], "error", res.error))
                continue
            d, a = res.num_drafts, res.num_accepted
            if d:
                t.verify_steps += 1
                t.drafted += d
                t.accepted += a
                grow = d - len(t.drafted_per_pos)
                t.drafted_per_pos += [0] * max(grow, 0)
                t.accepted_per_pos += [0] * max(grow, 0)
                for j in range(d):
                    t.drafted_per_pos[j] += 1
                    t.accepted_per_pos[j] += j < a
                self.stats["accept_none" if a == 0 else "accept_all" if a == d else "accept_some"] += 1
            assert flight.real_start is not None, "oracle: a row applied before the one it runs behind"
            if row.sampling is None:  # a prefill chunk: its KV is written, nothing confirmed
                t.kv = flight.real_start + len(row.token_ids)
                continue
            new: list[int] = []
            reason = None
            for i, token in enumerate(res.sampled):
                t.history.append(token)
                t.origin_steps.append(frame.step_id)
                new.append(token)
                reason = t.stop_reason()
                if reason is not None:
                    if i < len(res.sampled) - 1:
                        self.stats["eos_inside_drafts" if token == EOS else "stop_token_inside_drafts"] += 1
                    if reason == "length" and a:
                        self.stats["length_after_accepted_drafts"] += 1
                    if reason == "length" and len(t.history) >= t.max_total:
                        self.stats["context_boundary"] += 1
                    break
            self.num_generated += len(new)
            if reason is not None:
                self.finished(t, reason)
                expected.append((row.key, new, reason, None))
                continue
            # Valid KV: every input fed except the rejected drafts; the new token is not fed yet.
            t.kv = flight.real_start + len(row.token_ids) + row.num_placeholder_inputs + a
            assert t.kv == len(t.history) - 1, "oracle: KV and history disagree"
            if not t.flights:  # drafts sit right after the new token: usable by the next row only
                t.drafts, t.drafts_on_host, t.draft_step = list(proposal), res.next_draft_ids is not None, frame.step_id
            else:  # a row scheduled behind this one: the drafts it verifies are these, or none
                successor = t.flights[0]
                if successor.row.shifted:
                    # Planned as if this row accepted all d drafts: it really starts d - a earlier,
                    # on the token this row just sampled.
                    assert successor.row.prev_step_id == frame.step_id
                    successor.real_start = successor.row.start_pos - (d - a)
                    assert successor.real_start == t.kv, "oracle: the moved-back successor misses the new token"
                    k = successor.row.num_drafts
                    assert k == 0 or (len(proposal) >= k and res.next_draft_ids is None), \
                        f"oracle: step {successor.step_id} verifies {k} drafts step {frame.step_id} did not leave"
                    successor.drafts = proposal[:k]
            expected.append((row.key, new, None, None))
        got = [(x.key, x.new_token_ids, x.finish_reason, x.error) for x in deltas]
        expected = [e for e in expected if e[1] or e[2]]
        assert got == expected, f"step {frame.step_id}: deltas {got}, expected {expected}"
        for x in deltas:
            assert (x.stats is not None) == (x.finish_reason not in (None, "error")), f"stats on {x}"

    # --- invariants ------------------------------------------------------------------------

    def check(self, sched: Scheduler, ledger: Ledger, in_flight: list[StepFrame]) -> None:
        running = [t for t in self.tracks.values() if t.slot is not None]
        for t in self.tracks.values():
            self._check_track(sched, t)
        assert {id(r) for r in sched.running} == {id(t.req) for t in running}, "running set differs from the oracle's"
        alive = {t.req.key for t in self.tracks.values() if t.finished is None}
        assert set(sched.requests) == alive, f"live keys {sorted(sched.requests)}, expected {sorted(alive)}"
        assert {r.key for r in sched.waiting} == alive - {t.req.key for t in running}, "waiting set differs"
        held = [t.slot for t in running]
        assert sorted([*sched.free_slots, *held]) == list(range(self.max_num_seqs)), \
            f"slots not conserved: free {sched.free_slots}, held {held}"
        blocks = [b for r in sched.requests.values() for b in r.block_ids]
        assert len(blocks) == len(set(blocks)), "a block is held twice"
        assert sorted([*blocks, *sched.blocks.free_blocks]) == list(range(sched.blocks.num_blocks)), \
            "blocks not conserved"
        assert set(ledger.in_flight) == {f.step_id for f in in_flight}, "ledger in-flight frames differ"
        tracks = self.tracks.values()
        got = (ledger.spec.num_verify_steps, ledger.spec.num_draft_tokens, ledger.spec.num_accepted_tokens,
               ledger.num_stale_rows, ledger.num_k0_steps, ledger.num_generated_tokens, ledger.num_host_draft_copies)
        want = (sum(t.verify_steps for t in tracks), sum(t.drafted for t in tracks), sum(t.accepted for t in tracks),
                self.num_stale_rows, self.num_k0_steps, self.num_generated, self.num_host_draft_copies)
        assert got == want, f"ledger counters (verify steps, drafted, accepted, stale, k0, generated, copies) {got}, " \
                            f"expected {want}"

    def _check_track(self, sched: Scheduler, t: Track) -> None:
        req, key = t.req, t.req.key
        assert req.output_token_ids == t.history[len(t.prompt):], f"key {key}: output differs from the oracle's"
        assert len(req.output_token_ids) <= t.params.max_tokens and req.num_tokens <= t.max_total, \
            f"key {key}: past max_tokens or the context"
        made = []  # an accepted draft was made by the step that proposed it, confirmed by a later one
        for i, (token, confirmed) in enumerate(zip(req.output_token_ids, t.origin_steps, strict=True)):
            if token >= FRESH:
                step, owner, pos = self.origin[token]
                assert owner == key and step <= confirmed, f"key {key}: token {token} came from {(step, owner)}"
                assert pos == len(t.prompt) + i, \
                    f"key {key}: output {i} (token {token}) was written at position {pos}, not {len(t.prompt) + i}"
                made.append(step)
        assert made == sorted(made) and t.origin_steps == sorted(t.origin_steps), f"key {key}: out of step order"
        assert (req.spec.num_verify_steps, req.spec.num_draft_tokens, req.spec.num_accepted_tokens) == (
            t.verify_steps, t.drafted, t.accepted), f"key {key}: speculation counters"
        assert (req.spec.drafted_per_position, req.spec.accepted_per_position) == (
            t.drafted_per_pos, t.accepted_per_pos), f"key {key}: per-position counters"
        if t.finished is not None:
            assert req.status is Status.FINISHED and req.finish_reason == t.finished, \
                f"key {key}: {req.status} {req.finish_reason}, expected finished ({t.finished})"
            assert req.block_ids == [] and req.slot == -1 and key not in sched.requests, \
                f"key {key}: finished but holds blocks {req.block_ids} / slot {req.slot}, or is still known"
            return
        assert sched.requests.get(key) is req, f"key {key} should be alive"
        assert (req.status is Status.RUNNING) == (t.slot is not None), f"key {key}: status {req.status}"
        assert req.slot == (t.slot if t.slot is not None else -1), f"key {key}: slot {req.slot}, expected {t.slot}"
        assert (req.in_flight, req.num_placeholders, req.num_unverified) == (len(t.flights), t.pending, t.unverified), \
            f"key {key}: {req.in_flight} in flight / {req.num_placeholders} placeholders / " \
            f"{req.num_unverified} unverified drafts, expected {len(t.flights)} / {t.pending} / {t.unverified}"
        if t.drafts_on_host:
            outstanding = (req.draft_token_ids, req.num_draft_slots) == (t.drafts, 0)
        else:
            outstanding = (req.draft_token_ids, req.num_draft_slots) == ([], len(t.drafts))
        assert outstanding, (f"key {key}: kernel holds drafts {req.draft_token_ids}+{req.num_draft_slots} slots, "
                             f"outstanding per the oracle: {t.drafts}")
        if not t.flights:
            assert req.num_computed_tokens == t.kv, f"key {key}: {req.num_computed_tokens} computed, valid KV {t.kv}"
        else:  # up to the last row in flight, as if it accepts all its drafts
            last = t.flights[-1]
            end = (last.real_start if last.real_start is not None else last.row.start_pos) + last.row.num_tokens
            assert req.num_computed_tokens == end, f"key {key}: {req.num_computed_tokens} computed, " \
                                                   f"the last row in flight ends at {end}"


class Harness:
    """One kernel (Scheduler + Ledger + BlockManager) driven by random choices, checked by the oracle."""

    def __init__(self, policy: SpecPolicy | None, async_scheduling: bool, *, num_blocks: int = 24,
                 block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 12,
                 max_frames_in_flight: int = 3, prompt_tokens_apart: int = 0,
                 prompt_steps_per_decode: int = 1, prompt_batch: tuple[int, int] = (1, 0)) -> None:
        self.sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens,
                               spec=policy, async_scheduling=async_scheduling, prompt_tokens_apart=prompt_tokens_apart,
                               prompt_steps_per_decode=prompt_steps_per_decode, prompt_batch=prompt_batch)
        self.ledger = Ledger(self.sched)
        self.oracle = Oracle(policy, async_scheduling, max_num_seqs, max_num_batched_tokens, block_size,
                             prompt_tokens_apart, prompt_batch)
        self.in_flight: list[StepFrame] = []
        self.max_frames_in_flight = max_frames_in_flight
        self.keys = itertools.count(1)

    @property
    def stats(self) -> Counter[str]:
        return self.oracle.stats

    def add(self, pick: Pick) -> None:
        key = next(self.keys)
        prompt = [10 + (key * 7 + i * 13) % 90 for i in range(pick(1, 14))]
        max_total = len(prompt) + pick(1, 5) if pick(0, 3) == 0 else 10_000
        params = SamplingParams(max_tokens=pick(1, 8), ignore_eos=pick(0, 3) == 0,
                                stop_token_ids=(STOP,) if pick(0, 1) else (), structured_output=pick(0, 5) == 0)
        req = Request(key, prompt, params, key * 31, (EOS,), max_total)
        self.sched.add(req)
        self.oracle.add(req)
        self.stats["added"] += 1

    def can_schedule(self) -> bool:
        return len(self.in_flight) < self.max_frames_in_flight

    def schedule(self) -> None:
        frame = self.sched.schedule()
        self.oracle.scheduled(frame)
        if frame is not None:
            self.ledger.submit(frame)
            self.in_flight.append(frame)

    def ready(self) -> list[int]:
        """Frames that may complete now: per request in step order, across requests in any order."""
        ready = []
        for i, frame in enumerate(self.in_flight):
            keys = {r.key for r in frame.rows}
            if not any(keys & {r.key for r in f.rows} for f in self.in_flight[:i]):
                ready.append(i)
        return ready

    def apply(self, pick: Pick) -> None:
        ready = self.ready()
        frame = self.in_flight.pop(ready[pick(0, len(ready) - 1)])
        result = self.oracle.run(frame, pick)
        deltas = self.ledger.apply(result)
        self.oracle.applied(frame, result, deltas)

    def abort(self, pick: Pick) -> None:
        keys = sorted(self.sched.requests)
        req = self.sched.requests[keys[pick(0, len(keys) - 1)]]
        self.sched.finish(req, "abort")
        self.oracle.finished(self.oracle.tracks[req.key], "abort")

    def preempt(self, pick: Pick) -> None:
        req = self.sched.running[pick(0, len(self.sched.running) - 1)]
        self.sched.preempt(req)
        self.oracle.preempted(self.oracle.tracks[req.key])

    def drain(self, pick: Pick) -> None:
        """Runs until every request has finished: the kernel must never get stuck."""
        for _ in range(2000):
            if self.in_flight and (not self.can_schedule() or pick(0, 1)):
                self.apply(pick)
            elif self.sched.requests:
                before = len(self.in_flight)
                self.schedule()
                assert self.in_flight or len(self.in_flight) > before, \
                    f"stuck: nothing in flight and nothing scheduled, live {sorted(self.sched.requests)}"
            else:
                return
            self.check()
        raise AssertionError(f"no end in sight: live {sorted(self.sched.requests)}")

    def check(self) -> None:
        self.oracle.check(self.sched, self.ledger, self.in_flight)
