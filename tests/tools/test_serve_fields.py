"""Every request field `speckernel serve` takes is honoured or refused, never silently dropped: a
field it does not serve (logit_bias, echo, best_of, tools, image and audio parts, tool calls in
the history) and a key it does not know are 400 naming the field, values outside OpenAI's ranges
too, and their no-op values are served; `--ignore-unknown-fields` lets clients that send extras
through. A body nested a thousand deep is 400, not a 500 RecursionError, and a JSON schema that
admits no output (its `$ref` refers only to itself) is 400, not an empty answer. Real server
processes on 127.0.0.1 (the tiny random model; the real one where a grammar needs its tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tools.test_serve import TINY, Served, post, serve, serve_many

httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

CHAT = {"messages": [{"role": "user", "content": "<7><8><9>"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
NO_TOOLS = "tools are not supported"
UNKNOWN = "unknown field"
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[Served]]:
    """Two tiny servers started together: the default one, and one that ignores unknown keys."""
    with serve_many(TINY, [*TINY, "--ignore-unknown-fields"]) as started:
        yield started


@pytest.fixture
def strict(servers: list[Served]) -> Served:
    return servers[0]


@pytest.fixture
def lenient(servers: list[Served]) -> Served:
    return servers[1]


def send(served: Served, endpoint: str, body: object) -> httpx.Response:
    return post(served, "/v1/completions" if endpoint == "completions" else "/v1/chat/completions", body, key=None)


def refused(r: httpx.Response, param: str, words: str) -> None:
    """A 400 in OpenAI's error shape naming the field, its message saying why in words."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert words in error["message"], error


def output(r: httpx.Response, endpoint: str) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["text"] if endpoint == "completions" else choice["message"]["content"])


def user(content: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}]}


