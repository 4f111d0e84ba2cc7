"""Incremental detokenization and stop strings, on the frontend side of the wire.

Only the text since the last complete character is decoded again; a delta is held back while
it ends in an incomplete UTF-8 sequence, and the last (longest stop string - 1) characters are
held back until it is clear they do not begin a stop string.
"""

from __future__ import annotations

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Appends tokens; returns (text to emit now, whether a stop string ended the text)."""
        self.token_ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        searched_from = max(0, len(self.text) - self.holdback)
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        stopped = False
        for s in self.stop:
            hit = self.text.find(s, searched_from)
            if hit != -1:
                self.text, stopped = self.text[:hit], True
        limit = len(self.text) if (stopped or finished) else len(self.text) - self.holdback
        delta = self.text[self.emitted : limit] if limit > self.emitted else ""
        self.emitted = max(self.emitted, limit)
        return delta, stopped
