"""The speculator's pass of a step, one class per kind of speculator, chosen once when the runner
is built (`drafting_pass`): the runner never asks which kind it runs.

- `InStepDrafting` (an `InStepSpeculator`): its pass runs inside the device step (and so inside
  a captured graph), its drafts go straight into the token buffer and reach the host only where
  the host must see them (variable width on the host path, structured output).
- `AfterStepDrafting` (an `AfterStepSpeculator`): its pass runs once the step's accepted counts
  reached the host, with the step's `HostRows`; deferred drafts are stored behind their gate by
  the next launch (`before`), before that step's tokens enter the token buffer.
- `NoDrafting`: no speculator, or speculation switched off (`ModelRunner.stop_speculation`).

Each pass returns one `DraftOutcome` per step, which `ModelRunner.finish` folds into the row
results. A raising speculator fails no row: its outcome says so (`DraftOutcome.error`), the
step's target tokens stand, and -1 (never accepted) lies where its drafts would have gone.
The in-step pass reads device tensors only: it never names `HostRows`, which only the after-step
pass builds (`tests/test_house.py` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

import numpy as np
import torch

from .. import log as logmod
from ..attention import AttentionMetadata
from ..kernel.frame import StepFrame
from ..platform import HostGate
from ..plugin import (
    AfterStepSpeculator,
    DeferredDrafts,
    DeviceStates,
    HostRows,
    InStepSpeculator,
    Speculator,
    drafts_in_step,
)
from .host_copy import StepCopy, drafts_on_host, to_device
from .step_plan import STEP, Col
from .step_shape import DeviceOutputs, DraftingDeps, DraftOutcome, confirmed_lens

log = logmod.get("runner")


def failed(e: Exception) -> str:
    """Logs a raising speculator pass with its traceback; its one-line description."""
    log.exception("speculator_pass_failed", error=f"{type(e).__name__}: {e}")
    return f"{type(e).__name__}: {e}"


class InStepPass(NamedTuple):
    """What the in-step pass left in the device step."""

    drafts: torch.Tensor | None
    """[R, propose_width] the drafts as stored (-1 ends a row); None for a sync pass."""
    error: str | None = None


class DraftingPass(Protocol):
    @property
    def speculator(self) -> Speculator | None: ...

    @property
    def in_graphs(self) -> bool:
        """The pass runs inside the device step, so captured graphs hold it."""
        ...

    def propose_width(self, frame: StepFrame) -> int:
        """Drafts the pass proposes inside this step's device work (0: none, or its sync pass)."""
        ...

    def before(self, frame: StepFrame) -> None:
        """Before the step's host tokens enter the token buffer."""
        ...

    def in_step(self, meta: AttentionMetadata, width: int, slot: torch.Tensor, samples: torch.Tensor,
                accepted: torch.Tensor, num_drafts: torch.Tensor, captured: dict[int, torch.Tensor],
                isolate: bool) -> InStepPass:
        """Inside the device step, after its tokens went into the token buffer."""
        ...

    def after(self, frame: StepFrame, meta: AttentionMetadata, out: DeviceOutputs, copy: StepCopy,
              isolate: bool) -> DraftOutcome:
        """Once the step is launched and its copy to the host issued."""
        ...


class NothingInStep:
    """The part of a pass that drafts nothing inside the device step."""

    in_graphs = False

    def propose_width(self, frame: StepFrame) -> int:
        return 0

    def in_step(self, meta: AttentionMetadata, width: int, slot: torch.Tensor, samples: torch.Tensor,
                accepted: torch.Tensor, num_drafts: torch.Tensor, captured: dict[int, torch.Tensor],
                isolate: bool) -> InStepPass:
        return InStepPass(None)


@dataclass
class NoDrafting(NothingInStep):
    """No speculator: rows in flight verify the drafts they carry, nothing proposes more."""

    speculator: None = None

    def before(self, frame: StepFrame) -> None:
        return None

    def after(self, frame: StepFrame, meta: AttentionMetadata, out: DeviceOutputs, copy: StepCopy,
              isolate: bool) -> DraftOutcome:
        return DraftOutcome()


