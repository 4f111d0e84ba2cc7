"""IncrementalDetokenizer with the real default tokenizer: text, holdback, stop strings, tokens.

No engine runs here: token ids come from encoding known text, and deltas are cut by hand the way
the core would send them (one token each, or K+1 at once with speculation).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from speckernel.frontend.detokenizer import DetokenizedDelta, IncrementalDetokenizer
from speckernel.models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the `tokenizer` fixture reads the default model's file, as in test_tokenizer.py
TEXTS = [
    "I like world maps and world peace.",
    "The cat sat on the mat.",
    "Hello 🙂 world 🎉!",
    "東京タワー 🗼 and 🇫🇷 flags, 𝄞𝄢 music ok",
    "日本語のテキスト",
    "naïve café — ok",
    "def f(x):\n    return x  # done\n",
]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text, "test texts must round-trip through the tokenizer"
    return ids


def chunks(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cuts ids into deltas of the given sizes (the last size repeats)."""
    out, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[min(k, len(sizes) - 1)]
        out.append(list(ids[i : i + size]))
        i, k = i + size, k + 1
    return out


def run(
    tokenizer: Tokenizer, deltas: list[list[int]], stop: Sequence[str] = (), last_reason: str | None = "length"
) -> tuple[IncrementalDetokenizer, list[DetokenizedDelta]]:
    """Feeds deltas as the core would, the last carrying `last_reason`; stops early like the engine."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    steps = []
    for i, delta in enumerate(deltas):
        step = detok.add(delta, last_reason if i == len(deltas) - 1 else None)
        steps.append(step)
        assert detok.text == "".join(s.text for s in steps), "text must be the concatenation of deltas"
        assert detok.token_ids == [t for s in steps for t in s.token_ids], "same for the tokens"
        if step.finish_reason is not None:
            break
    return detok, steps


def shortest_cover(tokenizer: Tokenizer, ids: list[int], text: str) -> list[int]:
    """Oracle: the shortest prefix of ids whose one-shot decode starts with text."""
    return next(ids[:n] for n in range(len(ids) + 1) if tokenizer.decode(ids[:n]).startswith(text))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [5], [1000]], ids=str)
def test_incremental_text_equals_one_shot_decode(tokenizer: Tokenizer, text: str, sizes: list[int]) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, ())
    for delta in chunks(ids, sizes):
        step = detok.add(delta)
        assert "\ufffd" not in step.text, "a character split across tokens must never show half-done"
        assert text.startswith(detok.text)
        assert tokenizer.decode(detok.token_ids).startswith(detok.text)
    # Valid text: every character is complete once the last token is in, even before the finish.
    assert detok.text == text
    assert detok.token_ids == ids
    last = detok.add([], "length")
    assert (last.text, last.token_ids, last.finish_reason) == ("", [], "length")


def test_multibyte_characters_really_are_split_across_tokens(tokenizer: Tokenizer) -> None:
    """Guards the tests above: they only mean something if some tokens hold partial characters."""
    for text in ("Hello 🙂 world 🎉!", "日本語のテキスト"):
        assert any("\ufffd" in tokenizer.decode([t]) for t in encode(tokenizer, text))


def test_tokens_of_an_unfinished_character_wait_for_it(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "Hello 🙂 world 🎉!")
    cut = next(i for i, t in enumerate(ids) if tokenizer.decode([t]) == " \ufffd")  # ' ' + 1st byte of 🎉
    detok = IncrementalDetokenizer(tokenizer, ())
    step = detok.add(ids[: cut + 1])
    assert detok.text == "Hello 🙂 world" and detok.token_ids == ids[:cut]
    step = detok.add(ids[cut + 1 : cut + 3])
    assert step.text == " 🎉" and step.token_ids == ids[cut : cut + 3]


def test_finished_flushes_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "Hello 🙂 world 🎉!")
    cut = next(i for i, t in enumerate(ids) if tokenizer.decode([t]) == " \ufffd")
    detok, steps = run(tokenizer, [[t] for t in ids[: cut + 2]])
    assert detok.text == tokenizer.decode(ids[: cut + 2])  # as a one-shot decode shows it
    assert detok.token_ids == ids[: cut + 2]
    assert steps[-1].finish_reason == "length"


def test_holdback_never_shows_the_start_of_a_stop_string(tokenizer: Tokenizer) -> None:
    text = "I like world maps and world peace."
    ids = encode(tokenizer, text)
    stop = (" world peace",)
    final = text[: text.index(stop[0])]
    detok = IncrementalDetokenizer(tokenizer, stop)
    shown = []
    for t in ids:
        step = detok.add([t])
        assert final.startswith(detok.text), f"{detok.text!r} leaks the start of the stop string"
        shown.append(detok.text)
        if step.stopped:
            break
    # " world" is held back each time; the first is released once " maps" shows it is no stop.
    assert shown[:5] == ["I", "I like", "I like", "I like world maps", "I like world maps and"]
    assert shown[5] == "I like world maps and"
    assert detok.text == final and step.finish_reason == "stop"
    assert detok.token_ids == ids[:5]


def test_nothing_is_held_back_without_a_possible_stop_prefix(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "The cat sat on the mat.")
    detok = IncrementalDetokenizer(tokenizer, ("zebra", "mat."))
    step = detok.add(ids[:3])
    assert step.text == "The cat sat" and step.token_ids == ids[:3]


def test_finished_flushes_held_back_text(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "I like world maps and world")
    detok, steps = run(tokenizer, [[t] for t in ids], stop=(" world peace",), last_reason="length")
    assert steps[-2].text == " and"  # the last " world" waits for the next token ...
    assert steps[-1].text == " world" and steps[-1].token_ids == ids[-1:]  # ... which never comes
    assert detok.text == "I like world maps and world" and detok.token_ids == ids
    assert steps[-1].finish_reason == "length" and not steps[-1].stopped


@pytest.mark.parametrize("split", [3, 4], ids=lambda s: f"split{s}")
def test_stop_string_spanning_two_deltas(tokenizer: Tokenizer, split: int) -> None:
    text = "The cat sat on the mat."
    ids = encode(tokenizer, text)  # The| cat| sat| on| the| mat|.
    stop = ("sat on the",)  # starts inside token 2 (" sat"), ends in token 4 (" the")
    detok, steps = run(tokenizer, [ids[:split], ids[split:]], stop, last_reason=None)
    assert steps[0].finish_reason is None
    assert "s" not in steps[0].text.removeprefix("The cat"), "the stop's start showed in delta 1"
    assert detok.text == "The cat " and steps[-1].finish_reason == "stop" and steps[-1].stopped
    assert detok.token_ids == ids[:3], "' sat' straddles the cut: its space is text, so it stays"


def test_stop_string_in_a_multi_token_delta_trims_tokens(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "The cat sat on the mat.")
    # One speculative delta of K+1 = 7 tokens; the stop begins exactly at " on".
    detok, steps = run(tokenizer, [ids], stop=(" on",), last_reason=None)
    (step,) = steps
    assert step.text == "The cat sat" and step.token_ids == ids[:3]
    assert detok.token_ids == ids[:3] and step.finish_reason == "stop" and step.stopped


def test_stop_at_the_very_start_leaves_nothing(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "The cat sat")
    detok, steps = run(tokenizer, [ids], stop=("The",), last_reason=None)
    assert (detok.text, detok.token_ids, steps[-1].finish_reason) == ("", [], "stop")


def test_stop_inside_a_multibyte_character_sequence(tokenizer: Tokenizer) -> None:
    """🎉 spans three tokens, the first also carrying the space before it: only that one stays."""
    ids = encode(tokenizer, "Hello 🙂 world 🎉!")
    cut = next(i for i, t in enumerate(ids) if tokenizer.decode([t]) == " \ufffd")
    for deltas in ([ids], [[t] for t in ids]):
        detok, steps = run(tokenizer, deltas, stop=("🎉",), last_reason="length")
        assert detok.text == "Hello 🙂 world " and steps[-1].finish_reason == "stop"
        assert detok.token_ids == ids[: cut + 1]


@pytest.mark.parametrize("text", TEXTS)
def test_token_rule_matches_the_oracle_at_every_cut(tokenizer: Tokenizer, text: str) -> None:
    """For a stop string at every position: text ends before it, tokens are its shortest cover,
    and neither depends on how the tokens were cut into deltas."""
    ids = encode(tokenizer, text)
    rng = random.Random(text)
    for start in range(len(text)):
        stop = text[start : start + 2]
        hit = text.find(stop)
        expected_text = text[:hit]
        expected_ids = shortest_cover(tokenizer, ids, expected_text)
        for sizes in ([1], [len(ids)], [rng.randint(1, 4) for _ in range(len(ids))]):
            detok, steps = run(tokenizer, chunks(ids, sizes), (stop,), last_reason="length")
            assert detok.text == expected_text, (stop, sizes)
            assert detok.token_ids == expected_ids, (stop, sizes)
            assert steps[-1].finish_reason == "stop"


def test_earliest_stop_string_wins_whatever_its_place_in_the_list(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "The cat sat on the mat.")
    for stop in ((" mat", " sat", "on"), ("on", " sat", " mat")):
        detok, _ = run(tokenizer, [ids], stop, last_reason=None)
        assert detok.text == "The cat" and detok.token_ids == ids[:2]


def test_stop_string_that_completes_first_wins_over_one_that_starts_first(tokenizer: Tokenizer) -> None:
    """The stop "at s" is complete at "The cat s", before "cat sat" is: the text ends before
    "at s", as it would if the tokens came one by one, so the delta split cannot change it."""
    ids = encode(tokenizer, "The cat sat on the mat.")
    for deltas in ([ids], [[t] for t in ids], [ids[:2], ids[2:]]):
        detok, _ = run(tokenizer, deltas, ("cat sat", "at s"), last_reason=None)
        assert detok.text == "The c" and detok.token_ids == ids[:2]


@pytest.mark.parametrize(
    ("core_reason", "stop", "expected"),
    [
        (None, (), None),
        (None, (" sat",), "stop"),
        ("length", (), "length"),
        ("length", (" sat",), "stop"),  # max_tokens ran out in the very delta that holds the stop
        ("stop", (), "stop"),  # EOS or a stop token
        ("stop", (" sat",), "stop"),
        ("abort", (), "abort"),
        ("abort", ("zebra",), "abort"),
    ],
)
def test_finish_reason_rule(
    tokenizer: Tokenizer, core_reason: str | None, stop: tuple[str, ...], expected: str | None
) -> None:
    ids = encode(tokenizer, "The cat sat on the mat.")
    step = IncrementalDetokenizer(tokenizer, stop).add(ids, core_reason)
    assert step.finish_reason == expected
    assert step.stopped == bool(stop and stop != ("zebra",))


def test_tokens_after_a_stop_are_ignored(tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, "The cat sat on the mat.")
    detok = IncrementalDetokenizer(tokenizer, (" sat",))
    assert detok.add(ids[:4]).stopped
    late = detok.add(ids[4:], "length")
    assert (late.text, late.token_ids, late.finish_reason) == ("", [], None)
    assert detok.text == "The cat" and detok.token_ids == ids[:2]


def test_special_tokens_add_no_text_but_are_released_at_the_end(tokenizer: Tokenizer) -> None:
    ids = [*encode(tokenizer, "The cat"), *tokenizer.eos_token_ids]
    detok, steps = run(tokenizer, [[t] for t in ids], last_reason="stop")
    assert detok.text == "The cat" and detok.token_ids == ids
    assert steps[-1].text == "" and steps[-1].token_ids == list(tokenizer.eos_token_ids)


@pytest.mark.timing  # under a second
def test_many_long_stop_strings_cost_time_linear_in_the_text(tokenizer: Tokenizer) -> None:
    """200 stop strings of 500 characters, each sharing a long start with the text: checking them
    all against the text's end after every token cost about 4e7 steps for 400 tokens (seconds);
    the automaton reads each new character once."""
    text = "the cat sat on the mat and then it sat on the hat. " * 30
    ids = encode(tokenizer, text)
    rng = random.Random(0)
    stop = [text[: rng.randrange(100, 300)] + "#" * (500 - 300) + str(i) for i in range(200)]
    detok = IncrementalDetokenizer(tokenizer, stop)
    t0 = time.perf_counter()
    for token in ids:
        detok.add([token])
    took = time.perf_counter() - t0
    assert took < 1.0, f"{took:.2f} s for {len(ids)} tokens"
    reference = IncrementalDetokenizer(tokenizer)
    reference.add(ids, "length")
    assert detok.add([], "length").finish_reason == "length" and detok.text == reference.text
