"""A general-chat prompt corpus for drafters: the everyday requests people make of a chat model
(emails, explanations, lists, stories, advice, summaries, rewrites), which the code-heavy
built-in corpus (`corpus`) barely covers.

Two sources, each request one user turn:

* requests the target writes itself: it is sampled (temperature about 1) with its chat template
  opened at a user turn, the template's user header followed by one of a few opening words
  (`OPENERS`, for variety), so it writes what a user of it would ask and stops where the turn
  ends;
* requests written for this module: task frames (`FRAMES`: an email to someone about something,
  an explanation of a topic for a reader, tips for an activity, ...) filled from lists of
  everyday subjects (`SLOTS`). Both are data, not code: they live in `chat_frames.json` beside
  this module (package data), read once on import.

A request is kept only if it reads as a plausible one (`implausible`: whole, of a sensible
length, words rather than symbols, no code, no markup) and is a different request from every one
kept before it and from every request of the held-out general-chat set (`general_chat.same_request`:
not most of its content words shared). HumanEval is code, which no kept request is. The target
then answers the corpus like any other (`train-drafter --prompts FILE --generate-only`, greedy
and at temperatures), and `--holdout` keeps a share of its prompts out of training by a hash of
the prompt. The corpus is the same for a seed, a target and a platform's sampling.

    python -m speckernel.tools.train.chat --out chat.jsonl.gz --count 4000 [--written-share 0.25] [--platform cuda]
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import re
import string
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import anyio

from ...config import EngineConfig
from ...errors import InvalidInputError
from ...frontend.async_engine import AsyncEngine
from ...models.tokenizer import Tokenizer
from ...progress import Progress
from ...sampling_params import SamplingParams
from ..general_chat import GENERAL_CHAT, content_words
from .corpus import Conversation, read_data, texts, write_corpus

WRITTEN_SHARE = 0.25
OPENERS = ("", "", "", "Write", "Explain", "How", "What", "Can you", "Give me", "Help me", "I need", "Please",
           "Tell me", "Describe", "Suggest", "Why", "Summarize", "Rewrite", "Plan", "List", "Compare", "I")
"""What a request the target writes starts with (empty: the target's own first word), in turn."""
MAX_ROUNDS = 8
"""Rounds of sampling for the target's requests: each samples what the last one's yield says is missing."""
WRITTEN_TRIES = 50
"""Draws of a frame per written request asked for, at most."""
WRITTEN_STALE = 2000
"""Draws in a row that bring nothing new, after which the frames count as used up."""

MIN_CHARS, MAX_CHARS = 15, 600
MIN_WORDS, MAX_WORDS = 4, 100
CODE_WORDS = frozenset("""
algorithm api bash code coding compile compiler css database debug debugging function git github html
java javascript json linux programmer programming python regex software sql terminal typescript variable
""".split())
"""Words that make a request about code: a general-chat corpus leaves those to the code corpus."""
CODE_MARKS = ("```", "def ", "{", "}", "</", "/>", "==", "=>", "();", "#include", "import ", "print(", "<|", "|>",
              "http", "www.")
ROLE_MARKS = re.compile(r"^\s*(user|assistant|system)\s*:|\b(im_start|im_end|the user|as an ai)\b"
                        r"|\bhow (can|may) i (help|assist) you\b", re.I | re.M)
"""A turn's role spelled out, or the assistant's voice: the target wrote past or around the user turn."""
TEXT_CHARS = frozenset(string.ascii_letters + string.digits + " \n.,;:!?'\"()-$%&/"
                       "\u00a3\u20ac\u2018\u2019\u201c\u201d\u2013\u2014")
"""Characters of plain text (curly quotes, dashes, pound and euro signs included)."""


def implausible(text: str) -> str | None:
    """Why text is not a plausible everyday request (None: it is): too short or long, too few
    or too many words, code, not mostly text, a role or the assistant's voice, or a loop of the
    same words."""
    words = re.findall(r"[a-z']+", text.lower())
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return "length"
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return "words"
    if any(mark in text for mark in CODE_MARKS) or CODE_WORDS.intersection(words):
        return "code"
    if sum(c in TEXT_CHARS for c in text) < 0.97 * len(text) or sum(c.isalpha() for c in text) < 0.6 * len(text):
        return "not text"
    if ROLE_MARKS.search(text):
        return "role marker"
    if len(set(words)) < 0.5 * len(words):
        return "repeats"
    return None


class DistinctRequests:
    """The requests kept so far, each a different request (`same_request`) from the others and
    from the held-out ones, found through an index of content words instead of a comparison
    with every kept request."""

    def __init__(self, held_out: Iterable[str] = GENERAL_CHAT) -> None:
        self.words: list[frozenset[str]] = []
        """Content words of the held-out requests, then of the kept ones."""
        self.index: dict[str, list[int]] = defaultdict(list)
        for text in held_out:
            self._add(content_words(text))
        self.held_out = len(self.words)
        self.left_out: Counter[str] = Counter()
        """Requests refused, by reason."""

    def _add(self, words: frozenset[str]) -> None:
        for w in words:
            self.index[w].append(len(self.words))
        self.words.append(words)

    def clash(self, text: str) -> str | None:
        """Why text may not join (None: it may): it is a held-out request, or one already kept."""
        x = content_words(text)
        if not x:
            return "no content"
        shared = Counter(i for w in x for i in self.index.get(w, ()))
        for i, n in shared.items():
            if n >= 0.5 * (len(x) + len(self.words[i]) - n):  # |x & y| >= |x | y| / 2
                return "held out" if i < self.held_out else "duplicate"
        return None

    def admit(self, text: str) -> bool:
        """Keeps text if it is a plausible request unlike every other (else counts why not)."""
        reason = implausible(text) or self.clash(text)
        if reason is None:
            self._add(content_words(text))
        else:
            self.left_out[reason] += 1
        return reason is None


FRAMES_FILE = "chat_frames.json"
"""The task frames and what fills their slots, a file of this package (package data)."""


@functools.cache
def frames() -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """FRAMES_FILE, read once: the frames, and the fillers of each slot they name."""
    data = read_data(FRAMES_FILE)
    slots = data.get("slots")
    if not (isinstance(slots, dict) and slots):
        raise ValueError(f"{FRAMES_FILE}: 'slots' must be a non-empty object")
    fillers = {name: texts(slots, name, FRAMES_FILE) for name in slots}
    tasks = texts(data, "frames", FRAMES_FILE)
    unfilled = {name for task in tasks for _, name, _, _ in string.Formatter().parse(task) if name} - fillers.keys()
    if unfilled:
        raise ValueError(f"{FRAMES_FILE}: no fillers for the slots {sorted(unfilled)}")
    return tasks, fillers


FRAMES = frames()[0]
"""Everyday tasks; each {slot} is filled from SLOTS."""
SLOTS = frames()[1]
"""What fills each slot of FRAMES."""


def written_requests(count: int, rng: random.Random, kept: DistinctRequests) -> list[str]:
    """Up to `count` requests from FRAMES, each admitted by `kept`; fewer when the frames run
    out of distinct ones (a few hundred: WRITTEN_STALE draws in a row refused)."""
    out: list[str] = []
    fields = {frame: [name for _, name, _, _ in string.Formatter().parse(frame) if name] for frame in FRAMES}
    stale = 0
    for _ in range(count * WRITTEN_TRIES):
        if len(out) >= count or stale >= WRITTEN_STALE:
            break
        frame = rng.choice(FRAMES)
        text = frame.format(**{name: rng.choice(SLOTS[name]) for name in fields[frame]})
        if kept.admit(text):
            out.append(text)
            stale = 0
        else:
            stale += 1
    return out


MARK = "\ue000request\ue001"


def user_header(tokenizer: Tokenizer) -> str:
    """The chat template's text up to where a user's first message goes (its system turn, if it
    writes one, and the user header): what the target continues to write a request."""
    if not tokenizer.chat_template:
        raise InvalidInputError("the target has no chat template, so it has no user turn to write a request in; "
                                "use --written-share 1")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=False)
    if MARK not in text:
        raise InvalidInputError("the chat template does not place a user's message as it is")
    return text.split(MARK, 1)[0]


