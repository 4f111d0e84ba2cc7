"""Stop strings matched in time linear in the text: an Aho-Corasick automaton fed one character
at a time.

Checking every stop string against the end of the text after every token costs about
sum(|stop|) x |stop| per token (1,000 stop strings of 1,000 characters: seconds per token). The
automaton's state after the text read so far is the longest end of the text that is a prefix of
some stop string, so both questions the detokenizer asks (where does the first stop string
complete, how much must be held back) cost O(1) amortized per new character, after a build
linear in the stop strings' total length.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._match = [0]
        """Length of the longest stop string that ends at this state (its own or by fail links)."""
        for s in stop:
            state = 0
            for ch in s:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][ch] = nxt
                    self._goto.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(0)
                state = nxt
            self._match[state] = max(self._match[state], len(s))
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            self._match[state] = max(self._match[state], self._match[self._fail[state]])
            for ch, nxt in self._goto[state].items():
                f = self._fail[state]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                target = self._goto[f].get(ch, 0)
                self._fail[nxt] = target if target != nxt else 0
                queue.append(nxt)
        self._state = 0
        self.read = 0
        """How many characters of the text have been fed."""

    def feed(self, text: str) -> int | None:
        """Reads the characters of `text` from position `read` on; returns where the first stop
        string to complete begins (the longest of those ending at the same character), or None.
        After a hit nothing more should be fed."""
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for i in range(self.read, len(text)):
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                self._state, self.read = state, i + 1
                return i + 1 - match[state]
        self._state, self.read = state, len(text)
        return None

    @property
    def held_back(self) -> int:
        """Length of the longest end of the text read that could still grow into a stop string."""
        return self._depth[self._state]
