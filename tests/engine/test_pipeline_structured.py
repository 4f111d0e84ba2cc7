"""Structured output and chunked prefill on real pipeline stages (CPU, gloo, float32, async
scheduling), without a speculator and with mtp: greedy output constrained by a JSON schema, a
regex and a choice under PP=2 equals PP=1's token for token (the grammar's bitmask rides in the
frame to the last stage, which samples), and a prompt longer than the token budget keeps the
pipeline full: its intermediate prefill chunks go in flight behind one another.

One PP=2 engine per speculator serves the module (one run, recorded by `runs`)."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.frame import StepFrame
from speckernel.sampling_params import SamplingParams, StructuredOutput
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ("Paris", "London", "Rome")
CASES = [
    ("A person named Bob, aged 42, as JSON:", StructuredOutput.of_schema(SCHEMA)),
    ("The first Moon landing was on", StructuredOutput(regex=DATE)),
    ("The capital of France is", StructuredOutput(choice=CHOICES)),
]
"""Short prompts without a chat template: what is compared is PP=2 against PP=1, not the answers."""
LONG = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
"""The long prompt's request: its prefill is what it is there for."""
BUDGET = 16


def config(pp: int, speculator: str | None) -> EngineConfig:
    extra: dict[str, Any] = {"speculator": speculator, "num_speculative_tokens": 3} if speculator else {}
    return EngineConfig(platform="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=BUDGET,
                        pipeline_parallel_size=pp, async_scheduling=True, **extra)


class Chunk(NamedTuple):
    """A row of the long prompt's request, as the core put it in flight."""

    samples: bool
    in_flight: int
    """Frames holding a row of the request once this one went in flight (this one included)."""


class Runs(NamedTuple):
    single: list[list[int]]
    single_spec: dict[str, Any]
    pipeline: list[list[int]]
    pipeline_spec: dict[str, Any]
    long_rows: list[Chunk]
    """The long prompt's rows under PP=2, in the order they went in flight."""


def record_rows(core: EngineCore) -> dict[int, list[Chunk]]:
    """Per request key, its rows as the core submits them, with the frames of it in flight then."""
    rows: dict[int, list[Chunk]] = {}
    submit = core.ledger.submit

    def recorded(frame: StepFrame) -> None:
        submit(frame)
        for row in frame.rows:
            holding = sum(any(r.key == row.key for r in f.rows) for f in core.ledger.in_flight.values())
            rows.setdefault(row.key, []).append(Chunk(row.sampling is not None, holding))

    core.ledger.submit = recorded  # type: ignore[method-assign]
    return rows


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The long prompt first (admitted first, so it has the budget to itself), then one per case."""
    long = tokenizer.encode(" ".join(PROMPTS[:8]))
    assert len(long) > 3 * BUDGET, "the long prompt needs several intermediate chunks"
    return [long, *(tokenizer.encode(q) for q, _ in CASES)]


def params(max_tokens: int = 24) -> list[SamplingParams]:
    return [LONG, *(SamplingParams(max_tokens=max_tokens, temperature=0, structured=s) for _, s in CASES)]


def run(pp: int, speculator: str | None, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any],
                                                                            list[Chunk]]:
    core = EngineCore(config(pp, speculator))
    rows = record_rows(core)
    try:
        outputs = run_loop(core, prompts, params())
    finally:
        core.close()
    return outputs, core.stats()["spec"], rows[min(rows)]  # run_loop's keys follow the prompts' order


@pytest.fixture(scope="module", params=[None, "mtp"], ids=["plain", "mtp"])
def runs(request: pytest.FixtureRequest, prompts: list[list[int]]) -> Runs:
    single, single_spec, _ = run(1, request.param, prompts)
    return Runs(single, single_spec, *run(2, request.param, prompts))


def matches(text: str, structured: StructuredOutput) -> bool:
    if structured.json_schema is not None:
        value = json.loads(text)
        return set(value) == {"name", "age"} and isinstance(value["age"], int)
    if structured.regex is not None:
        return re.fullmatch(structured.regex, text) is not None
    return text in (structured.choice or ())


def test_structured_output_matches_single_stage(runs: Runs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """PP=2 gives PP=1's tokens, and they follow each grammar (so the grammar did constrain them);
    with a speculator, the same drafts, acceptances and refused drafts."""
    for i, (_, structured) in enumerate(CASES, start=1):
        text = tokenizer.decode(runs.single[i])
        assert matches(text, structured), f"case {i}: {text!r} does not follow its grammar"
    assert runs.pipeline == runs.single
    if runs.single_spec["speculator"] is not None:
        assert runs.single_spec["num_draft_tokens"] > 0, "the speculator never drafted: the test proves nothing"
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_invalid_drafts"):
            assert runs.pipeline_spec[key] == runs.single_spec[key], key


def test_intermediate_prefill_chunks_keep_the_pipeline_full(runs: Runs) -> None:
    """The long prompt's intermediate chunks (rows that sample nothing) go in flight while an
    earlier chunk of the same request still is (`Scheduler.pipelines`): stages run frames in
    order, so a chunk needs nothing of the frames before it but the KV they write first."""
    rows = runs.long_rows
    intermediate = [r for r in rows if not r.samples]
    assert len(intermediate) >= 3, rows
    assert max(r.in_flight for r in intermediate) >= 2, f"intermediate prefill chunks did not pipeline: {rows}"
