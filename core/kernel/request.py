"""Request state inside the engine core: one plain object with counters that explain themselves,
changed only by its named transitions (the scheduler, the block manager, the ledger and the engine
core call them; nobody else writes a field, `tests/test_house.py` checks it).

Transitions, in a request's life order, and what each changes:

- `attach_grammar(grammar)`: structured output, before admission: the matcher.
- `cancel()`: aborted while its grammar compiles (never enqueued): status FINISHED, reason "abort".
- `enqueue(generation)`: the scheduler takes it (waiting): its first generation.
- `admit(slot)`: waiting -> running, holding a row of the device token buffer.
- `grant_blocks(ids)` / `release_blocks()`: the block table grows / is handed back whole.
- `refuse_drafts(n)`: the grammar refused n drafts of the row being scheduled: counted, never verified.
- `schedule_row(step_id, num_inputs, num_drafts)`: a row goes in flight: computed tokens advance past
  its inputs and drafts, in_flight + 1, the held drafts are taken; a row that reaches the last token
  (it samples) adds a placeholder and its drafts to the unverified ones.
- `expect_device_drafts(k)`: run-ahead: the frame just scheduled proposes k drafts that stay on
  the device, and a successor may verify them before that frame is applied.
- `land_row(step_id, samples, num_drafts)`: a row's result arrived (or the row failed): one row
  less in flight, a sampling row's placeholder and drafts released, last_applied_step advanced.
- `roll_back(num_rejected)`: rejected draft positions are void: computed tokens back by that many.
- `apply_result(row, num_drafted)`: after `land_row`: `roll_back` the rejected drafts, speculation
  counters, confirmed tokens appended up to the first stop, and (unless it stopped or a successor
  in flight took them) the drafts for the next row held.
- `reset_drafts()`: the held drafts dropped: speculation switched off (`schedule_row`, `preempt`
  and `finish` drop them through it too).
- `preempt(generation)`: running -> waiting, to recompute from prompt plus output: computed tokens
  and in-flight counts zeroed, drafts dropped, slot given up, generation renewed.
- `finish(reason, generation)`: done, aborted or failed: in-flight counts zeroed, drafts dropped,
  slot given up, generation renewed, status FINISHED.

Invariants (`tests/kernel/test_request_states.py` checks them over random transition sequences):
no count is negative; `in_flight` counts the rows in flight, `num_placeholders` those that sample
and `num_unverified` their drafts; with a placeholder in flight `num_computed_tokens` is
`num_tokens + num_placeholders + num_unverified - 1` (every known token, every token and draft in
flight but the last sampled one), without one it stays below `num_tokens`; `generation` only grows;
a slot is held exactly while running; a waiting request has nothing computed and holds no draft;
a finished one has nothing in flight and holds no draft and no slot.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from ..sampling_params import SamplingParams
from .grammar import RequestGrammar


@dataclass(slots=True)
class SpecCounters:
    """Speculation counters, kept per request and engine-wide."""

    num_verify_steps: int = 0
    """Steps that verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_invalid_drafts: int = 0
    """Drafts the grammar refused (structured output): never verified."""
    num_forced_drafts: int = 0
    """Drafts the grammar forced (structured output: its only continuation), verified ahead of a
    speculator's and counted apart, so the speculator's acceptance stays its own."""
    num_forced_accepted: int = 0

    def record(self, num_drafts: int, num_accepted: int, num_forced: int = 0) -> None:
        """A verified row: num_drafts drafts (the first num_forced of them forced by its grammar),
        num_accepted of them accepted in order."""
        if num_forced:
            self.num_forced_drafts += num_forced
            self.num_forced_accepted += min(num_accepted, num_forced)
            # The speculator's drafts follow the forced ones: all rejected if a forced one was.
            num_drafts -= num_forced
            num_accepted = max(0, num_accepted - num_forced)
        if num_drafts <= 0:
            return
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def summary(self) -> dict[str, object]:
        steps, drafted = self.num_verify_steps, self.num_draft_tokens
        return {
            "num_drafts": steps,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            "mean_acceptance_length": (self.num_accepted_tokens + steps) / steps if steps else 0.0,
            "acceptance_per_position": [a / d if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position, strict=True)],
            "num_invalid_drafts": self.num_invalid_drafts,
            "num_forced_drafts": self.num_forced_drafts,
            "num_forced_accepted": self.num_forced_accepted,
        }


