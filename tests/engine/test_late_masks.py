"""Structured-output rows run ahead of their frame in flight (`EngineConfig.late_masks`), on the
real default model through the core's own loop (async scheduling, two frames in flight): the step
of a constrained row is launched before the token its mask depends on is known, and the mask is
delivered after that frame is applied. The output equals the engine where constrained rows wait
for their frames, token for token, every output follows its grammar, and the run-ahead steps did
happen (so the comparison is not between two waiting engines)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams, StructuredOutput
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures

SCHEMA = {"type": "object", "properties": {"person_full_name": {"type": "string", "maxLength": 12},
                                           "age_in_whole_years": {"type": "integer"}},
          "required": ["person_full_name", "age_in_whole_years"], "additionalProperties": False}
"""Long keys: the grammar forces several tokens in a row, which a row run ahead waits to draft."""
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CASES = [
    ("Describe a person named Bob, aged 42, as a JSON object.", StructuredOutput.of_schema(SCHEMA)),
    ("When did the first humans land on the Moon? Give the date.", StructuredOutput(regex=DATE)),
    ("Write a sentence about the sea.", StructuredOutput(regex="[A-Za-z ,]{20,60}\\.")),
    ("What is the capital of France?", StructuredOutput(choice=("Paris", "London", "Rome"))),
]


def matches(text: str, structured: StructuredOutput) -> bool:
    if structured.json_schema is not None:
        value = json.loads(text)
        return set(value) == set(SCHEMA["properties"]) and isinstance(value["age_in_whole_years"], int)
    if structured.choice is not None:
        return text in structured.choice
    assert structured.regex is not None
    return re.fullmatch(structured.regex, text) is not None


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q, _ in CASES]


def run(prompts: list[list[int]], **config: Any) -> tuple[list[list[int]], dict[str, Any]]:
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=512, async_scheduling=True, **config))
    params = [SamplingParams(max_tokens=40, temperature=0, structured=s) for _, s in CASES]
    try:
        return run_loop(core, prompts, params), core.stats()
    finally:
        core.close()


@pytest.mark.parametrize("forced", [True, False], ids=["forced-drafts", "no-forced-drafts"])
def test_run_ahead_constrained_rows_equal_rows_that_wait(prompts, tokenizer, forced: bool) -> None:  # type: ignore[no-untyped-def]
    """With and without the grammar's forced drafts (a row whose grammar forces tokens waits for
    its frame to draft them; the others run ahead)."""
    waited, waited_stats = run(prompts, late_masks=False, grammar_drafts=forced)
    ahead, stats = run(prompts, late_masks=True, grammar_drafts=forced)
    for out, (_, structured) in zip(ahead, CASES, strict=True):
        text = tokenizer.decode(out)
        assert matches(text, structured), f"{text!r} does not follow its grammar"
    assert ahead == waited
    assert waited_stats["num_late_mask_steps"] == 0
    assert stats["num_late_mask_steps"] > 0, "no step had late masks: the test compares two waiting engines"
    assert stats["num_async_rows"] > waited_stats["num_async_rows"]
    if forced:
        assert stats["spec"]["num_forced_drafts"] > 0, "no forced drafts beside the rows run ahead"
