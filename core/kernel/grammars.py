"""Grammars compiled off the step loop: one worker thread, and a cache of compiled grammars."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..errors import InvalidSamplingParamsError
from ..sampling_params import StructuredOutput
from .grammar import RequestGrammar

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

CACHE_SIZE = 256
"""Compiled grammars kept (a server sees the same few schemas again and again)."""


class Grammars:
    """Compiles grammars on a worker thread (the step loop never waits for one) and keeps the
    compiled ones: a request gets a copy of its grammar's warmed matcher."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speckernel-grammar")
        self._cache: OrderedDict[StructuredOutput, Future[LLMatcher]] = OrderedDict()
        self.num_compiled = 0

    def compile(self, structured: StructuredOutput) -> Future[LLMatcher]:
        """The compiled grammar's future: done at once when it is cached."""
        future = self._cache.get(structured)
        if future is None or (future.done() and future.exception() is not None):
            future = self._cache[structured] = self._pool.submit(self._build, structured)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(structured)
        return future

    def matcher(self, compiled: Future[LLMatcher]) -> RequestGrammar:
        """A request's own matcher of a compiled grammar (its future must be done)."""
        return RequestGrammar(compiled.result().deep_copy(), self.vocab_size, self.eos_token_ids)

    def _build(self, structured: StructuredOutput) -> LLMatcher:
        """The grammar compiled on the model's tokenizer; one that admits no output is refused here,
        where the vocabulary is known (the frontend's check has none), not served as an empty answer."""
        from llguidance import LLMatcher, LLTokenizer  # imported by the engines that serve a grammar

        if self._tokenizer is None:  # about 0.7 s for a 49k vocabulary: once, on this thread
            try:
                self._tokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                              eos_token=list(self.eos_token_ids))
            except TypeError:  # llguidance before 1.7 takes one end-of-sequence id
                self._tokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                              eos_token=self.eos_token_ids[0] if self.eos_token_ids else None)
        matcher = LLMatcher(self._tokenizer, structured.lark())
        if matcher.is_error():
            raise ValueError(f"structured.{structured.kind}: {matcher.get_error()}")
        matcher.compute_bitmask()  # the lexer's first states are built here, not in the first step
        if matcher.is_error():  # llguidance's NoExtensionBias: no token can begin an output
            raise InvalidSamplingParamsError(f"structured.{structured.kind}: the grammar admits no output (no token "
                                             "can begin it; e.g. a schema whose $ref refers only to itself)")
        self.num_compiled += 1
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
