"""The OpenAI wire shapes `speckernel serve` speaks, as msgspec Structs.

Request bodies are decoded straight into these types, so a field of the wrong type is refused
with a message naming it (`Expected int, got str - at $.max_tokens`) before any work is done.
Unknown fields are ignored, as OpenAI clients send options this server does not implement.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

import msgspec

from ...errors import InvalidInputError, InvalidSamplingParamsError
from ...sampling_params import SamplingParams, StructuredOutput
from .logprobs import ChatLogprobs, CompletionLogprobs

# --- requests -----------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    """OpenAI's roles; another (a typo, "wizard") is refused rather than rendered as a turn."""
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
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
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Not in the OpenAI API; accepted as vLLM does."""

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
        structured, source = self.structured()
        logprobs, logprobs_field = self.logprobs_asked()
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                                structured=structured, frequency_penalty=self.frequency_penalty,
                                presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                                logprobs=logprobs)
        try:
            return params.validate(vocab_size)
        except InvalidSamplingParamsError as e:
            if str(e).startswith("structured"):  # a grammar that does not compile: name the field that sent it
                raise BadRequest(f"{source}: {e}", source) from None
            if str(e).startswith("logprobs:") and logprobs_field != "logprobs":
                raise BadRequest(logprobs_field + str(e).removeprefix("logprobs"), logprobs_field) from None
            raise


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """The newer name of max_tokens; either may be given."""
    logprobs: bool | None = None
    """Each output token's logprob (and top_logprobs alternatives) in choices[].logprobs.content."""
    top_logprobs: int | None = None
    tools: None = None
    """Tool calling is not served: a request that brings tools (or the older functions) is a 400
    naming the field, never a reply that silently ignored them."""
    tool_choice: None = None
    functions: None = None
    function_call: None = None

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
    suffix: None = None
    """Insertion (text after the completion) is not served: refused, not ignored."""

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


def decode(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """A request body as its Struct, or BadRequest naming the field that is off."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
