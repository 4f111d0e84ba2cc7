"""The official `openai` client against `speckernel serve` on the real default model: streaming
and non-streaming chat give, greedy, exactly what `speckernel generate` gives for the same
prompt, with a speculator (ngram) and without."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tools.test_serve import Served, serve_many

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

REAL = ["--platform", "cpu", "--max-model-len", "512"]

PROMPT = "Name three rivers."
MAX_TOKENS = 24


def test_openai_client_greedy_equals_generate() -> None:
    # `speckernel generate` runs while the two servers start.
    generate = subprocess.Popen([sys.executable, "-m", "speckernel", "generate", "--prompt", PROMPT, "--json",
                                 "--temperature", "0", "--max-tokens", str(MAX_TOKENS), *REAL],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with serve_many(REAL, [*REAL, "--speculator", "ngram", "--num-speculative-tokens", "3"]) as (plain, ngram):
        stdout, stderr = generate.communicate(timeout=300)
        assert generate.returncode == 0, stderr
        generated = json.loads(stdout)
        check(plain, generated)
        check(ngram, generated)
        assert ngram.metric("speckernel_spec_drafts_total") > 0
        assert plain.metric("speckernel_spec_drafts_total") == 0


def check(served: Served, generated: dict[str, object]) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == generated["text"]
    assert whole.choices[0].finish_reason == generated["finish_reason"]
    assert whole.usage.completion_tokens == len(generated["token_ids"])  # type: ignore[arg-type]
    assert whole.usage.prompt_tokens == len(generated["prompt_token_ids"])  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == generated["text"]
    assert chunks[-1].choices[0].finish_reason == generated["finish_reason"]
