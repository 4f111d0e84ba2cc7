"""Request state inside the engine core: one plain object with counters that explain themselves."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
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
        }


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
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]

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
