"""The speculator plugin contract.

A speculator is a class registered under the `speckernel.speculators` entry point. It declares
a frozen `SpeculatorCapabilities`; the kernel derives everything else from it (whether draft
IDs are copied to the host, whether a step may skip drafting, how many KV slots to reserve).
The runner calls `propose` after each verified step, or `sync` on a K=0 step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import msgspec
import torch

from .models.config import ModelConfig


class SpeculatorCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    draft_width: Literal["fixed", "variable"]
    """fixed: always K drafts, the host needs only the count; variable: a -1 suffix ends the
    drafts and the real IDs must reach the host."""
    supports_k0: bool
    """Can run a sync-only pass (keep its state in step) without drafting."""
    max_k: int
    lookahead_slots_per_draft: int = 0
    """KV slots written beyond the verified query, per draft token."""
    target_hidden_layers: tuple[int, ...] = ()
    uses_target_kv: bool = False
    placement: Literal["local_last_stage", "remote"] = "local_last_stage"
    sampled_drafts: bool = False
    """Drafts are sampled from a distribution q that verification must see (draft_probs)."""

    def lookahead_slots(self, k: int) -> int:
        return self.lookahead_slots_per_draft * k


class SpeculatorOptions(msgspec.Struct, frozen=True, kw_only=True):
    num_speculative_tokens: int
    draft_model: str | None = None
    """A checkpoint for speculators that run their own model."""
    extra: dict[str, str] = {}


@dataclass(frozen=True)
class SpeculatorContext:
    """What the kernel hands a speculator when the engine starts."""

    target: ModelConfig
    target_path: Path
    device: torch.device
    dtype: torch.dtype
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    options: SpeculatorOptions


@dataclass
class ProposeRow:
    """One request after a verified step: the tokens it now has for sure."""

    req_id: str
    generation: int
    start_pos: int
    """Position of the first input token of the step that just ran."""
    input_token_ids: list[int]
    """Host-known input tokens of that step (drafts excluded)."""
    new_token_ids: list[int]
    """Tokens the step confirmed: accepted drafts and the bonus or recovered token."""
    block_ids: list[int]
    temperature: float
    seed: int

    @property
    def num_tokens(self) -> int:
        return self.start_pos + len(self.input_token_ids) + len(self.new_token_ids)


@dataclass
class Drafts:
    token_ids: torch.Tensor
    """[rows, K] int64 on the device; -1 marks the end of a variable-width row."""
    probs: torch.Tensor | None = None
    """[rows, K, vocab] draft distribution q, when capabilities.sampled_drafts."""


@runtime_checkable
class Speculator(Protocol):
    name: str
    capabilities: SpeculatorCapabilities

    def __init__(self, ctx: SpeculatorContext) -> None: ...

    def check(self, ctx: SpeculatorContext) -> None:
        """Raises InvalidInputError when this target or platform cannot be served."""
        ...

    def propose(self, rows: list[ProposeRow], k: int) -> Drafts: ...

    def sync(self, rows: list[ProposeRow]) -> None:
        """The K=0 pass: keep internal state in step without drafting."""
        ...

    def release(self, req_id: str) -> None:
        """The request finished or was preempted; drop its state."""
        ...
