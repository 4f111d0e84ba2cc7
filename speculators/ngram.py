"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens. Needs no model; variable width (it may find fewer than K). It keeps
no state: each proposal reads the request's history from the kernel's token buffer."""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import torch

from speckernel.plugin import (
    Drafts,
    InvalidInputError,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
    TargetStates,
)


def lookup(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_lookup_max: Annotated[int, msgspec.Meta(ge=1)] = 4
    """Longest suffix to look up."""
    prompt_lookup_min: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Shortest suffix to look up."""


class NgramSpeculator(SpeculatorBase):
    name = "ngram"
    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=16)
    Options = NgramOptions

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device
        self.options: NgramOptions = ctx.options

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        o: NgramOptions = ctx.options
        if o.prompt_lookup_min > o.prompt_lookup_max:
            raise InvalidInputError(f"ngram: prompt_lookup_min ({o.prompt_lookup_min}) exceeds "
                                    f"prompt_lookup_max ({o.prompt_lookup_max})")

    def propose(self, states: TargetStates, k: int) -> Drafts:
        out = torch.full((states.num_rows, k), -1, dtype=torch.int64)
        rows = [i for i in range(states.num_rows) if states.samples[i]]
        if rows:
            width = max(states.seq_lens[i] for i in rows)
            history = states.tokens[states.slot_index[rows], :width].cpu().numpy()  # one copy for all rows
            for j, i in enumerate(rows):
                found = lookup(history[j, : states.seq_lens[i]], k, self.options.prompt_lookup_max,
                               self.options.prompt_lookup_min)
                out[i, : len(found)] = torch.tensor(found, dtype=torch.int64)
        return Drafts(out.to(self.device))

    def sync(self, states: TargetStates) -> None:
        return None  # nothing to keep in step: the history lives in the token buffer