@dataclass
class InStepDrafting:
    speculator: InStepSpeculator
    deps: DraftingDeps
    in_graphs = True

    def propose_width(self, frame: StepFrame) -> int:
        k = frame.num_speculative_tokens
        if not k or not any(r.sampling is not None for r in frame.rows):
            return 0
        return k if not frame.skip_drafts or not self.speculator.capabilities.supports_k0 else 0

    def before(self, frame: StepFrame) -> None:
        return None

    def in_step(self, meta: AttentionMetadata, width: int, slot: torch.Tensor, samples: torch.Tensor,
                accepted: torch.Tensor, num_drafts: torch.Tensor, captured: dict[int, torch.Tensor],
                isolate: bool) -> InStepPass:
        """Device tensors only: its drafts go into the token buffer right after each sampling
        row's confirmed tokens (a row that does not sample writes the spare column)."""
        deps = self.deps
        seq_lens = confirmed_lens(meta.seq_lens, num_drafts, samples, accepted)
        states = DeviceStates(tokens=deps.pool.tokens, slot_index=slot, positions=meta.positions,
                              accepted=accepted, seq_lens=seq_lens, samples=samples, hidden=captured,
                              target=deps.target, attention=meta)
        starts = torch.where(samples, seq_lens, deps.pool.width - 1)
        try:
            if not width:
                self.speculator.sync(states)
                return InStepPass(None)
            drafts = self.speculator.propose(states, width)
            return InStepPass(deps.store(slot, starts, drafts.token_ids, drafts.probs, width))
        except Exception as e:
            if not isolate:  # inside a graph capture: the graph must hold the real pass
                raise
            error = failed(e)
            if not width:
                return InStepPass(None, error)
            none = torch.full((len(slot), width), -1, dtype=torch.int64, device=deps.device)
            deps.pool.write(slot, starts, none)  # no drafts: -1 where they would have gone
            return InStepPass(none, error)

    def after(self, frame: StepFrame, meta: AttentionMetadata, out: DeviceOutputs, copy: StepCopy,
              isolate: bool) -> DraftOutcome:
        """No host sync: the drafts are in the token buffer; the host gets them in the step's own
        copy where it must see them, and their count otherwise."""
        drafted = out.drafts is not None and not frame.skip_drafts
        if out.drafts is None or not drafted:
            return DraftOutcome(k0=frame.skip_drafts, error=out.speculator_error)
        if frame.host_drafts:
            return DraftOutcome(in_copy=True, copies=1, k0=frame.skip_drafts, error=out.speculator_error)
        copies = 0
        if self.deps.force_host_drafts:
            drafts_on_host(out.drafts[: len(frame.rows)])
            copies = 1
        return DraftOutcome(num_next=out.drafts.shape[1], copies=copies, k0=frame.skip_drafts,
                            error=out.speculator_error)


@dataclass
class AfterStepDrafting(NothingInStep):
    """Drafts once the step's accepted counts reached the host, with its `HostRows`."""

    speculator: AfterStepSpeculator
    deps: DraftingDeps
    pending: PendingDrafts | None = field(default=None)
    """A deferred proposal, resolved by the next launch."""

    def before(self, frame: StepFrame) -> None:
        """Stores a deferred proposal's drafts, in stream order behind its gate, before this
        step's tokens go into the token buffer: a row whose slot now holds another request
        (another generation) is dropped, so its draft never reaches the new owner."""
        pending, self.pending = self.pending, None
        if pending is not None:
            _resolve(pending, frame, self.deps)

    def after(self, frame: StepFrame, meta: AttentionMetadata, out: DeviceOutputs, copy: StepCopy,
              isolate: bool) -> DraftOutcome:
        """Waits for the step's copy (the speculator reads this step's metadata and outputs,
        which the next launch overwrites, and needs its accepted counts on the host anyway)."""
        try:
            outcome, self.pending = _speculate(self.speculator, self.deps, frame, meta, out, copy)
            return outcome
        except Exception as e:
            if not isolate:
                raise
            self.pending = None
            return _without_drafts(self.deps, frame, copy, failed(e))


# --- the after-step pass's host rows -------------------------------------------------------


class PendingDrafts(NamedTuple):
    """A deferred speculator's drafts, not written by the host yet: stored behind their gate at
    the next launch, after its host work and before its tokens enter the token buffer."""

    gate: HostGate
    staging: torch.Tensor
    """[rows, K] host memory the speculator fills before it opens the gate."""
    rows: list[int]
    """Staging rows of the rows that sampled."""
    keys: list[tuple[int, int]]
    """Their (slot, generation): a slot with another generation in the next step is another request's."""
    starts: list[int]
    """Where each row's drafts go (its confirmed length)."""


def _host_rows(frame: StepFrame, accepted: list[int]) -> HostRows:
    rows = frame.rows
    samples = [r.sampling is not None for r in rows]
    return HostRows(
        slots=[r.slot for r in rows], generations=[r.generation for r in rows], start_pos=[r.start_pos for r in rows],
        query_start=np.concatenate([[0], np.cumsum([r.num_tokens for r in rows])]).tolist(),
        num_drafts=[r.num_drafts for r in rows],
        seq_lens=[r.start_pos + r.num_tokens - r.num_drafts + (a + 1 if s else 0)
                  for r, a, s in zip(rows, accepted, samples, strict=True)],
        samples=samples, sampling=[r.sampling for r in rows], block_tables=[r.block_ids for r in rows])


def _device_states(deps: DraftingDeps, meta: AttentionMetadata, out: DeviceOutputs, n: int, t: int) -> DeviceStates:
    """The step's first n rows and t tokens (a padded step has more)."""
    plan = STEP.on_device(meta)
    samples = STEP.of(plan, Col.SAMPLES)[:n] > 0
    accepted = out.packed[:n, -1]
    return DeviceStates(
        tokens=deps.pool.tokens, slot_index=STEP.of(plan, Col.SLOT)[:n], positions=meta.positions[:t],
        accepted=accepted,
        seq_lens=confirmed_lens(meta.seq_lens[:n], STEP.of(plan, Col.NUM_DRAFTS)[:n], samples, accepted),
        samples=samples, hidden={layer: h[:t] for layer, h in out.captured.items()}, target=deps.target,
        attention=meta)


