"""Per-request sampling parameters, validated once when the request enters the engine.

The field types carry msgspec `Meta` bounds, and `validate()` re-checks every value under
msgspec's strict rules (a bool is not an int, a float is not an int, a str is not a number),
so whatever passes also encodes to the core and decodes there: a value the core could not
decode would leave the caller waiting on a request the core dropped.
"""

from __future__ import annotations

import json
import typing
from functools import cache, lru_cache
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect
import numpy as np

from .errors import InvalidInputError, InvalidSamplingParamsError

MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MIN_TEMPERATURE = 1e-5
"""Temperatures in (0, MIN_TEMPERATURE) sample greedily: dividing logits by less overflows."""
MAX_TEMPERATURE = 1e6
"""Bounds the temperature to a finite float32 (an inf would turn logits into NaN)."""

Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
NonNegative32 = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
"""Seeds travel as int64 on the device."""
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=0.01, le=100.0)]
"""1 is off. Bounded so that logits divided or multiplied by it stay finite float32 numbers."""
AdditivePenalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
"""OpenAI's range for frequency_penalty and presence_penalty; 0 is off."""
StopString = Annotated[str, msgspec.Meta(min_length=1)]
MAX_LOGPROBS = 20
"""OpenAI's bound on top_logprobs: the most alternatives one output token reports."""
LogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
NO_PIPELINE_LOGPROBS = ("logprobs: not available with pipeline_parallel_size > 1 (the last stage sends the "
                        "engine its tokens alone)")

S = TypeVar("S", bound=msgspec.Struct)


def plain(value: Any) -> Any:
    """numpy scalars as the Python int/float/bool they hold (inside lists and tuples too): the
    caller's np.int64 seed is a seed, not a type error."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


def describe(info: msgspec.inspect.Type) -> str:
    """What a msgspec type accepts, in words: 'an integer in [1, 2147483647]'."""
    match info:
        case msgspec.inspect.IntType() | msgspec.inspect.FloatType():
            kind = "an integer" if isinstance(info, msgspec.inspect.IntType) else "a number"
            lo = f"[{info.ge}" if info.ge is not None else f"({info.gt}" if info.gt is not None else "(-inf"
            hi = f"{info.le}]" if info.le is not None else f"{info.lt})" if info.lt is not None else "inf)"
            return kind if lo == "(-inf" and hi == "inf)" else f"{kind} in {lo}, {hi}"
        case msgspec.inspect.BoolType():
            return "True or False"
        case msgspec.inspect.NoneType():
            return "None"
        case msgspec.inspect.StrType():
            if info.pattern:
                return f"a string matching {info.pattern}"
            return "a non-empty string" if info.min_length else "a string"
        case msgspec.inspect.UnionType():
            return " or ".join(describe(t) for t in info.types)
        case msgspec.inspect.VarTupleType() | msgspec.inspect.ListType():
            return f"a sequence, each item {describe(info.item_type)}"
        case msgspec.inspect.DictType():
            return f"a mapping of {describe(info.key_type)} to {describe(info.value_type)}"
        case msgspec.inspect.LiteralType():
            return "one of " + ", ".join(repr(v) for v in info.values)
    return type(info).__name__


@cache
def _field_types(cls: type) -> dict[str, Any]:
    """A Struct's resolved field types (resolving them compiles every annotation: once a class)."""
    return typing.get_type_hints(cls, include_extras=True)


def strict_fields(obj: S, error: type[InvalidInputError]) -> S:
    """obj with every field converted by msgspec under strict rules and its `Meta` bounds, or
    `error` naming the field, what it accepts and what it got."""
    hints = _field_types(type(obj))
    values: dict[str, Any] = {}
    for name in obj.__struct_fields__:
        value = plain(getattr(obj, name))
        try:
            values[name] = msgspec.convert(value, hints[name], strict=True)
        except msgspec.ValidationError as e:
            where = str(e).partition(" - at `$")[2].rstrip("`")
            where = f" (at {name}{where})" if where else ""
            accepted = describe(msgspec.inspect.type_info(hints[name]))
            raise error(f"{name}: expected {accepted}, got {value!r}{where}") from None
    return msgspec.structs.replace(obj, **values)


