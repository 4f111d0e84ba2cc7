"""Logprobs in OpenAI's two shapes: the completions API's parallel lists and the chat API's
list of tokens, each with its bytes and alternatives.

The numbers are the engine's (`SamplingParams.logprobs`): the model's raw log-probabilities,
before penalties, temperature, top-k/top-p and grammar. A token's text is its bytes decoded on
their own, so a token that holds part of a character shows U+FFFD there; `bytes` is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ...models.tokenizer import Tokenizer
from ...outputs import TokenLogprobs


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]
    """Where each token's text begins in the completion's text (its tokens' texts laid end to end)."""


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None = None


def _text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def completion_logprobs(tokenizer: Tokenizer, ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        offset: int = 0) -> CompletionLogprobs:
    """The completions shape of tokens `ids`, whose texts begin `offset` characters into the text."""
    tokens, offsets = [], []
    for token_id in ids:
        text, _ = _text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{_text(tokenizer, t)[0]: v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)} for lp in logprobs]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], top_logprobs=top,
                              text_offset=offsets)


def chat_logprobs(tokenizer: Tokenizer, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> ChatLogprobs:
    """The chat shape of tokens `ids`."""
    content = []
    for token_id, lp in zip(ids, logprobs, strict=True):
        text, raw = _text(tokenizer, token_id)
        top = []
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            alt, alt_raw = _text(tokenizer, t)
            top.append(ChatTopLogprob(token=alt, logprob=v, bytes=list(alt_raw)))
        content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)