class RowOutcome(Protocol):
    """What a row's result tells its request: `frame.RowResult`, read without importing the step
    contract into the request's module."""

    @property
    def sampled(self) -> list[int]: ...
    @property
    def num_drafts(self) -> int: ...
    @property
    def num_accepted(self) -> int: ...
    @property
    def next_draft_ids(self) -> list[int] | None: ...
    @property
    def num_next_drafts(self) -> int: ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    key: int
    """Unique per request (the frontend's counter); the caller's id never reaches the kernel."""
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """Effective sampling seed: the caller's, or one the engine drew for this request."""
    eos_token_ids: tuple[int, ...]
    max_total_tokens: int
    """Context cap (max_model_len): prompt plus output never grows past it."""
    output_token_ids: list[int] = field(default_factory=list)
    generation: int = 0
    """Set on admission and renewed on preemption, abort and finish (from one engine-wide
    counter), so a stale frame row is recognised and dropped."""
    num_computed_tokens: int = 0
    """Tokens whose KV is written, or will be once the frames in flight land."""
    in_flight: int = 0
    """Frames scheduled for this request and not yet applied."""
    num_placeholders: int = 0
    """Tokens being sampled by frames in flight: scheduled, value still on the device."""
    num_unverified: int = 0
    """Drafts that frames in flight verify: a run-ahead row is planned as if all are accepted."""
    last_applied_step: int = -1
    last_scheduled_step: int = -1
    slot: int = -1
    """Row of the device token buffer, held from admission to finish or preemption (-1: none)."""
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    """Drafts proposed after the last applied step, held on the host."""
    num_draft_slots: int = 0
    """Drafts proposed after the last applied step that stayed on the device."""
    spec: SpecCounters = field(default_factory=lambda: SpecCounters())
    grammar: RequestGrammar | None = None
    """Structured output: the matcher that masks every sampled position and validates drafts."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt plus output, copying only those (a decode row asks for
        one or none, every step)."""
        prompt = self.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return prompt[start:] + self.output_token_ids[: end - p]

    def stop_reason(self, token_id: int) -> str | None:
        """Why the request must stop after emitting token_id, or None."""
        params = self.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= self.max_total_tokens:
            return "length"
        return None

    # --- transitions (the only writers of the fields above) --------------------------------

    def attach_grammar(self, grammar: RequestGrammar) -> None:
        """Structured output: the matcher compiled for this request, before it is enqueued."""
        self.grammar = grammar

    def cancel(self) -> None:
        """Aborted before the scheduler had it (its grammar was compiling): nothing was held."""
        self.status = Status.FINISHED
        self.finish_reason = "abort"

    def enqueue(self, generation: int) -> None:
        """The scheduler takes it, waiting: generation from the engine-wide counter."""
        self.generation = generation

    def admit(self, slot: int) -> None:
        """Waiting -> running, holding a row of the device token buffer until finish or preemption."""
        self.slot = slot
        self.status = Status.RUNNING

    def grant_blocks(self, block_ids: Iterable[int]) -> None:
        """The block table grows (the block manager took them off its free list)."""
        self.block_ids.extend(block_ids)

    def release_blocks(self) -> list[int]:
        """The whole block table, handed back to the block manager."""
        block_ids, self.block_ids = self.block_ids, []
        return block_ids

    def refuse_drafts(self, num_refused: int) -> None:
        """The grammar refused drafts of the row being scheduled: counted, never verified."""
        self.spec.num_invalid_drafts += num_refused

    def samples_after(self, num_inputs: int) -> bool:
        """Does a row of num_inputs inputs from `num_computed_tokens` reach the last token known or
        being sampled (so it samples the next)? A read, for the scheduler before `schedule_row`."""
        return (self.num_computed_tokens + num_inputs
                == self.num_tokens + self.num_placeholders + self.num_unverified)

    def schedule_row(self, step_id: int, num_inputs: int, num_drafts: int) -> bool:
        """A row of num_inputs inputs (known tokens and placeholders) and num_drafts drafts goes in
        flight in step step_id; the drafts held are taken (those it does not verify are dropped).
        Returns whether it samples; a row that samples adds a placeholder and its drafts in flight."""
        samples = self.samples_after(num_inputs)
        self.last_scheduled_step = step_id
        self.num_computed_tokens += num_inputs + num_drafts
        self.in_flight += 1
        self.reset_drafts()
        if samples:
            self.num_placeholders += 1
            self.num_unverified += num_drafts
        return samples

    def expect_device_drafts(self, k: int) -> None:
        """Run-ahead: the frame just scheduled for this request proposes k drafts that stay on the
        device; a successor scheduled before it is applied may verify them."""
        self.num_draft_slots = k

    def land_row(self, step_id: int, samples: bool, num_drafts: int) -> None:
        """The result of a row in flight arrived (or the row failed): out of flight; a row that
        sampled (with num_drafts drafts) no longer holds its placeholder and drafts."""
        self.last_applied_step = step_id
        self.in_flight -= 1
        if samples:
            self.num_placeholders -= 1
            self.num_unverified -= num_drafts

    def roll_back(self, num_rejected: int) -> None:
        """Rejected draft positions are void: their KV is overwritten by the next row."""
        self.num_computed_tokens -= num_rejected

    def apply_result(self, row: RowOutcome, num_drafted: int, num_forced: int = 0) -> tuple[list[int], str | None]:
        """After `land_row`: a result's rejected drafts rolled back, the speculation counters
        (num_drafted: the drafts proposed, padding excluded, the first num_forced of them forced by
        the grammar), its tokens appended up to
        the first that stops the request, and the drafts for the next row held unless it stopped or
        a successor in flight already took (or skipped) them. Returns (new tokens, stop reason)."""
        self.roll_back(row.num_drafts - row.num_accepted)
        self.spec.record(num_drafted, row.num_accepted, num_forced)
        new: list[int] = []
        for token in row.sampled:
            self.output_token_ids.append(token)
            new.append(token)
            if (reason := self.stop_reason(token)) is not None:
                return new, reason
        if self.in_flight:
            pass  # a run-ahead successor in flight already took (or skipped) these drafts
        elif row.next_draft_ids is not None:
            self.draft_token_ids = row.next_draft_ids
        else:
            self.num_draft_slots = row.num_next_drafts
        return new, None

    def reset_drafts(self) -> None:
        """The drafts held are dropped: speculation switched off (rows in flight still verify theirs),
        and the one place scheduling a row, preemption and finishing drop them."""
        self.draft_token_ids, self.num_draft_slots = [], 0

    def _leave(self, generation: int, status: Status) -> int:
        """Out of every frame in flight: in-flight counts zeroed, drafts dropped, slot given up
        (returned), generation renewed so that rows still in flight are recognised as stale."""
        slot, self.slot = self.slot, -1
        self.in_flight = self.num_placeholders = self.num_unverified = 0
        self.reset_drafts()
        self.generation = generation
        self.status = status
        return slot

    def preempt(self, generation: int) -> int:
        """Running -> waiting, to recompute from prompt plus output; returns the slot it held."""
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        return self._leave(generation, Status.WAITING)

    def finish(self, reason: str, generation: int) -> int:
        """Done, aborted or failed; returns the slot it held (-1: none)."""
        self.finish_reason = reason
        return self._leave(generation, Status.FINISHED)
