"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens. Needs no model; variable width (it may find fewer than K). It keeps
no state: each proposal reads the request's history from the kernel's token buffer.

It is an `InStepSpeculator`: the lookup runs on the device, over every row and every position of the
token buffer's fixed width at once (R x width compares per suffix length, a handful of
lengths), with shapes that never depend on the data. Nothing is copied to the host and nothing
waits for the device, so the kernel can capture propose inside the step's graph and run ahead
of the host. `lookup` is the host reference the device version must match."""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import torch

from speckernel.plugin import (
    DeviceStates,
    Drafts,
    InvalidInputError,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
)


def lookup(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Host reference: for n from min(max_n, len - 1) down to min_n, the latest window of
    tokens[:-1] equal to the last n tokens; the (at most k) tokens that followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def lookup_device(tokens: torch.Tensor, slot_index: torch.Tensor, seq_lens: torch.Tensor,
                  samples: torch.Tensor, k: int, max_n: int, min_n: int) -> torch.Tensor:
    """`lookup` for every row at once, on the device: [R, k] int64, -1 past the drafts found
    and in rows that do not sample. Fixed shapes, no host synchronisation.

    A window of n tokens is identified by the position q of its last token: it matches when
    hist[q - j] == hist[L - 1 - j] for j < n, which extends the match of length n - 1 by one
    compare, so the lengths are built up incrementally. It lies within hist[:-1] and within
    the row when n - 1 <= q <= L - 2; the drafts then start at q + 1."""
    rows, width = slot_index.shape[0], tokens.shape[1]
    device = tokens.device
    hist = tokens.index_select(0, slot_index)  # [R, W]
    lens = seq_lens.to(torch.int64).clamp(0, width)  # [R]
    pos = torch.arange(width, device=device)  # [W]
    top = min(max_n, width - 1)  # n <= L - 1 <= width - 1
    # hist shifted right by j is padded[:, top - j : top - j + width] (a view, no copy).
    padded = torch.nn.functional.pad(hist, (top, 0), value=-1)
    match = torch.ones(rows, width, dtype=torch.bool, device=device)
    start = torch.full((rows,), -1, dtype=torch.int64, device=device)
    for n in range(1, top + 1):
        j = n - 1
        suffix = hist.gather(1, (lens - 1 - j).clamp(min=0).unsqueeze(1))  # [R, 1]: hist[L-1-j]
        match &= padded[:, top - j : top - j + width] == suffix
        if n < min_n:
            continue
        inside = (pos >= n - 1) & (pos.unsqueeze(0) <= (lens - 2).unsqueeze(1))  # [R, W]
        latest = torch.where(match & inside, pos, -1).amax(dim=1)  # [R], -1 when none
        # Longer suffixes come later and win, as in `lookup` (which tries them first).
        start = torch.where(latest >= 0, latest + 1, start)
    idx = start.unsqueeze(1) + torch.arange(k, device=device)  # [R, k]
    found = (start >= 0).unsqueeze(1) & (idx < lens.unsqueeze(1)) & samples.to(torch.bool).unsqueeze(1)
    drafts = hist.gather(1, idx.clamp(0, width - 1))
    return torch.where(found, drafts, -1)


class NgramOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_lookup_max: Annotated[int, msgspec.Meta(ge=1)] = 4
    """Longest suffix to look up."""
    prompt_lookup_min: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Shortest suffix to look up."""


class NgramSpeculator(SpeculatorBase):
    name = "ngram"
    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=16,
                                          k0_pass="nothing: it reads the token buffer when it drafts")
    Options = NgramOptions

    def __init__(self, ctx: SpeculatorContext[NgramOptions]) -> None:
        self.device = ctx.device
        self.options = ctx.options

    @classmethod
    def check(cls, ctx: SpeculatorContext[NgramOptions]) -> None:
        o = ctx.options
        if o.prompt_lookup_min > o.prompt_lookup_max:
            raise InvalidInputError(f"ngram: prompt_lookup_min ({o.prompt_lookup_min}) exceeds "
                                    f"prompt_lookup_max ({o.prompt_lookup_max})")

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        return Drafts(lookup_device(states.tokens, states.slot_index, states.seq_lens,
                                    states.samples, k, self.options.prompt_lookup_max,
                                    self.options.prompt_lookup_min))

    def sync(self, states: DeviceStates) -> None:
        return None  # nothing to keep in step: the history lives in the token buffer
