"""The official `openai` client against `speckernel serve` on the real default model: streaming
and non-streaming chat give, greedy, exactly what `speckernel generate` gives for the same
prompt, with a speculator (ngram) and without, with sampling penalties and without."""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator

import pytest

from speckernel.tools import cli
from tests.tools.test_serve import Served, serve_many

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker starts the module's servers

REAL = ["--platform", "cpu", "--max-model-len", "512"]
NGRAM = [*REAL, "--speculator", "ngram", "--num-speculative-tokens", "3"]

PROMPT = "Name three rivers."
MAX_TOKENS = 24


PENALTIES = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}
"""OpenAI's two, and vLLM's repetition_penalty (an extra body field for the client)."""


def generate(*flags: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    """What `speckernel generate --json` prints, greedy. It runs in this process, engine core
    included: a fresh process would import torch again (seconds) for the same tokens."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["generate", "--prompt", prompt, "--json", "--temperature", "0", "--max-tokens",
                         str(max_tokens), *REAL, "--in-process", *flags])
    assert code == 0, out.getvalue()
    return dict(json.loads(out.getvalue()))


@pytest.fixture(scope="module")
def servers() -> Iterator[list[Served]]:
    """A plain server and an ngram one, started once for the module's tests (they only send
    requests, and every request is greedy: no test's requests change another's answers)."""
    with serve_many(REAL, NGRAM) as started:
        yield started


def test_openai_client_greedy_equals_generate(servers: list[Served]) -> None:
    plain, ngram = servers
    generated = generate()
    penalized = generate(*(f"--{name.replace('_', '-')}={value}" for name, value in PENALTIES.items()))
    assert penalized["token_ids"] != generated["token_ids"], "the penalties changed nothing: no test"
    drafts = ngram.metric("speckernel_spec_drafts_total")  # the shared server may have drafted for another test
    for served in (plain, ngram):
        check(served, generated)
        check(served, penalized, PENALTIES)
    assert ngram.metric("speckernel_spec_drafts_total") > drafts
    assert plain.metric("speckernel_spec_drafts_total") == 0


def check(served: Served, generated: dict[str, object], penalties: dict[str, float] | None = None) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    extra = {} if penalties is None else {"frequency_penalty": penalties["frequency_penalty"],
                                          "presence_penalty": penalties["presence_penalty"],
                                          "extra_body": {"repetition_penalty": penalties["repetition_penalty"]}}
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           **extra)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == generated["text"]
    assert whole.choices[0].finish_reason == generated["finish_reason"]
    assert whole.usage.completion_tokens == len(generated["token_ids"])  # type: ignore[arg-type]
    assert whole.usage.prompt_tokens == len(generated["prompt_token_ids"])  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, **extra))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == generated["text"]
    assert chunks[-1].choices[0].finish_reason == generated["finish_reason"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_through_the_openai_client(servers: list[Served]) -> None:
    client = openai.OpenAI(base_url=f"{servers[1].url}/v1", api_key="unused")  # the ngram server
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Describe a person named Bob, aged 42, as JSON."}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    person = json.loads(reply.choices[0].message.content or "")
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert reply.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=model, prompt="The capital of Italy is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["Rome", "Milan"]})
    assert choice.choices[0].text in ("Rome", "Milan")
    for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                           response_format=bad)  # type: ignore[arg-type]
        assert refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    text = generate("--regex", "[0-9]{3} BC", prompt="When was Rome founded?", max_tokens=16)["text"]
    assert re.fullmatch("[0-9]{3} BC", str(text)), text