def _speculate(speculator: AfterStepSpeculator, deps: DraftingDeps, frame: StepFrame, meta: AttentionMetadata,
              out: DeviceOutputs, copy: StepCopy) -> tuple[DraftOutcome, PendingDrafts | None]:
    """The speculator's pass over the step, once its accepted counts are on the host."""
    rows = _host_rows(frame, copy.accepted())
    states = _device_states(deps, meta, out, len(frame.rows), rows.query_start[-1])
    k = frame.num_speculative_tokens
    sampling = [i for i, s in enumerate(rows.samples) if s]
    if not sampling or (frame.skip_drafts and speculator.capabilities.supports_k0):
        speculator.sync(states, rows)
        return DraftOutcome(k0=frame.skip_drafts), None
    drafts = speculator.propose(states, rows, k)
    if frame.skip_drafts:  # the speculator cannot skip drafting: its drafts are dropped
        return DraftOutcome(k0=True), None
    starts = [rows.seq_lens[i] for i in sampling]
    if isinstance(drafts, DeferredDrafts) and not frame.host_drafts:
        # The next launch stores them behind the gate, after its host work.
        keys = [(rows.slots[i], rows.generations[i]) for i in sampling]
        return DraftOutcome(num_next=k), PendingDrafts(drafts.ready, drafts.token_ids, sampling, keys, starts)
    if isinstance(drafts, DeferredDrafts):  # the host needs them now: it waits where the stream cannot
        drafts.ready.enqueue()
        drafts.ready.wait()
        token_ids, probs = drafts.token_ids.to(deps.device, non_blocking=True), None
    else:
        token_ids, probs = drafts.token_ids, drafts.probs
    idx = torch.tensor(sampling, dtype=torch.int64, device=deps.device)
    start = torch.tensor(starts, device=deps.device)
    ids = deps.store(states.slot_index[idx], start, token_ids[idx], None if probs is None else probs[idx], k)
    if frame.host_drafts:
        per_row: list[list[int]] = [[] for _ in frame.rows]
        for i, drafted in zip(sampling, drafts_on_host(ids), strict=True):
            per_row[i] = drafted
        return DraftOutcome(ids=per_row, copies=1), None
    if deps.force_host_drafts:  # what a kernel that ignored the fixed width would pay
        drafts_on_host(ids)
        return DraftOutcome(num_next=k, copies=1), None
    return DraftOutcome(num_next=k), None


def _without_drafts(deps: DraftingDeps, frame: StepFrame, copy: StepCopy, error: str) -> DraftOutcome:
    """A step whose speculator pass raised: its target tokens, no next drafts, and -1 where a
    run-ahead successor would read the drafts it counted on."""
    k = frame.num_speculative_tokens
    idx = [i for i, r in enumerate(frame.rows) if r.sampling is not None]
    if k and idx and not frame.skip_drafts:
        accepted = copy.accepted()
        rows = [frame.rows[i] for i in idx]
        slots = torch.tensor([r.slot for r in rows], dtype=torch.int64, device=deps.device)
        starts = torch.tensor([r.start_pos + r.num_tokens - r.num_drafts + accepted[i] + 1
                               for r, i in zip(rows, idx, strict=True)], dtype=torch.int64, device=deps.device)
        deps.pool.write(slots, starts, torch.full((len(idx), k), -1, dtype=torch.int64, device=deps.device))
    return DraftOutcome(k0=frame.skip_drafts, error=error)


def _resolve(pending: PendingDrafts, frame: StepFrame, deps: DraftingDeps) -> None:
    """Stores a deferred proposal's drafts, in stream order behind its gate: a row whose slot now
    holds another request (another generation) is dropped, so its draft never reaches the new owner."""
    owner = {r.slot: r.generation for r in frame.rows}
    keep = [j for j, (slot, generation) in enumerate(pending.keys) if owner.get(slot, generation) == generation]
    # Where the kept drafts go reaches the device before the gate: a copy that waits for its
    # stream (one from pageable memory) issued behind it would hold the host there until the
    # reply came, with the step's launch still to do.
    where = None
    if keep:
        where = to_device(np.array([[pending.rows[j] for j in keep], [pending.keys[j][0] for j in keep],
                                    [pending.starts[j] for j in keep]], np.int64), deps.device)
    pending.gate.enqueue()
    pending.gate.wait()
    if where is None:
        return
    ids = deps.in_vocab(pending.staging.to(deps.device, non_blocking=True))  # the reply's copy, behind the gate
    deps.pool.write(where[1], where[2], ids[where[0]])


def drafting_pass(speculator: Speculator | None, deps: DraftingDeps) -> DraftingPass:
    """The pass for this speculator's kind (read once, from the methods it has)."""
    if speculator is None:
        return NoDrafting()
    if drafts_in_step(speculator):
        return InStepDrafting(speculator, deps)
    return AfterStepDrafting(cast(AfterStepSpeculator, speculator), deps)