async def target_requests(engine: AsyncEngine, count: int, kept: DistinctRequests, *, seed: int, temperature: float,
                          top_p: float, max_tokens: int, concurrency: int) -> tuple[list[str], int]:
    """Up to `count` requests the target writes at a user turn, each admitted by `kept`, in the
    order of their seeds (so the same whatever order they finish in). Sampled in rounds, each
    as many as the yield so far says are needed, until there are enough, MAX_ROUNDS ran or a
    round kept none. A request that does not end its turn within max_tokens is left out.
    Returns the requests and how many were sampled."""
    header = user_header(engine.tokenizer)
    prompts = [engine.tokenizer.encode(header + opener, add_special_tokens=False) for opener in OPENERS]
    out: list[str] = []
    sampled = 0
    limit = anyio.Semaphore(concurrency)
    for _ in range(MAX_ROUNDS):
        if len(out) >= count:
            break
        yield_so_far = max(len(out) / sampled, 0.05) if sampled else 0.5
        n = max(32, math.ceil((count - len(out)) / yield_so_far * 1.1))
        texts: list[str | None] = [None] * n
        bar = Progress("train_chat: the target writing requests", n, n * max_tokens)

        async def one(i: int, first: int = sampled, texts: list[str | None] = texts, bar: Progress = bar) -> None:
            k = first + i
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    seed=seed * 1_000_003 + k)
            async with limit:
                finished = None
                async for o in engine.generate(prompts[k % len(OPENERS)], params):
                    bar.tokens(len(o.delta_token_ids))
                    if o.finished:
                        finished = o
                if finished is not None and finished.finish_reason == "stop":
                    texts[i] = (OPENERS[k % len(OPENERS)] + finished.text).strip()
            bar.request_done()

        with bar:
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        sampled += n
        before = len(out)
        for text in texts:
            if len(out) >= count:
                break
            if text is None:
                kept.left_out["unfinished"] += 1
            elif kept.admit(text):
                out.append(text)
        if len(out) == before:
            break
    return out, sampled


