"""Continuous batching with chunked prefill, draft slots and preemption by recompute.

One `schedule()` reads top to bottom: running requests first (decode with its drafts, or the
next chunk of a prefill), then waiting requests while the token budget and `max_num_seqs`
allow. An admitted request takes a slot (its row of the device token buffer) until it
finishes or is preempted. When blocks run out, the most recently admitted running request is
preempted: its blocks and slot are freed, its generation renewed, and it recomputes from its
prompt plus the output it already has.

Where the device replays captured graphs of decode steps and of one prompt at a time, a step
that mixes a prompt with decode rows (or holds several prompts) runs eagerly, at many times a
graph's cost on a GPU host. There (`prompt_tokens_apart`) a step is either decode rows only or
one request's prompt chunk, and the two kinds take turns while both have work: one for one
while a single prompt waits, up to `prompt_steps_per_decode` prompt steps per decode step while
several do (a burst of arrivals would otherwise wait two steps per prompt ahead of it). Where
graphs of several-prompt steps exist too (`prompt_batch`), a prompt step while several prompts
wait holds up to that many rows and tokens, each row's chunk at most `prompt_tokens_apart`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import msgspec

from ..sampling_params import RowSampling
from .block_manager import BlockManager
from .frame import ScheduledRow, StepFrame
from .grammar import RequestGrammar, fill_masks
from .request import Request, Status
from .spec_policy import SpecPolicy


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 spec: SpecPolicy | None = None, async_scheduling: bool = False, pipeline: bool = False,
                 prompt_tokens_apart: int = 0, prompt_steps_per_decode: int = 1,
                 prompt_batch: tuple[int, int] = (1, 0), grammar_drafts: int = 0) -> None:
        self.blocks = block_manager
        self.grammar_drafts = grammar_drafts
        """Structured output: the most tokens a grammar forces next that a row verifies as drafts
        in one step (`EngineConfig.forced_drafts`; 0: none)."""
        self.masking: dict[int, tuple[RequestGrammar, list[int]]] = {}
        """Structured-output rows of the step being scheduled: their drafts, for their masks."""
        self.pipeline = pipeline
        """Pipeline stages: several frames in flight whose output the first stage has not seen;
        see `eligible`. Fixed-width drafts stay on the device there too: the last stage sends them
        to the first, device to device, and the host gets their count."""
        self.async_scheduling = async_scheduling
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prompt_tokens_apart = prompt_tokens_apart
        """0: prompts share steps with decode rows. N: a prompt runs in steps of its own, one
        request and at most N tokens (the largest captured prompt graph) a step."""
        self.prompt_steps_per_decode = max(1, prompt_steps_per_decode)
        """With prompts apart and several prompts waiting: prompt steps that may run in a row."""
        self.prompt_streak = 0
        """With prompts apart: prompt steps since the last decode step."""
        self.prompt_batch = prompt_batch
        """With prompts apart: (rows, tokens) a prompt step may hold while several prompts wait
        ((1, 0): one prompt a step)."""
        self.spec = spec
        self.requests: dict[int, Request] = {}
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.next_step_id = 0
        self.num_preemptions = 0
        # Generations come from one counter, so (req_id, generation) is never reused, even
        # when a caller reuses a request id after the first request finished.
        self.generations = itertools.count(1)
        self.num_invalid_drafts = 0
        """Drafts the grammar of a structured-output request refused (never verified)."""
        self.late_masks_ok = False
        """The engine fills a run-ahead row's mask after launching its step (`late_masks`): a
        structured-output request without drafts runs ahead like any other (set by the engine
        where the runner supports it)."""
        self.draft_gate: Callable[[int], bool] | None = None
        """Asked, for a step of that many rows, whether it may draft (the speculation governor)."""

    def stop_speculation(self) -> None:
        """Schedules no drafts from now on (the engine switched its speculator off): frames in
        flight still verify the drafts they carry; no request is given new ones."""
        self.spec = None
        self.draft_gate = None
        for req in self.requests.values():
            req.reset_drafts()

    def add(self, req: Request) -> None:
        req.enqueue(next(self.generations))
        self.requests[req.key] = req
        self.waiting.append(req)

    def _can_overlap(self, req: Request) -> bool:
        """Async scheduling: a decoding request whose one frame in flight samples its next input
        is scheduled again at once, with that input as a placeholder. A speculative request does
        so only with run-ahead (drafts that stay on the device): its next step is planned as if
        every draft in flight is accepted."""
        if not (self.async_scheduling and req.in_flight == 1 and req.num_placeholders == 1
                and self.may_continue(req)):
            return False
        if req.grammar is not None:  # its mask needs the token in flight: filled after launch, or it waits
            return (self.late_masks_ok and self.spec is None and not req.grammar.forcing
                    and req.num_computed_tokens == req.num_tokens)
        if self.spec is None:  # on pipeline stages too: the first reads the input from the last's token window
            return req.num_computed_tokens == req.num_tokens
        # Planned as if every draft in flight is accepted: it must fit that case too, or its
        # positions could run past the request's blocks.
        return (self.spec.run_ahead and not req.params.structured_output
                and req.num_computed_tokens == req.num_tokens + req.num_unverified
                and self.may_continue(req, every_draft_accepted=True))

    def schedule(self) -> StepFrame | None:
        if not self.prompt_tokens_apart:
            return self._frame(self._rows(self.max_num_batched_tokens, prompts=True))
        # Prompt and decode steps take turns; either kind goes on alone while the other has no work.
        several = len(self.waiting) + sum(1 for r in self.running if self.in_prompt(r)) > 1  # prompts waiting
        prompt_first = self.prompt_streak < (self.prompt_steps_per_decode if several else 1)
        for prompt in (prompt_first, not prompt_first):
            if rows := self._prompt_rows(several) if prompt else self._rows(self.max_num_batched_tokens, prompts=False):
                self.prompt_streak = self.prompt_streak + 1 if prompt else 0
                return self._frame(rows)
        return None

    def _prompt_rows(self, several: bool) -> list[ScheduledRow]:
        """One request's next prompt chunk: the first running request still in its prompt (its
        frame in flight applied, or an intermediate chunk behind it under pipeline stages), else
        the first waiting one that gets a slot and blocks. While
        several prompts wait (several) and several-prompt steps exist, as many chunks as one holds."""
        budget = min(self.max_num_batched_tokens, self.prompt_tokens_apart)
        if several and self.prompt_batch[0] > 1 and (rows := self._several_prompts(budget)):
            return rows
        req = next((r for r in self.running if self.in_prompt(r) and self._chunk_ready(r, budget)), None)
        if req is None:
            return self._admit(budget, max_rows=1)
        n_known = self._known(req, budget)
        return [self._row(req, n_known, [], 0)] if self._fit(req, n_known) else []

    def _several_prompts(self, per_row: int) -> list[ScheduledRow]:
        """While several prompts wait: running requests' next prompt chunks, then waiting ones,
        up to `prompt_batch` rows and tokens, each chunk at most per_row and at least two tokens
        (a step of prompts never holds what looks like a decode row). Nothing is preempted: a
        prompt whose blocks are not free waits for a step of its own."""
        max_rows, budget = self.prompt_batch[0], min(self.max_num_batched_tokens, self.prompt_batch[1])
        rows: list[ScheduledRow] = []
        for req in [r for r in self.running if self.in_prompt(r) and self._chunk_ready(r, per_row)]:
            if len(rows) == max_rows or budget < 2:
                return rows
            n_known = self._known(req, min(budget, per_row))
            if n_known >= 2 and self.blocks.ensure(req, self._slots_needed(req, n_known)):
                rows.append(self._row(req, n_known, [], 0))
                budget -= n_known
        return rows + self._admit(budget, max_rows=max_rows - len(rows), per_row=per_row)

    def _chunk_ready(self, req: Request, budget: int) -> bool:
        """A prompt's next chunk may be scheduled: its frame in flight applied, or, with pipeline
        stages, the chunk is an intermediate one, which pipelines behind it."""
        return not req.in_flight or self.pipelines(req, budget)

    @staticmethod
    def in_prompt(req: Request) -> bool:
        """Its next step computes more than one known token: a prompt (or its recompute after a
        preemption), not a decode row."""
        return req.num_tokens - req.num_computed_tokens > 1

    def _rows(self, budget: int, prompts: bool) -> list[ScheduledRow]:
        """Running requests first, then waiting ones while the budget and max_num_seqs allow;
        without prompts, only decode rows (no request in its prompt, none admitted)."""
        rows: list[ScheduledRow] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not prompts and self.in_prompt(req):
                i += 1
                continue
            if req.in_flight and not self.eligible(req, budget):  # its next input is not known yet
                i += 1
                continue
            if req.in_flight and not self.pipelines(req, budget):
                slots = self._run_ahead_drafts(req, budget)
                if not self.blocks.ensure(req, self._slots_needed(req, 1 + slots)):
                    i += 1  # no room to run ahead: it waits for its frame like in sync mode
                    continue
                rows.append(self._row(req, 0, [], slots, placeholder_inputs=1, shifted=self.spec is not None))
                budget -= rows[-1].num_tokens
                i += 1
                continue
            n_known, drafts, slots, forced = self._plan(req, budget)
            if not self._fit(req, n_known + len(drafts) + slots):
                break
            rows.append(self._row(req, n_known, drafts, slots, num_forced=forced))
            budget -= rows[-1].num_tokens
            i += 1
        if prompts:
            rows += self._admit(budget, self.max_num_seqs)
        return rows

    def _fit(self, req: Request, n: int) -> bool:
        """Blocks for n more tokens of a running request, preempting the most recently admitted
        requests while they run out; False when req itself had to go."""
        while not self.blocks.ensure(req, self._slots_needed(req, n)):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, budget: int, max_rows: int, per_row: int | None = None) -> list[ScheduledRow]:
        """Waiting requests, in order, while the budget, max_num_seqs and their blocks allow; with
        per_row (a step of several prompts), rows of 2 to per_row tokens."""
        rows: list[ScheduledRow] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(rows) < max_rows:
            req = self.waiting[0]
            n_known = self._known(req, budget if per_row is None else min(budget, per_row))
            if per_row is not None and n_known < 2:
                break
            if not self.blocks.ensure(req, self._slots_needed(req, n_known)):
                break
            self.waiting.popleft()
            req.admit(self.free_slots.pop())
            self.running.append(req)
            rows.append(self._row(req, n_known, [], 0))
            budget -= n_known
        return rows

    def _frame(self, rows: list[ScheduledRow]) -> StepFrame | None:
        rows = self._with_masks(rows)
        if not rows:
            return None
        frame = StepFrame(
            step_id=self.next_step_id,
            rows=rows,
            skip_drafts=self._skip_drafts(rows),
            host_drafts=self.spec is not None and (
                self.spec.variable_width or any(self.requests[r.key].params.structured_output for r in rows)),
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec is not None else 0,
        )
        self.next_step_id += 1
        self._expect_drafts(frame)
        return frame

    def draft_anyway(self, frame: StepFrame) -> StepFrame:
        """The frame just scheduled, drafting although it could skip (a data-parallel peer needs
        drafts this step, and the ranks skip together or not at all); its run-ahead successors
        then count on its drafts as if it had been scheduled so."""
        if not frame.skip_drafts:
            return frame
        frame = msgspec.structs.replace(frame, skip_drafts=False)
        self._expect_drafts(frame)
        return frame

    def _expect_drafts(self, frame: StepFrame) -> None:
        if self.spec is not None and self.spec.run_ahead and not frame.skip_drafts and not frame.host_drafts:
            # The drafts this frame proposes stay on the device: a run-ahead successor counts on them.
            for row in frame.rows:
                if row.sampling is not None:
                    self.requests[row.key].expect_device_drafts(frame.num_speculative_tokens)

    def eligible(self, req: Request, budget: int) -> bool:
        """May a request with frames in flight be scheduled again? The batch queue's rule: a row
        that samples (a decode row, a final prefill chunk) waits for its predecessor's frame,
        unless the device corrects it (`_can_overlap`: single-stage run-ahead); an intermediate
        prefill chunk pipelines freely, since it reads no output of the frames before it."""
        return self.pipelines(req, budget) or self._can_overlap(req)

    def pipelines(self, req: Request, budget: int) -> bool:
        """With pipeline stages: the request's next chunk is an intermediate prefill chunk behind
        frames that sample nothing for it (stages run frames in order, so its KV is written)."""
        return (self.pipeline and req.num_placeholders == 0
                and req.num_computed_tokens + budget < req.num_tokens)

    def _run_ahead_drafts(self, req: Request, budget: int) -> int:
        """Draft slots a run-ahead row verifies: those its frame in flight proposes, within what
        the request may still emit if that frame accepts all its drafts."""
        emitted = len(req.output_token_ids) + req.num_placeholders + req.num_unverified
        room = min(budget - 1, req.params.max_tokens - emitted - 1,
                   req.max_total_tokens - req.num_tokens - req.num_placeholders - req.num_unverified - 1)
        return max(0, min(req.num_draft_slots, room))

    @staticmethod
    def _known(req: Request, budget: int) -> int:
        """Known tokens to schedule for req within budget."""
        return min(req.num_tokens - req.num_computed_tokens, budget)

    def _plan(self, req: Request, budget: int) -> tuple[int, list[int], int, int]:
        """(known tokens, host drafts, device draft slots, of the host drafts those the grammar
        forces) to schedule for req within budget."""
        n_known = self._known(req, budget)
        if req.num_computed_tokens + n_known < req.num_tokens:
            return n_known, [], 0, 0
        # Drafts past what the request may still emit could never count: don't verify them.
        room = min(budget - n_known, req.params.max_tokens - len(req.output_token_ids) - 1,
                   req.max_total_tokens - req.num_tokens - 1)
        room = max(room, 0)
        forced = self._forced(req, room)
        if forced:  # ahead of the speculator's drafts, which guess the same positions
            return n_known, (forced + req.draft_token_ids[len(forced) :])[:room], 0, len(forced)
        return n_known, req.draft_token_ids[:room], min(req.num_draft_slots, room), 0

    def _forced(self, req: Request, room: int) -> list[int]:
        """The tokens req's grammar forces next, within room and `grammar_drafts`."""
        room = min(room, self.grammar_drafts)
        if req.grammar is None or room <= 0:
            return []
        req.grammar.sync(req.output_token_ids)
        return req.grammar.forced(room)

    def _slots_needed(self, req: Request, n: int) -> int:
        lookahead = self.spec.lookahead_slots if self.spec is not None else 0
        return min(req.num_computed_tokens + n + lookahead, req.max_total_tokens + lookahead)

    def _row(self, req: Request, n: int, drafts: list[int], slots: int,
             placeholder_inputs: int = 0, shifted: bool = False, num_forced: int = 0) -> ScheduledRow:
        start = req.num_computed_tokens
        final = req.samples_after(n + placeholder_inputs)
        late = req.grammar is not None and final and placeholder_inputs > 0
        if req.grammar is not None and final and not late:
            req.grammar.sync(req.output_token_ids)
            valid = req.grammar.valid(drafts)
            self.masking[req.key] = (req.grammar, valid)  # its masks come with the step's (`_frame`)
            refused = len(drafts) + slots - len(valid)  # device slots cannot be checked: none are verified
            self.num_invalid_drafts += refused
            req.refuse_drafts(refused)
            drafts, slots = valid, 0
        reads_device = placeholder_inputs > 0 or slots > 0 or bool(drafts)  # host drafts too sit in the buffer
        prev_step = req.last_scheduled_step if reads_device else -1
        p = req.params
        sampling = None
        if final:
            sampling = RowSampling(p.temperature, p.top_k, p.top_p, req.seed,
                                   len(req.output_token_ids) + req.num_placeholders + req.num_unverified,
                                   p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                                   -1 if p.logprobs is None else p.logprobs)
        req.schedule_row(self.next_step_id, n + placeholder_inputs, len(drafts) + slots)
        return ScheduledRow(req.key, req.generation, req.slot, start, req.token_ids(start, start + n),
                            list(req.block_ids), sampling, drafts, slots, placeholder_inputs, prev_step, shifted,
                            num_forced=min(num_forced, len(drafts)), mask_later=late)

    def late_masks(self, frame: StepFrame) -> list[bytes]:
        """The masks of frame's run-ahead rows (`ScheduledRow.mask_later`; b"" for the others), once
        the frames before it are applied: each grammar consumes the token its row's input is, then
        every mask is computed at once. A row whose request moved on (finished, failed, preempted)
        gets none: its output is stale and dropped."""
        late: dict[int, tuple[RequestGrammar, list[int]]] = {}
        for row in frame.rows:
            req = self.requests.get(row.key)
            if not row.mask_later or req is None or req.generation != row.generation or req.grammar is None \
                    or row.sampling is None or len(req.output_token_ids) != row.sampling.position:
                continue
            req.grammar.sync(req.output_token_ids)
            if self.grammar_drafts:  # the row samples the first forced token; more: its next row waits to draft them
                req.grammar.forced(1)
            late[row.key] = (req.grammar, [])
        masks = dict(zip(late, fill_masks(list(late.values())), strict=True))
        return [masks.get(row.key, b"") for row in frame.rows]

    def _with_masks(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """The grammar rows with their bitmasks, every row's computed at once (`grammar.fill_masks`)."""
        if not self.masking:
            return rows
        masks = dict(zip(self.masking, fill_masks(list(self.masking.values())), strict=True))
        self.masking.clear()
        return [msgspec.structs.replace(r, token_bitmask=masks[r.key]) if r.key in masks else r for r in rows]

    def _skip_drafts(self, rows: list[ScheduledRow]) -> bool:
        """K=0 when no row can verify drafts proposed after this step: rows that sample nothing
        (non-final prefill chunks) and rows sure to finish with the token this step emits."""
        if self.spec is None or not self.spec.skip_drafts:
            return False
        if not any(row.sampling is not None and self.may_continue(self.requests[row.key]) for row in rows):
            return True
        return self.draft_gate is not None and not self.draft_gate(len(rows))

    @staticmethod
    def may_continue(req: Request, every_draft_accepted: bool = False) -> bool:
        """False when req will surely stop after its next emitted token (even with no draft
        accepted; or, with every_draft_accepted, when the drafts in flight all count)."""
        pending = req.num_placeholders + (req.num_unverified if every_draft_accepted else 0)
        return (len(req.output_token_ids) + pending < req.params.max_tokens
                and req.num_tokens + pending < req.max_total_tokens)

    def _release_slot(self, slot: int) -> None:
        if slot >= 0:
            self.free_slots.append(slot)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        self._release_slot(req.preempt(next(self.generations)))
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Aborted or done: blocks back to the free list, generation renewed, forgotten."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        self._release_slot(req.finish(reason, next(self.generations)))
        self.requests.pop(req.key, None)
