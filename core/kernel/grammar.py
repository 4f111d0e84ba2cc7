"""Grammar state of structured-output requests: compiled off the step loop, one matcher per request.

Invariant: a request's matcher only ever consumes its confirmed output tokens (`sync`, before
each of its rows; a row run ahead of its frame in flight gets its mask after that frame is
applied, `Scheduler.late_masks`). What the grammar forces next (`forced`) goes ahead of a speculator's drafts,
or alone. Scheduling a row keeps the longest prefix of its drafts the grammar accepts (`valid`,
which leaves the matcher where it was); then the masks of every row of the step are computed
at once, in parallel, outside the GIL (`fill_masks`): one token bitmask per verified position
(row j: what the grammar allows after the first j drafts, the K+1 rows verification masks). So a
rejected draft never enters the matcher, and a stale row (preemption, abort) leaves nothing
behind.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import log as logmod

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

log = logmod.get("grammar")


class RequestGrammar:
    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = eos_token_ids
        self.num_output = 0
        """Output tokens the matcher has consumed."""
        self.forcing = False
        """When last asked (`forced`), the grammar forced more tokens than the row could take: its
        next row waits for its frame instead of running ahead, so the rest go in as drafts."""

    def sync(self, output_token_ids: list[int]) -> None:
        """Consumes the output confirmed since the last call."""
        for token in output_token_ids[self.num_output :]:
            if not self.matcher.consume_token(token):  # only ignore_eos or a stop token can lead here
                log.warning("grammar_rejected_output", token=token, error=self.matcher.get_error())
                break
        self.num_output = len(output_token_ids)

    def forced(self, limit: int) -> list[int]:
        """Up to limit tokens the grammar forces next (its only continuation: a fixed key, a
        closing brace), after `sync`: drafts that cost no drafter. The matcher does not move."""
        if limit <= 0 or self.matcher.is_error() or self.matcher.is_stopped():
            self.forcing = False
            return []
        forced = list(self.matcher.compute_ff_tokens())
        self.forcing = len(forced) > limit
        return forced[:limit]

    def valid(self, drafts: list[int]) -> list[int]:
        """The longest prefix of drafts the grammar accepts after `sync`; the matcher does not move."""
        kept = self.matcher.try_consume_tokens(drafts) if drafts else 0
        if kept:
            self.matcher.rollback(kept)
        return drafts[:kept]

    def plan(self, drafts: list[int]) -> tuple[list[int], bytes]:
        """(the valid prefix of drafts, its len + 1 bitmask rows as int32 words): one row's
        `valid` and `fill_masks`."""
        kept = self.valid(drafts)
        return kept, fill_masks([(self, kept)])[0]

    def error_mask(self) -> bytes:
        """A matcher in error allows nothing: only end-of-sequence, so the request ends instead
        of sampling from -inf."""
        words = bytearray(4 * self.words)
        for t in self.eos_token_ids:
            words[4 * (t // 32) + (t % 32) // 8] |= 1 << (t % 8)
        return bytes(words)


@functools.cache
def _executor() -> LLExecutor:
    """llguidance's thread pool (one per process): masks are computed there without the GIL."""
    from llguidance import LLExecutor  # imported by the engines that serve a grammar

    return LLExecutor()


def fill_masks(rows: Sequence[tuple[RequestGrammar, list[int]]]) -> list[bytes]:
    """Each row's bitmask rows (len(drafts) + 1 of them, int32 words), all computed in one call
    on llguidance's threads; drafts must be valid (`valid`) and the matchers synced."""
    from llguidance.numpy import (  # imported by the engines that serve a grammar
        fill_next_token_bitmask_par,
        fill_next_token_bitmask_par_with_draft_tokens,
        get_bitmask_shape,
    )

    if not rows:
        return []
    offsets = np.cumsum([0] + [len(d) + 1 for _, d in rows])
    words = rows[0][0].words
    masks = np.zeros(get_bitmask_shape(int(offsets[-1]), rows[0][0].vocab_size), np.int32)
    live = [(g, d, int(at)) for (g, d), at in zip(rows, offsets, strict=False) if not g.matcher.is_error()]
    plain = [(g.matcher, at) for g, d, at in live if not d]
    drafted = [(g.matcher, at, d) for g, d, at in live if d]
    if plain:
        fill_next_token_bitmask_par(_executor(), plain, masks)
    if drafted:
        fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, masks)
    out = []
    for (g, d), at in zip(rows, offsets, strict=False):
        if g.matcher.is_error():
            masks[at : at + len(d) + 1, :words] = np.frombuffer(g.error_mask(), np.int32)
        out.append(masks[at : at + len(d) + 1, :words].tobytes())
    return out