REFUSED = [  # (endpoint, body overrides, the param the error names, words its message holds)
    # Fields that would change the answer and are not served.
    ("chat", {"logit_bias": {"50": 100}}, "logit_bias", "not supported"),
    ("completions", {"logit_bias": {"7": -100}}, "logit_bias", "not supported"),
    ("completions", {"echo": True}, "echo", "not supported"),
    ("completions", {"best_of": 3}, "best_of", "best_of=1"),
    ("chat", user([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]),
     "messages[0].content[0].type", "'image_url' content parts are not supported"),
    ("chat", user([{"type": "text", "text": "what is this?"},
                   {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]),
     "messages[0].content[1].type", "'input_audio' content parts are not supported"),
    ("chat", {"messages": [{"role": "user", "content": "<1>"},
                           {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                           {"role": "user", "content": "<2>"}]}, "messages[1].tool_calls", NO_TOOLS),
    ("chat", {"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]},
     "messages[0].tool_call_id", NO_TOOLS),
    ("chat", {"messages": [{"role": "user", "name": "bob", "content": "<1>"}]}, "messages[0].name", "not supported"),
    ("chat", {"tools": []}, "tools", NO_TOOLS),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", NO_TOOLS),
    ("chat", {"tool_choice": "none"}, "tool_choice", NO_TOOLS),
    ("chat", {"functions": [{"name": "f"}]}, "functions", NO_TOOLS),
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls", NO_TOOLS),
    # Keys no request type has.
    ("chat", {"frobnicate": 1}, "frobnicate", UNKNOWN),
    ("chat", {"min_p": 0.1}, "min_p", UNKNOWN),
    ("completions", {"echo_prompt": True}, "echo_prompt", UNKNOWN),
    ("chat", {"messages": [{"role": "user", "content": "<1>", "weight": 2}]}, "messages[0].weight", UNKNOWN),
    ("chat", user([{"type": "text", "text": "<1>", "cache_control": {"type": "ephemeral"}}]),
     "messages[0].content[0].cache_control", UNKNOWN),
    ("chat", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", UNKNOWN),
    # OpenAI's ranges.
    ("chat", {"temperature": 5000}, "temperature", "2.0"),
    ("completions", {"temperature": 2.5}, "temperature", "2.0"),
    ("chat", {"top_p": 0}, "top_p", "0.0"),
    ("chat", {"top_p": 1.01}, "top_p", "1.0"),
    ("chat", {"presence_penalty": 2.01}, "presence_penalty", "2.0"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty", "-2.0"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "1"),
]


@pytest.mark.parametrize(("endpoint", "override", "param", "words"), REFUSED)
def test_a_field_that_is_not_served_is_refused_naming_it(strict: Served, endpoint: str, override: dict[str, object],
                                                         param: str, words: str) -> None:
    body = (CHAT if endpoint == "chat" else COMPLETION) | override
    refused(send(strict, endpoint, body), param, words)
    # ... and the server keeps serving.
    assert send(strict, "completions", COMPLETION).status_code == 200


NO_OPS = [  # values of those fields that change nothing: served, with the same answer
    ("chat", {"logit_bias": {}, "user": "user-1234", "tools": None, "tool_choice": None}),
    ("chat", user([{"type": "text", "text": "<7><8>"}, {"type": "text", "text": "<9>"}])),
    ("chat", {"messages": [{"role": "user", "content": "<7><8><9>", "tool_calls": [], "name": None}]}),
    ("completions", {"echo": False, "best_of": 1, "logit_bias": None, "suffix": None}),
    ("completions", {"temperature": 0.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
]


@pytest.mark.parametrize(("endpoint", "override"), NO_OPS)
def test_the_no_op_values_of_those_fields_are_served_unchanged(strict: Served, endpoint: str,
                                                               override: dict[str, object]) -> None:
    plain = CHAT if endpoint == "chat" else COMPLETION
    assert output(send(strict, endpoint, plain | override), endpoint) == output(send(strict, endpoint, plain), endpoint)


def test_the_bounds_of_openais_ranges_are_served(strict: Served) -> None:
    for override in ({"temperature": 2}, {"top_p": 1e-9}, {"presence_penalty": -2, "frequency_penalty": 2}):
        r = send(strict, "chat", CHAT | override | {"seed": 1})
        assert r.status_code == 200, (override, r.text)


def test_ignore_unknown_fields_serves_extras_but_still_refuses_what_it_does_not_serve(lenient: Served) -> None:
    extras = {"min_p": 0.1, "metadata": {"team": "a"}, "stream_options": {"include_usage": True, "x": 1},
              "messages": [{"role": "user", "content": "<7><8><9>", "weight": 2}]}
    assert output(send(lenient, "chat", CHAT | extras), "chat") == output(send(lenient, "chat", CHAT), "chat")
    assert output(send(lenient, "completions", COMPLETION | {"skip_special_tokens": False}), "completions") == \
        output(send(lenient, "completions", COMPLETION), "completions")
    refused(send(lenient, "chat", CHAT | {"logit_bias": {"50": 100}}), "logit_bias", "not supported")
    refused(send(lenient, "chat", CHAT | {"tools": []}), "tools", NO_TOOLS)
    refused(send(lenient, "completions", COMPLETION | {"echo": True}), "echo", "not supported")
    refused(send(lenient, "chat", CHAT | {"temperature": 5000}), "temperature", "2.0")


@pytest.mark.parametrize("depth", [200, 1000, 200_000])
def test_a_body_nested_too_deep_is_400_not_500(servers: list[Served], depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    for served in servers:  # the depth is checked before unknown keys are looked at (or ignored)
        for field in (b"guided_json", b"frobnicate"):
            body = b'{"messages": [{"role": "user", "content": "<1>"}], "' + field + b'": ' + deep + b"}"
            r = post(served, "/v1/chat/completions", body, key=None)
            assert r.status_code == 400, r.text
            assert "deep" in r.json()["error"]["message"]
        r = post(served, "/v1/completions", b'{"prompt": ' + b'[' * depth + b"1" + b"]" * depth + b"}", key=None)
        assert r.status_code == 400 and "deep" in r.json()["error"]["message"], r.text
    # Brackets inside strings are text, not nesting: served.
    assert send(servers[0], "completions", {"prompt": "[" * 5000, "max_tokens": 2}).status_code == 200


SELF_REFERENCE = [{"$ref": "#"},
                  {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}]


@pytest.fixture(scope="module")
def real() -> Iterator[Served]:
    """The real default model: a grammar is compiled on its tokenizer (the tiny model has no EOS)."""
    with serve("--platform", "cpu", "--max-model-len", "256") as served:
        yield served


@pytest.mark.slow
@pytest.mark.parametrize("schema", SELF_REFERENCE)
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_admits_no_output_is_400_not_an_empty_answer(real: Served, schema: dict[str, object],
                                                                   stream: bool) -> None:
    asks = {"messages": [{"role": "user", "content": "Describe Bob as JSON."}], "max_tokens": 8, "stream": stream}
    r = send(real, "chat", asks | {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "loop", "schema": schema}}})
    refused(r, "response_format", "admits no output")
    refused(send(real, "chat", asks | {"guided_json": schema}), "guided_json", "admits no output")


@pytest.mark.slow
def test_a_schema_that_refers_to_itself_with_a_way_out_is_served(real: Served) -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
            "required": ["kids"], "additionalProperties": False}
    r = send(real, "chat", {"messages": [{"role": "user", "content": "A tree as JSON."}], "max_tokens": 16,
                            "temperature": 0, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "t", "schema": tree}}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{"), r.text  # whitespace may run long
