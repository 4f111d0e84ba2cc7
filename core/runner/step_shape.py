"""What fixes a step's device work, what that work leaves behind, and what device graphs need of
the runner: the seam between `model_runner` and `step_graphs`, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..attention import AttentionBackend, AttentionMetadata
from ..kernel.frame import StepFrame


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
    """Drafts a device-only speculator proposes inside the step: K, or 0 (its sync pass, or none)."""
    any_penalty: bool = False
    """Some row has a repetition, frequency or presence penalty: the step counts tokens (eagerly:
    no graph is captured for it)."""
    logprobs: int = -1
    """The most top alternatives a row of this step reports (-1: no row asked for logprobs). A
    step with logprobs runs eagerly; one without runs exactly the kernels it ran before."""


@dataclass
class DeviceOutputs:
    """What the device part of a step leaves behind (graph-static when replayed)."""

    packed: torch.Tensor
    """[R, W + 3]: W + 1 output tokens (-1 padded), the real drafts verified (`verify.drafted_counts`),
    then the accepted count (W: the padded verify_width)."""
    hidden: torch.Tensor
    captured: dict[int, torch.Tensor]
    drafts: torch.Tensor | None = None
    """[R, propose_width] what a device-only speculator proposed (-1 ends a row), already in the buffer."""
    logprobs: torch.Tensor | None = None
    """[L, W + 1, 1 + N] float32 for the L rows that asked: each output position's chosen-token
    logprob, then its top N (`sampler.token_logprobs`); None when no row asked."""
    logprob_ids: torch.Tensor | None = None
    """[L, W + 1, N] int64: the token ids of those top N."""


class StepDevice(Protocol):
    """The part of the runner a graph captures: plan a step's buffers, run its device work."""

    attention: AttentionBackend
    isolate_speculator: bool
    """Off while graphs are captured: a raising speculator pass then fails the capture."""

    def plan(self, frame: StepFrame, padded: StepShape | None) -> AttentionMetadata: ...

    def device_step(self, meta: AttentionMetadata, shape: StepShape) -> DeviceOutputs: ...
