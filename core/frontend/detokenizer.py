"""Incremental detokenization and stop strings, on the frontend side of the wire.

The core streams token ids; this turns them into text deltas and decides where a stop string
ends the request. The rules, which tests/test_detokenizer.py pins down:

- Text. Tokens are decoded one at a time against a short window (the previous complete chunk
  and the new token), so the cost per token stays flat and the text equals a one-shot decode.
  A token that leaves an incomplete UTF-8 sequence adds no text until a later token completes
  it; when the request finishes, whatever is left is flushed as a one-shot decode shows it.
- Holdback. While the request runs, the longest end of the text that is a proper prefix of some
  stop string is held back, so no delta ever shows the start of a stop string that then
  completes. Without stop strings nothing is held back but incomplete characters.
- Stop strings. The text ends right before the stop-string occurrence that is complete first
  (the one whose last character comes earliest; on a tie, the one that starts earliest). That
  depends on the text alone, never on how the tokens were split into deltas: a delta of K+1
  speculative tokens stops exactly where K+1 single-token deltas would.
- Tokens. `token_ids` is always the shortest prefix of the generated tokens whose decoded text
  covers `text`, a character counting as decoded once its last byte is. So on a stop, tokens
  that only contribute text at or after the stop string's start are dropped (as are tokens that
  contribute no text, such as special tokens, right before it), and a token straddling the cut
  is kept. While text is held back, so are the tokens that carry only that text. Once the
  request finishes without a stop string, every token is released (special tokens included).
- Finish reason. "stop" whenever a stop string ended the text, even if the core finished the
  request for another reason ("length") in the same delta; the core's reason otherwise.

Hence the concatenated deltas of text and tokens always equal `text` and `token_ids`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import msgspec

from ..models.tokenizer import Tokenizer
from .stop_matcher import StopMatcher


class DetokenizedDelta(msgspec.Struct, frozen=True, kw_only=True):
    """What one add() releases to the caller."""

    text: str
    """New text, safe to show: it can no longer turn into part of a stop string."""
    token_ids: list[int]
    """The tokens released along with it (see the module docstring for the rule)."""
    finish_reason: str | None = None
    """Set once the request is over: "stop" if a stop string ended the text, else the core's."""
    stopped: bool = False
    """A stop string ended the text, so the core (if still generating) must be told to abort."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._ids: list[int] = []
        self._ends: list[int] = []
        """_ends[i]: length of the decoded text once token i is consumed (non-decreasing)."""
        self._text = ""
        self._emitted = 0
        self._released = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.finished = False

    @property
    def text(self) -> str:
        """Everything released so far: the concatenation of every delta's text."""
        return self._text[: self._emitted]

    @property
    def token_ids(self) -> list[int]:
        """The tokens behind `text` (a fresh list)."""
        return self._ids[: self._released]

    def add(self, new_ids: Sequence[int], finish_reason: str | None = None) -> DetokenizedDelta:
        """Consumes the core's next delta; `finish_reason` is the core's, None while it runs."""
        if self.finished:  # a stop string or the core ended it: late tokens mean nothing
            return DetokenizedDelta(text="", token_ids=[], finish_reason=None)
        for token_id in new_ids:
            self._consume(int(token_id))
        if finish_reason is not None:
            self._flush()
        hit = None if self._matcher is None else self._matcher.feed(self._text)
        stopped = hit is not None
        if hit is not None:
            self._text = self._text[:hit]
            emit_to = hit
        elif finish_reason is not None:
            emit_to = len(self._text)
        else:
            emit_to = len(self._text) - (0 if self._matcher is None else self._matcher.held_back)
        text = self._text[self._emitted : emit_to]
        self._emitted = emit_to
        if finish_reason is not None and not stopped:
            release_to = len(self._ids)
        else:
            release_to = bisect_left(self._ends, emit_to) + 1 if emit_to else 0
        token_ids = self._ids[self._released : release_to]
        self._released = release_to
        reason = "stop" if stopped else finish_reason
        self.finished = reason is not None
        return DetokenizedDelta(text=text, token_ids=token_ids, finish_reason=reason, stopped=stopped)

    def _consume(self, token_id: int) -> None:
        """Decodes one more token; its text waits while it ends inside a UTF-8 sequence."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        before = self._read_offset - self._prefix_offset
        # Most tokens print at once, so the window before the new one is the last token alone.
        prefix = self.tokenizer.decode_alone(window[0]) if before == 1 else self.tokenizer.decode(window[:before])
        full = self.tokenizer.decode(window)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            end = len(self._text)
        else:
            # Its bytes may already complete a character (and begin the next one): credit this
            # token with those characters, so a stop right after them keeps it and drops the rest.
            end = len(self._text) + max(0, len(full.rstrip("\ufffd")) - len(prefix))
        self._ends.append(max(end, self._ends[-1]) if self._ends else end)

    def _flush(self) -> None:
        """At the end, bytes that never formed a character show as a one-shot decode shows them."""
        if self._read_offset < len(self._ids):
            window = self._ids[self._prefix_offset :]
            prefix = self.tokenizer.decode(window[: self._read_offset - self._prefix_offset])
            self._text += self.tokenizer.decode(window)[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._ends[-1] = len(self._text)
