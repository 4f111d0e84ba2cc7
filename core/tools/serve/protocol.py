"""The OpenAI wire shapes `speckernel serve` speaks, as msgspec Structs.

Request bodies are decoded straight into these types, so a field of the wrong type is refused
with a message naming it (`Expected int, got str - at $.max_tokens`) before any work is done.
Unknown fields are ignored, as OpenAI clients send options this server does not implement.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Literal

import msgspec

from ...errors import InvalidInputError
from ...sampling_params import SamplingParams

# --- requests -----------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Not in the OpenAI API; accepted as vLLM does."""

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                                frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                                repetition_penalty=self.repetition_penalty)
        return params.validate(vocab_size)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """The newer name of max_tokens; either may be given."""

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]
    """Text, or token ids as the OpenAI API allows."""


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
    logprobs: None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


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
