"""Grammar state of structured-output requests: compiled off the step loop, one matcher per request.

Invariant: between steps a request's matcher has consumed exactly its output tokens. What the
grammar forces next (`forced`) goes ahead of a speculator's drafts, or alone. Scheduling a
row for it (`RequestGrammar.plan`) consumes the longest prefix of its drafts the grammar accepts
and writes one token bitmask per verified position (row j: what the grammar allows after the
first j drafts, the K+1 rows verification masks); before its next row (`sync`) those drafts are
rolled back and the tokens the step confirmed consumed. So a rejected draft never stays in the
matcher, and a stale row (preemption, abort) leaves nothing behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import log as logmod

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logmod.get("grammar")


class RequestGrammar:
    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = eos_token_ids
        self.num_output = 0
        """Output tokens the matcher has consumed."""
        self.num_drafts = 0
        """Drafts of the row in flight the matcher has consumed past them."""

    def sync(self, output_token_ids: list[int]) -> None:
        """Rolls back the last row's drafts and consumes the output confirmed since."""
        if self.num_drafts:
            self.matcher.rollback(self.num_drafts)
            self.num_drafts = 0
        for token in output_token_ids[self.num_output :]:
            if not self.matcher.consume_token(token):  # only ignore_eos or a stop token can lead here
                log.warning("grammar_rejected_output", token=token, error=self.matcher.get_error())
                break
        self.num_output = len(output_token_ids)

    def forced(self, limit: int) -> list[int]:
        """Up to limit tokens the grammar forces next (its only continuation: a fixed key, a
        closing brace), after `sync`: drafts that cost no drafter. The matcher does not move."""
        if limit <= 0 or self.matcher.is_error() or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def plan(self, drafts: list[int]) -> tuple[list[int], bytes]:
        """(the longest prefix of drafts the grammar accepts, its len + 1 bitmask rows as int32
        words); the matcher stays advanced by the kept drafts until the next `sync`."""
        kept = self.matcher.try_consume_tokens(drafts) if drafts else 0
        if kept:
            self.matcher.rollback(kept)
        masks = [self._mask()]
        for token in drafts[:kept]:
            self.matcher.consume_token(token)
            masks.append(self._mask())
        self.num_drafts = kept
        return drafts[:kept], b"".join(masks)

    def _mask(self) -> bytes:
        if self.matcher.is_error():  # nothing is allowed: end the request instead of sampling from -inf
            words = bytearray(4 * self.words)
            for t in self.eos_token_ids:
                words[4 * (t // 32) + (t % 32) // 8] |= 1 << (t % 8)
            return bytes(words)
        return self.matcher.compute_bitmask()[: 4 * self.words]  # llguidance keeps a word past the vocabulary
