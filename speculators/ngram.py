"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens. Needs no model; variable width (it may find fewer than K)."""

from __future__ import annotations

import numpy as np
import torch

from speckernel.speculator import Drafts, ProposeRow, SpeculatorCapabilities, SpeculatorContext

from .history import TokenHistory


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    arr = np.asarray(tokens)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramSpeculator:
    name = "ngram"
    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=16)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device
        self.max_n = int(ctx.options.extra.get("prompt_lookup_max", 4))
        self.min_n = int(ctx.options.extra.get("prompt_lookup_min", 1))
        self.history = TokenHistory()

    def check(self, ctx: SpeculatorContext) -> None:
        return None

    def propose(self, rows: list[ProposeRow], k: int) -> Drafts:
        out = torch.full((len(rows), k), -1, dtype=torch.int64)
        for i, row in enumerate(rows):
            found = lookup(self.history.update(row), k, self.max_n, self.min_n)
            out[i, : len(found)] = torch.tensor(found, dtype=torch.int64)
        return Drafts(out.to(self.device))

    def sync(self, rows: list[ProposeRow]) -> None:
        for row in rows:
            self.history.update(row)

    def release(self, req_id: str) -> None:
        self.history.release(req_id)
