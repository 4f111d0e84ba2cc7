"""The OpenAI wire shapes `speckernel serve` speaks, as msgspec Structs.

Request bodies are decoded straight into these types, so a field of the wrong type or out of
OpenAI's range is refused with a message naming it (`Expected int, got str - at $.max_tokens`)
before any work is done. Every field is served or refused: OpenAI's fields this server does not
serve are declared and refused in words when they would change the answer (`logit_bias`, tools,
image parts), and a key no request type has is refused too, unless the server was started with
`--ignore-unknown-fields` for clients that send extras.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from functools import cache
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect

from ...errors import InvalidInputError, InvalidSamplingParamsError
from ...sampling_params import SamplingParams, StructuredOutput
from .limits import check_json_depth
from .logprobs import ChatLogprobs, CompletionLogprobs

# --- requests -----------------------------------------------------------------------------------

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
"""OpenAI's ranges: a temperature of 5000 is a mistake, not a request for noise."""
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TokenCount = Annotated[int, msgspec.Meta(ge=1)]
Alternatives = Annotated[int, msgspec.Meta(ge=0, le=20)]
NoTools = "tools are not supported (no function calling)"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content. Only text is served: the other kinds OpenAI defines are
    declared so that a part holding one is refused by its type, not dropped (a text model would
    have seen an empty turn in its place)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    """OpenAI's roles; another (a typo, "wizard") is refused rather than rendered as a turn."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    """OpenAI's participant name: the chat template has no place for it, so it is refused."""
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    def check(self, where: str) -> None:
        """BadRequest for a part of the message this server would drop from the prompt."""
        if self.tool_calls:
            raise BadRequest(f"{where}.tool_calls: {NoTools}; a conversation may not hold tool calls",
                             f"{where}.tool_calls")
        for field in ("tool_call_id", "function_call"):
            if getattr(self, field) is not None:
                raise BadRequest(f"{where}.{field}: {NoTools}", f"{where}.{field}")
        if self.name is not None:
            raise BadRequest(f"{where}.name: participant names are not supported (the chat template has no "
                             "place for them)", f"{where}.name")
        if self.refusal is not None or self.audio is not None:
            field = "refusal" if self.refusal is not None else "audio"
            raise BadRequest(f"{where}.{field}: not supported; give the message's text as content",
                             f"{where}.{field}")
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                at = f"{where}.content[{j}]"
                if part.type != "text":
                    raise BadRequest(f"{at}.type: {part.type!r} content parts are not supported; this server "
                                     "takes text parts only", f"{at}.type")
                if part.text is None:
                    raise BadRequest(f"{at}.text: a text part needs its text", f"{at}.text")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = ""
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share; the sampling ones map onto SamplingParams."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = 0
    """Not in the OpenAI API; accepted as vLLM does."""
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """Not in the OpenAI API: generate max_tokens tokens whatever comes (benchmarks use it)."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's extras (guided_*): not in the OpenAI API."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """A Lark grammar."""
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: float = 1.0
    """Not in the OpenAI API; accepted as vLLM does."""
    user: str | None = None
    """OpenAI's end-user id, for the caller's own abuse tracking: it never changes an answer there
    either, so it is accepted."""
    logit_bias: dict[str, Any] | None = None
    """Refused unless empty: see `check`."""

    def check(self) -> None:
        """BadRequest for a field whose value this server would not honour (what the types and
        ranges already refuse aside)."""
        if self.logit_bias:
            raise BadRequest("logit_bias: not supported; a per-token bias is not applied by this server's "
                             "sampler or its speculative verification, so it is refused rather than ignored",
                             "logit_bias")

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """The output constraint the request names, and the field that names it."""
        given: list[tuple[StructuredOutput, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append((StructuredOutput(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise BadRequest("response_format: type json_schema needs json_schema.schema", "response_format")
            given.append((StructuredOutput.of_schema(json.dumps(fmt.json_schema.schema)), "response_format"))
        if self.guided_json is not None:
            given.append((StructuredOutput.of_schema(self.guided_json), "guided_json"))
        if self.guided_regex is not None:
            given.append((StructuredOutput(regex=self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            given.append((StructuredOutput(choice=tuple(self.guided_choice)), "guided_choice"))
        if self.guided_grammar is not None:
            given.append((StructuredOutput(grammar=self.guided_grammar), "guided_grammar"))
        if len(given) > 1:
            raise BadRequest(f"{', '.join(f for _, f in given)}: give one output constraint at most", given[1][1])
        return given[0] if given else (None, None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprobs_asked(self) -> tuple[int | None, str]:
        """The top alternatives per token the request asks for (None: no logprobs), and the
        field that says so."""
        return None, "logprobs"

    def sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int) -> SamplingParams:
        """Validated parameters; max_tokens defaults to the room left in the context."""
        if self.n != 1:
            raise BadRequest(f"n: only n=1 is supported, got {self.n}", "n")
        if prompt_len >= max_model_len:
            raise BadRequest(f"prompt has {prompt_len} tokens; the context holds {max_model_len} "
                             "(prompt plus at least one generated token)", "messages" if isinstance(
                                 self, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self.max_tokens if self.max_tokens is not None else max_model_len - prompt_len
        structured = self.structured()[0]
        logprobs, logprobs_field = self.logprobs_asked()
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                                structured=structured, frequency_penalty=self.frequency_penalty,
                                presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                                logprobs=logprobs)
        try:
            return params.validate(vocab_size)
        except InvalidSamplingParamsError as e:
            if str(e).startswith("logprobs:") and logprobs_field != "logprobs":
                raise BadRequest(logprobs_field + str(e).removeprefix("logprobs"), logprobs_field) from None
            raise self.named(e) from None

    def named(self, error: InvalidSamplingParamsError) -> InvalidInputError:
        """A grammar's error (one that does not compile here, or that the core found admits no
        output) naming the request field that sent the grammar; any other error as it is."""
        source = self.structured()[1]
        if source is None or not str(error).startswith("structured"):
            return error
        return BadRequest(f"{source}: {error}", source)


R = TypeVar("R", bound=_Common)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    """The newer name of max_tokens; either may be given."""
    logprobs: bool | None = None
    """Each output token's logprob (and top_logprobs alternatives) in choices[].logprobs.content."""
    top_logprobs: Alternatives | None = None
    tools: Any = None
    """Tool calling is not served: a request that brings tools (or the older functions) is a 400
    naming the field, never a reply that silently ignored them."""
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    def check(self) -> None:
        super().check()
        for field in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"):
            if getattr(self, field) is not None:
                raise BadRequest(f"{field}: {NoTools}", field)
        if not self.messages:
            raise BadRequest("messages: expected at least one message", "messages")
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")

    def logprobs_asked(self) -> tuple[int | None, str]:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        if not self.logprobs:
            return None, "logprobs"
        return (0, "logprobs") if self.top_logprobs is None else (self.top_logprobs, "top_logprobs")

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]
    """Text, or token ids as the OpenAI API allows."""
    logprobs: int | None = None
    """Top alternatives per output token (0: the chosen token's logprob alone), in choices[].logprobs."""
    suffix: str | None = None
    """Insertion (text after the completion) is not served: refused, not ignored."""
    echo: bool | None = None
    """Only false: the answer never repeats the prompt."""
    best_of: int | None = None
    """Only 1 (or n, which is 1): one candidate is generated, and it is the answer."""

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise BadRequest("suffix: insertion (text after the completion) is not supported", "suffix")
        if self.echo:
            raise BadRequest("echo: echoing the prompt back is not supported; send echo: false or leave it out",
                             "echo")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise BadRequest(f"best_of: only best_of=1 is supported (one candidate per answer), got {self.best_of}",
                             "best_of")

    def logprobs_asked(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"


# --- responses ----------------------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str = ""


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    object: Literal["chat.completion"] = "chat.completion"


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    model: str
    created: int
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class Completion(msgspec.Struct, kw_only=True):
    id: str
    model: str
    created: int
    choices: list[TextChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "speckernel"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- errors -------------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


class BadRequest(InvalidInputError):
    """Bad input with the request field it is about (the `param` of the error JSON)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFound(BadRequest):
    """A model this server does not serve: 404, as OpenAI answers."""


_AT = re.compile(r" - at `\$\.?([^`]*)`")
_FIELD = re.compile(r"^(\w+): ")


def param_of(message: str) -> str | None:
    """The field a msgspec or SamplingParams message names: `... - at $.max_tokens` or `top_p: ...`."""
    at = _AT.search(message)
    if at is not None:
        return at.group(1) or None
    field = _FIELD.match(message)
    return field.group(1) if field else None


UNKNOWN_HINT = "start the server with --ignore-unknown-fields to have fields it does not know ignored"


def decode(body: bytes, kind: type[R], *, max_depth: int, ignore_unknown: bool = False) -> R:
    """A request body as its Struct, or BadRequest naming the field that is off: a wrong type or
    range, a key no field has (unless ignore_unknown), a value this server would not honour.
    max_depth: the deepest nesting taken, checked before decoding (a decoder recursing into a
    body nested thousands deep would fail with RecursionError, a 500)."""
    check_json_depth(body, max_depth)
    try:
        req = msgspec.json.decode(body, type=kind)
        unknown = None if ignore_unknown else unknown_field(msgspec.json.decode(body), kind)
    except msgspec.ValidationError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # within max_depth this is not reached; a 400 all the same if it is
        raise BadRequest("request body is nested too deeply") from None
    if unknown is not None:
        raise BadRequest(f"{unknown}: unknown field; this server does not serve it ({UNKNOWN_HINT})", unknown)
    req.check()
    return req


def unknown_field(value: Any, kind: Any) -> str | None:
    """The path of the first key in a decoded body that its request type has no field for."""
    return _unknown(value, _type_info(kind), "")


@cache
def _type_info(kind: Any) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(kind)


def _unknown(value: Any, info: msgspec.inspect.Type, path: str) -> str | None:
    if isinstance(info, msgspec.inspect.UnionType):  # the member the value decoded as: its JSON kind says
        want = msgspec.inspect.StructType if isinstance(value, dict) else msgspec.inspect.ListType
        info = next((t for t in info.types if isinstance(t, want)), info)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in fields:
                return where
            found = _unknown(item, fields[key], where)
            if found is not None:
                return found
    elif (isinstance(info, msgspec.inspect.ListType) and isinstance(value, list)
          and _holds_struct(info.item_type)):  # a list of token ids is not walked id by id
        for i, item in enumerate(value):
            found = _unknown(item, info.item_type, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _holds_struct(info: msgspec.inspect.Type) -> bool:
    if isinstance(info, msgspec.inspect.UnionType):
        return any(_holds_struct(t) for t in info.types)
    return isinstance(info, msgspec.inspect.StructType | msgspec.inspect.ListType)
