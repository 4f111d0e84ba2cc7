"""Logprobs through `speckernel serve` on the real default model, read with the official `openai`
client: completions (`logprobs: N`) and chat (`logprobs: true`, `top_logprobs: N`) in OpenAI's
shapes, streamed and not, the same either way; bad values answer 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from tests.tools.test_serve import Served, post, serve_many

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures

REAL = ["--platform", "cpu", "--max-model-len", "512"]
PROMPT = "The capital of France is"
MAX_TOKENS = 12
TOP = 3


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_many(REAL) as (server,):
        yield server


def client(served: Served):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")


def test_completions_logprobs_streamed_and_not(served: Served) -> None:
    c = client(served)
    model = c.models.list().data[0].id
    args = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": TOP}
    whole = c.completions.create(**args)  # type: ignore[call-overload]
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert n > 0 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    if "\ufffd" not in whole.choices[0].text:
        assert "".join(lp.tokens) == whole.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= TOP
        assert max(top.values()) == pytest.approx(value, abs=1e-6) and top[token] == pytest.approx(value, abs=1e-6)
    chunks = list(c.completions.create(stream=True, **args))  # type: ignore[call-overload]
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs is not None]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    tops = [d for s in streamed for d in s.top_logprobs]
    assert len(tops) == n and all(d == pytest.approx(e) for d, e in zip(tops, lp.top_logprobs, strict=True))
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    plain = c.completions.create(**{**args, "logprobs": None})  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None and plain.choices[0].text == whole.choices[0].text


def test_chat_logprobs_streamed_and_not(served: Served) -> None:
    c = client(served)
    model = c.models.list().data[0].id
    args = {"model": model, "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": TOP}
    whole = c.chat.completions.create(**args)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 0
    assert b"".join(bytes(t.bytes) for t in content).decode() == whole.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == TOP
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].bytes) == (t.token, t.bytes)  # greedy: the top token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-5
    chunks = list(c.chat.completions.create(stream=True, **args))  # type: ignore[call-overload]
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs is not None
                for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-6)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        whole.choices[0].message.content
    only = c.chat.completions.create(**{**args, "top_logprobs": None})  # type: ignore[call-overload]
    assert [t.top_logprobs for t in only.choices[0].logprobs.content] == [[]] * len(content)
    assert [t.logprob for t in only.choices[0].logprobs.content] == pytest.approx([t.logprob for t in content])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
])
def test_bad_logprobs_answer_400_naming_the_field(served: Served, path: str, body: dict[str, object],
                                                  param: str) -> None:
    answer = post(served, path, {**body, "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and param in error["message"], error