def build_chat_corpus(count: int, seed: int = 0, written_share: float = WRITTEN_SHARE, *,
                      config: EngineConfig | None = None, temperature: float = 1.0, top_p: float = 0.95,
                      max_tokens: int = 96, concurrency: int = 256,
                      ) -> tuple[list[Conversation], dict[str, Any]]:
    """`count` one-turn chats (fewer when the sources run out of distinct requests), shuffled:
    about `written_share` from FRAMES, the rest written by the target of `config` (an engine
    starts only when some are needed). Also what was left out and why, and how many requests
    came from each source."""
    if count < 0 or not 0 <= written_share <= 1:
        raise InvalidInputError(f"count must be >= 0 and written_share in [0, 1], got {count} and {written_share}")
    rng = random.Random(seed)
    kept = DistinctRequests()
    written = written_requests(round(count * written_share), rng, kept)
    by_target: list[str] = []
    sampled = 0
    if count > len(written):
        if config is None:
            raise InvalidInputError("requests written by the target need an engine config (or written_share 1)")

        async def run() -> tuple[list[str], int]:
            async with AsyncEngine(config) as engine:
                return await target_requests(engine, count - len(written), kept, seed=seed, temperature=temperature,
                                             top_p=top_p, max_tokens=max_tokens, concurrency=concurrency)

        by_target, sampled = anyio.run(run)
    requests = written + by_target
    rng.shuffle(requests)
    stats = {"written": len(written), "by_target": len(by_target), "sampled": sampled,
             "left_out": dict(sorted(kept.left_out.items()))}
    return [[{"role": "user", "content": text}] for text in requests], stats


def main(argv: Sequence[str] | None = None) -> int:
    """Write a general-chat corpus to a file, for `train-drafter --prompts` to answer."""
    parser = argparse.ArgumentParser(prog="python -m speckernel.tools.train.chat",
                                     description=__doc__.splitlines()[0] if __doc__ else None,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="output file (.jsonl, or .jsonl.gz for gzip)")
    parser.add_argument("--count", type=int, required=True, help="number of requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--written-share", type=float, default=WRITTEN_SHARE,
                        help="share of the requests from this module's frames; the target writes the rest")
    parser.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    parser.add_argument("--platform", default=None, help="platform for the target (default: best available)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling the target's requests")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=96, help="a request longer than this is left out")
    parser.add_argument("--concurrency", type=int, default=256, help="requests sampled at once")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache (default: sized from free memory)")
    args = parser.parse_args(argv)
    kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)
    try:
        config = EngineConfig(model=args.target, platform=args.platform, max_num_seqs=args.concurrency,
                              max_model_len=1024, kv_cache_bytes=kv_bytes, log_level="warning")
        conversations, stats = build_chat_corpus(
            args.count, args.seed, args.written_share, config=config, temperature=args.temperature, top_p=args.top_p,
            max_tokens=args.max_tokens, concurrency=args.concurrency)
    except InvalidInputError as e:
        parser.error(str(e))
    write_corpus(args.out, conversations)
    left = ", ".join(f"{n} {reason}" for reason, n in stats["left_out"].items())
    print(f"train_chat: wrote {len(conversations)} requests to {args.out} (seed {args.seed}): {stats['written']} "
          f"from the frames, {stats['by_target']} written by {args.target} from {stats['sampled']} sampled at "
          f"temperature {args.temperature}; left out: {left or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
