"""What fixes a step's device work, what that work leaves behind, and what device graphs need of
the runner: the seam between `model_runner`, `step_graphs` and the drafting passes, so none
imports another it need not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ..attention import AttentionBackend, AttentionMetadata
from ..kernel.frame import StepFrame
from ..plugin import TargetModel
from .token_pool import TokenPool


def confirmed_lens(seq_lens: torch.Tensor, num_drafts: torch.Tensor, samples: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """Each row's confirmed tokens after its step, on the device: the context it attended minus
    its drafts, plus the accepted ones and the bonus token where it sampled."""
    return seq_lens - num_drafts + torch.where(samples, accepted + 1, 0)


@dataclass(frozen=True)
class StepShape:
    """What fixes a step's device work: padded rows and tokens, verify width, sampling kind."""

    rows: int
    tokens: int
    verify_width: int
    """The most drafts a row of this step verifies (0: plain decode); at most K."""
    max_query_len: int
    all_greedy: bool
    any_filter: bool
    decode_like: bool = False
    """Every row samples and has one input token plus its drafts (what graphs serve)."""
    propose_width: int = 0
    """Drafts an in-step speculator proposes inside the step: K, or 0 (its sync pass, or none)."""
    any_penalty: bool = False
    """Some row has a repetition, frequency or presence penalty: the step counts tokens (a step
    without runs exactly the kernels it ran before)."""
    logprobs: int = -1
    """The most top alternatives a row of this step reports (-1: no row asked for logprobs). A
    captured graph computes MAX_LOGPROBS for every row; an eager step this many for the rows that asked."""
    constrained: bool = False
    """Some row samples under a grammar: the step applies the runner's token masks (graphs of
    decode and verification steps are captured with and without)."""


@dataclass
class DeviceOutputs:
    """What the device part of a step leaves behind (graph-static when replayed)."""

    packed: torch.Tensor
    """[R, W + 3]: W + 1 output tokens (-1 padded), the real drafts verified (`verify.drafted_counts`),
    then the accepted count (W: the padded verify_width)."""
    hidden: torch.Tensor
    captured: dict[int, torch.Tensor]
    drafts: torch.Tensor | None = None
    """[R, propose_width] what an in-step speculator proposed (-1 ends a row), already in the buffer."""
    logprobs: torch.Tensor | None = None
    """[L, W + 1, 1 + N] float32 for the L rows that asked: each output position's chosen-token
    logprob, then its top N (`sampler.token_logprobs`); None when no row asked."""
    logprob_ids: torch.Tensor | None = None
    """[L, W + 1, N] int64: the token ids of those top N."""
    speculator_error: str | None = None
    """What the in-step speculator pass raised (an eager step only: a captured pass cannot raise)."""


class DraftOutcome(NamedTuple):
    """What a step's speculator pass leaves for the step's result."""

    num_next: int = 0
    """Drafts each sampling row carries to the next step on the device (the host knows the count)."""
    ids: list[list[int]] | None = None
    """Per frame row, the next drafts on the host (-1 ends a row); None: they stay on the device."""
    in_copy: bool = False
    """The next drafts travel in the step's own copy, after its tokens (`StepCopy.drafts`)."""
    copies: int = 0
    """Device-to-host copies of draft IDs this step made."""
    k0: bool = False
    error: str | None = None
    """What the speculator's pass raised, if it did."""


@dataclass
class DraftingDeps:
    """What every pass shares with the runner: the token buffer, where sampled drafts' q goes,
    the target handles a speculator declared it reads, and the vocabulary bound."""

    pool: TokenPool
    device: torch.device
    vocab_size: int
    draft_probs: torch.Tensor | None = None
    target: TargetModel | None = None
    force_host_drafts: bool = False
    """Copy fixed-width drafts to the host all the same (what a kernel that ignored the width would pay)."""

    def in_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids outside the vocabulary as -1 (never accepted): a speculator's bad id costs
        its draft, not the next step's embedding lookup (an index error, or a device fault)."""
        return torch.where((ids >= 0) & (ids < self.vocab_size), ids, -1)

    def store(self, slots: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor | None,
              k: int) -> torch.Tensor:
        """Writes drafts right after each row's confirmed tokens (and their q, for sampled
        drafts); the ids as stored."""
        ids = self.in_vocab(ids)
        self.pool.write(slots, starts, ids)
        if self.draft_probs is not None and probs is not None:
            self.draft_probs[slots, :k] = probs.float()
        return ids


class StepDevice(Protocol):
    """The part of the runner a graph captures: plan a step's buffers, run its device work."""

    attention: AttentionBackend
    isolate_speculator: bool
    """Off while graphs are captured: a raising speculator pass then fails the capture."""
    mask_widths: tuple[int, ...]
    """Verify widths of the steps with a grammar worth capturing (none: the step samples elsewhere,
    so no graph of it applies masks, penalties or logprobs)."""

    def plan(self, frame: StepFrame, padded: StepShape | None) -> AttentionMetadata: ...

    def device_step(self, meta: AttentionMetadata, shape: StepShape) -> DeviceOutputs: ...

    def device_body(self, meta: AttentionMetadata, shape: StepShape) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        ...

    def device_head(self, meta: AttentionMetadata, shape: StepShape, hidden: torch.Tensor,
                    captured: dict[int, torch.Tensor]) -> DeviceOutputs: ...
