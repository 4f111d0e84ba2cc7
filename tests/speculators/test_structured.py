"""Structured output on the real default model: every output matches its JSON schema, regex,
choice or Lark grammar, without a speculator and with each speculator family (ngram; mtp, a
fixed-width learned drafter; dflash, a variable-width one), and greedy output with speculation
equals it without, token for token."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.request import Status
from speckernel.sampling_params import SamplingParams, StructuredOutput
from speckernel.wire.messages import AddRequest

KEYS = itertools.count(1)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ("Paris", "London", "Rome")
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
CASES = [
    ("Describe a person named Bob, aged 42, as a JSON object.", StructuredOutput.of_schema(SCHEMA)),
    ("When did the first humans land on the Moon? Give the date.", StructuredOutput(regex=DATE)),
    ("What is the capital of France?", StructuredOutput(choice=CHOICES)),
    ("What is 6 times 7?", StructuredOutput(grammar=LARK)),
    ('Reply with the JSON object {"ok": true} and nothing else.', StructuredOutput(json_object=True)),
]


def matches(text: str, structured: StructuredOutput) -> bool:
    if structured.json_schema is not None:
        value = json.loads(text)
        return set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 12 \
            and isinstance(value["age"], int)
    if structured.json_object:
        return isinstance(json.loads(text), dict)
    if structured.regex is not None:
        return re.fullmatch(structured.regex, text) is not None
    if structured.choice is not None:
        return text in structured.choice
    return re.fullmatch(r"The answer is [0-9]{1,3}\.", text) is not None


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q, _ in CASES]


def run(core: EngineCore, prompts: list[list[int]], cases: list[int] | None = None) -> list[list[int]]:
    """Every case (or those listed) in one batch, each request with its own grammar; outputs in order."""
    base = next(KEYS) * 100
    chosen = list(range(len(CASES))) if cases is None else cases
    prompts = [prompts[i] for i in chosen]
    outputs: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
    for i, (ids, (_, structured)) in enumerate(zip(prompts, [CASES[c] for c in chosen], strict=True)):
        params = SamplingParams(max_tokens=48, temperature=0, structured=structured)
        assert core.add_request(AddRequest(base + i, np.asarray(ids), params, f"s{i}")) is None
    while core.scheduler.requests or core.compiling:
        for delta in core.step():
            assert delta.error is None, delta.error
            outputs[delta.key].extend(delta.new_token_ids)
    return [outputs[base + i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_core(prompts) -> tuple[EngineCore, list[list[int]]]:  # type: ignore[no-untyped-def]
    """No speculator: what the grammars force is verified as drafts (the default)."""
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=512))
    return core, run(core, prompts)


@pytest.fixture(scope="module")
def plain(plain_core) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return plain_core[1]


def test_forced_tokens_are_free_drafts_and_change_nothing(prompts, plain_core) -> None:  # type: ignore[no-untyped-def]
    """The grammar's forced continuations ({"name": ", a closing brace) verified as drafts give
    the very tokens of decoding them one a step, in fewer steps, counted apart from a speculator's."""
    core, forced = plain_core
    one_a_step = EngineCore(EngineConfig(platform="cpu", max_model_len=512, grammar_drafts=False))
    assert forced == run(one_a_step, prompts)
    spec = core.stats()["spec"]
    assert spec["num_forced_drafts"] > 0 and spec["num_forced_accepted"] == spec["num_forced_drafts"], spec
    assert spec["num_draft_tokens"] == 0, "forced drafts counted as a speculator's"
    assert one_a_step.stats()["spec"]["num_forced_drafts"] == 0
    assert core.num_steps < one_a_step.num_steps


def test_every_output_matches_its_grammar(plain, tokenizer) -> None:  # type: ignore[no-untyped-def]
    texts = [tokenizer.decode(tokens) for tokens in plain]
    for text, (_, structured) in zip(texts, CASES, strict=True):
        assert matches(text, structured), (structured, texts)


@pytest.mark.parametrize("name", ["ngram", "mtp", "dflash"])
def test_speculative_structured_output_equals_plain(name: str, prompts, plain, tokenizer) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=512, speculator=name, num_speculative_tokens=3))
    got = run(core, prompts)
    for tokens, (_, structured) in zip(got, CASES, strict=True):
        assert matches(tokenizer.decode(tokens), structured), (name, structured, tokenizer.decode(tokens))
    assert got == plain
    spec = core.stats()["spec"]
    assert spec["num_draft_tokens"] > 0, "no draft was verified: the test proves nothing"
    assert spec["num_host_draft_copies"] > 0  # structured rows take the drafts to the host, fixed width too
    assert spec["num_forced_drafts"] > 0  # ahead of the speculator's drafts
    # Greedy, a forced token is the only one the target may take there: never rejected, which also
    # says they stand ahead of the speculator's (one behind a rejected draft would be dropped).
    assert spec["num_forced_accepted"] == spec["num_forced_drafts"], spec


def test_a_request_aborted_while_its_grammar_compiles_never_runs(core) -> None:  # type: ignore[no-untyped-def]
    key = next(KEYS) * 100
    params = SamplingParams(max_tokens=8, temperature=0, structured=StructuredOutput(regex=DATE))
    assert core.add_request(AddRequest(key, np.asarray([1, 2, 3]), params, "compiling")) is None
    ((req, _),) = [entry for entry in core.compiling if entry[0].key == key]
    core.abort([key])
    assert core.admit_compiled(wait=True) == []
    assert key not in core.scheduler.requests and not core.compiling
    assert (req.status, req.finish_reason, req.grammar) == (Status.FINISHED, "abort", None)


def test_structured_output_in_batch_invariant_mode_equals_plain(prompts, plain, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Batch-invariant kernels with a speculator: the same tokens under a regex and a choice."""
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=512, batch_invariant=True, speculator="mtp",
                                   num_speculative_tokens=3))
    assert run(core, prompts, cases=[1, 2]) == [plain[1], plain[2]]
    assert core.stats()["spec"]["num_draft_tokens"] > 0