def check_text(text: str, where: str, error: type[InvalidInputError] = InvalidInputError, item: str = "") -> None:
    """`error` naming the field `where` (and the `item` of it) for a str that is no Unicode text (a
    lone surrogate, e.g. from surrogateescape): it could not be encoded to the core, nor matched
    against decoded output."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(f"{where}: not valid Unicode text (a lone surrogate at character {e.start}"
                    f"{f' of {item}' if item else ''}: {text[e.start]!r})") from None


# --- Structured output -----------------------------------------------------------------------------------
# What a request's output must match: a JSON schema, any JSON object, a regex, a Lark grammar or
# one of a list of strings, as one llguidance grammar.
#
# llguidance (not xgrammar) because its one abi3 wheel serves every CPython from 3.9 with no
# dependencies and imports without torch in 0.2 s, so the torch-free frontend checks a grammar
# itself and a bad one fails the request before it is sent (the server's 400); it also builds a
# grammar lazily (about 1 ms for a JSON schema on the built-in model's 49k-token vocabulary, where
# xgrammar took 20 ms), and its masks (about 30 us a token) cost well under 1% of a CPU decode step.

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """Exactly one of the fields: the constraint the output is decoded under."""

    json_schema: str | None = None
    """A JSON schema, as JSON text."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""
    regex: str | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect: EBNF-like rules, /regex/ terminals, %json)."""
    choice: tuple[str, ...] | None = None
    """The output is one of these strings exactly."""

    @classmethod
    def of_schema(cls, schema: str | dict[str, Any]) -> StructuredOutput:
        return cls(json_schema=schema if isinstance(schema, str) else json.dumps(schema))

    @property
    def kind(self) -> str:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                f"structured: expected exactly one of {', '.join(KINDS)}, got {given or 'none'}")
        return given[0]

    def lark(self) -> str:
        """The grammar as llguidance's grammar text (a Lark grammar or its JSON form)."""
        from llguidance import LLMatcher  # llguidance is imported only by requests that carry a grammar

        match self.kind:
            case "json_schema":
                assert self.json_schema is not None
                try:
                    json.loads(self.json_schema)
                except ValueError as e:
                    raise InvalidSamplingParamsError(f"structured.json_schema: not valid JSON ({e})") from None
                return LLMatcher.grammar_from_json_schema(self.json_schema)
            case "json_object":
                return LLMatcher.grammar_from_json_schema('{"type": "object"}')
            case "regex":
                assert self.regex is not None
                return LLMatcher.grammar_from_regex(self.regex)
            case "grammar":
                assert self.grammar is not None
                return LLMatcher.grammar_from_lark(self.grammar)
        assert self.choice is not None
        if not self.choice:
            raise InvalidSamplingParamsError("structured.choice: expected at least one string")
        literals = (json.dumps(c, ensure_ascii=False) for c in self.choice)  # Lark strings escape as JSON's
        return LLMatcher.grammar_from_lark("start: " + " | ".join(literals))

    def check(self) -> StructuredOutput:
        """self, or InvalidSamplingParamsError with the compiler's message for a grammar that
        does not compile (checked without a tokenizer; cached, as a server sees one schema often)."""
        error = _grammar_error(self)
        if error:
            raise InvalidSamplingParamsError(f"structured.{self.kind}: {error.strip()}")
        return self


