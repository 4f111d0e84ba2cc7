"""Second turns for the drafters' data: after the target answers a request, a user follow-up
("Can you make that shorter?", "How would you test that?") and the target's second answer, so
the drafters also learn the target's text deep in a conversation, with its own earlier answer
in the context. The follow-ups are data (`follow_ups.json`, package data), generic enough to
fit an answer to any request; which conversations get one, and which, is fixed by the seed.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

FILE = Path(__file__).with_name("follow_ups.json")


@functools.cache
def follow_ups() -> tuple[str, ...]:
    data = json.loads(FILE.read_text())
    texts = data.get("follow_ups")
    if not (isinstance(texts, list) and texts and all(isinstance(t, str) and t.strip() for t in texts)):
        raise ValueError(f"{FILE.name}: 'follow_ups' must be a non-empty list of strings")
    return tuple(texts)


def choose(count: int, share: float, seed: int) -> list[str | None]:
    """For each of `count` conversations, its follow-up or None: about `share` of them get one."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share: expected a number in [0, 1], got {share}")
    rng = random.Random(f"follow-ups/{seed}")
    texts = follow_ups()
    return [rng.choice(texts) if rng.random() < share else None for _ in range(count)]


def second_turn(conversation: list[dict[str, str]], answer: str, follow_up: str) -> list[dict[str, str]]:
    """The conversation with the target's answer and the user's follow-up after it."""
    return [*conversation, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