@lru_cache(maxsize=256)
def _grammar_error(structured: StructuredOutput) -> str:
    from llguidance import LLMatcher  # see lark()

    try:
        return LLMatcher.validate_grammar(structured.lark())
    except InvalidSamplingParamsError:
        raise
    except (ValueError, RuntimeError) as e:  # grammar_from_* raise on some malformed input
        return str(e)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    max_tokens: Count = 128
    temperature: Temperature = 1.0
    """0 is greedy; values in (0, 1e-5) count as 0 (validate() turns them into 0)."""
    top_k: NonNegative32 = 0
    """0 keeps every token."""
    top_p: TopP = 1.0
    seed: Seed | None = None
    """Fixes the random stream of this request alone: same seed, same tokens, whatever the batch.
    None: the engine draws a fresh seed for the request."""
    stop: tuple[StopString, ...] = ()
    stop_token_ids: tuple[NonNegative32, ...] = ()
    ignore_eos: bool = False
    structured_output: bool = False
    """Forces draft IDs to the host (the grammar validates them) and keeps the request from running
    ahead; validate() sets it for a request with `structured`."""
    structured: StructuredOutput | None = None
    """The grammar the output must match (a JSON schema, a regex, a Lark grammar, a choice)."""
    repetition_penalty: RepetitionPenalty = 1.0
    """vLLM's (after CTRL): the logit of every token already in the prompt or the output is divided
    by it when positive, multiplied by it when not. > 1 discourages repeats."""
    frequency_penalty: AdditivePenalty = 0.0
    """OpenAI's: subtracted from a token's logit once per time it occurs in the output so far."""
    presence_penalty: AdditivePenalty = 0.0
    """OpenAI's: subtracted from a token's logit once if it occurs in the output so far."""
    logprobs: LogprobCount | None = None
    """None: no logprobs. N: each output token carries its log-probability and the N most likely
    tokens with theirs (0: the chosen token's alone). They are the model's raw log-probabilities
    (log_softmax of the logits, before penalties, temperature, top-k/top-p and grammar), as vLLM
    reports by default: the same whatever the sampling, and what a speculative step's
    verification computes at each position, so speculation never changes them."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the sampler counts this request's tokens (rows without any keep
        the plain path)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """The same parameters with exact Python types (numpy scalars become int/float, a list
        of stop strings a tuple), stop token ids inside the vocabulary and a temperature below
        MIN_TEMPERATURE set to 0, or InvalidSamplingParamsError naming the field."""
        if isinstance(self.stop, str):  # a str is a sequence of one-letter strings: almost surely a slip
            raise InvalidSamplingParamsError(f"stop: expected a sequence of non-empty strings, got {self.stop!r}")
        params = strict_fields(self, InvalidSamplingParamsError)
        for i, stop in enumerate(params.stop):
            check_text(stop, "stop", InvalidSamplingParamsError, f"stop[{i}]")
        if vocab_size is not None:
            outside = [t for t in params.stop_token_ids if t >= vocab_size]
            if outside:
                raise InvalidSamplingParamsError(
                    f"stop_token_ids: expected token ids in [0, {vocab_size - 1}], got {outside[0]!r}")
        if params.structured is not None:
            params = msgspec.structs.replace(params, structured=params.structured.check(), structured_output=True)
        if 0.0 < params.temperature < MIN_TEMPERATURE:  # logits / 1e-45 overflow to inf: this close to 0 is greedy
            params = msgspec.structs.replace(params, temperature=0.0)
        return params


def prompt_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A caller's token-id prompt as a list of ints in [0, vocab_size), or InvalidInputError: a
    1.5 is not token 1, and an id past the vocabulary would index past the embedding."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise InvalidInputError(f"prompt: expected a 1-D array of integer token ids, got {prompt.dtype} "
                                    f"with shape {prompt.shape}")
        prompt = prompt.tolist()
    ids = Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]
    try:
        return msgspec.convert(plain(list(prompt) if isinstance(prompt, tuple | range) else prompt),
                               list[ids], strict=True)
    except msgspec.ValidationError as e:
        where = str(e).partition(" - at `$")[2].rstrip("`")
        raise InvalidInputError(f"prompt: expected a str or a sequence of token ids in [0, {vocab_size - 1}], got "
                                f"{prompt!r:.80}{f' (at prompt{where})' if where else ''}") from None


def sampling_params(params: object, vocab_size: int | None = None, *, pipeline: bool = False) -> SamplingParams:
    """The caller's parameters validated (None: the defaults), InvalidSamplingParamsError for
    anything else. The one check of a request's parameters, with its one text per mistake: the
    frontend calls it before a request is sent (some values cannot even travel), the engine core
    on every request it is handed (any sender). `pipeline`: the target is split into stages,
    whose frames carry no logprobs."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidSamplingParamsError(f"params: expected a SamplingParams or None, got {params!r:.80}")
    params = params.validate(vocab_size)
    if pipeline and params.logprobs is not None:
        raise InvalidSamplingParamsError(NO_PIPELINE_LOGPROBS)
    return params


class RowSampling(msgspec.Struct, frozen=True, array_like=True):
    """One row's sampling in one step: a request's SamplingParams with its seed drawn and the
    output position fixed (the kernel plans it, the runner and speculators read it)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int
    """Index of the output token this row samples; with the seed it fixes the random draw."""
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int = -1
    """Top alternatives this row reports with each output token's logprob; -1: no logprobs."""

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
