"""Speculation on real pipeline stages (CPU, gloo, float32, mtp): with a KV cache small enough that
the scheduler preempts, and a request aborted while its frames are in flight, the engine keeps
serving and every other request (the preempted ones included) gives the single-stage tokens;
only the last stage builds the speculator and holds drafter weights.

One PP=2 engine serves the whole module (one run, recorded by `pp2`): a stage start costs more
than the tests that read it."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.engine.speculation import held_bytes
from speckernel.engine.stage_messages import StageReport
from speckernel.sampling_params import SamplingParams
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop
from tests.engine.test_pipeline import run_until_done

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
TIGHT = {"num_kv_blocks": 9, "block_size": 8, "max_model_len": 64}
"""The fewest blocks that hold one request of max_model_len: five requests of 14 tokens preempt."""
VICTIM = 0
"""The prompt whose request is aborted mid-generation, with a frame in flight."""


def config(pp: int, **kw: Any) -> EngineConfig:
    return EngineConfig(**({"platform": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 16,
                            "pipeline_parallel_size": pp, "speculator": "mtp", "num_speculative_tokens": 3}
                           | TIGHT | kw))


def record_preemptions(core: EngineCore, keys: list[int]) -> set[int]:
    """The prompt indices (keys' positions) of the requests the scheduler preempts from now on."""
    preempted: set[int] = set()
    preempt = core.scheduler.preempt

    def counted(req: Any) -> None:
        preempted.add(keys.index(req.key))
        preempt(req)

    core.scheduler.preempt = counted  # type: ignore[method-assign]
    return preempted


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS[:5]]


class Single(NamedTuple):
    outputs: list[list[int]]
    """Single-stage, the KV cache as tight, nothing aborted."""
    roomy: list[list[int]]
    """Single-stage with KV for every request: nothing preempted."""
    drafter_bytes: int
    """What the single-stage engine's drafter holds (`held_bytes`)."""


def single_stage(prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], EngineCore]:
    core = EngineCore(config(1, **kw))
    try:
        return run_loop(core, prompts, GREEDY), core
    finally:
        core.close()


@pytest.fixture(scope="module")
def pp1(prompts: list[list[int]]) -> Single:
    outputs, tight = single_stage(prompts)
    roomy, core = single_stage(prompts, num_kv_blocks=None)
    assert tight.stats()["num_preemptions"] > 0 and core.stats()["num_preemptions"] == 0
    return Single(outputs, roomy, held_bytes(tight.speculator))  # its draft KV is as large as the stage's


class Pp2(NamedTuple):
    outputs: list[list[int]]
    preempted: set[int]
    """Prompt indices, the victim's aside, whose request the scheduler preempted (at least once)."""
    stats: dict[str, Any]
    reports: list[StageReport]
    core_digest: str


@pytest.fixture(scope="module")
def pp2(prompts: list[list[int]]) -> Pp2:
    """PP=2 on the same prompts; the victim is aborted once it has a token and its next frame is in flight."""
    core = EngineCore(config(2))
    keys = [900_000 + i for i in range(len(prompts))]  # run_until_done's keys
    preempted = record_preemptions(core, keys)
    aborted: list[int] = []
    seen: list[tuple[list[StageReport], str]] = []

    def abort_victim(core: EngineCore, outs: dict[int, list[int]]) -> None:
        req = core.scheduler.requests.get(keys[VICTIM])
        if req is not None and outs[req.key] and req.in_flight:  # mid-generation, its next frame in flight
            aborted.append(req.key)
            core.abort([req.key])
        if not seen:
            seen.append(core.runner.digests())  # type: ignore[union-attr]

    try:
        outputs = run_until_done(core, prompts, [GREEDY] * len(prompts), abort_victim)
        stats = core.stats()
    finally:
        core.close()
    assert aborted, "the victim never had a frame in flight while another frame's output came"
    assert seen, "no stage reported"
    return Pp2(outputs, preempted - {VICTIM}, stats, *seen[0])


def test_abort_with_a_speculator_keeps_serving_the_others(pp1: Single, pp2: Pp2) -> None:
    """The victim, aborted with frames in flight, stops with a prefix of its single-stage tokens;
    every other request finishes with exactly the single-stage tokens and acceptance goes on."""
    want, got = pp1.outputs, pp2.outputs
    assert 1 <= len(got[VICTIM]) < GREEDY.max_tokens
    assert pp2.stats["num_stale_rows"] > 0, "no row in flight was discarded"
    assert got[VICTIM] == want[VICTIM][: len(got[VICTIM])]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i != VICTIM:
            assert g == w, f"prompt {i}"
    spec = pp2.stats["spec"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0, spec
    assert not spec["speculator_off"]


def test_preempted_request_with_a_speculator_matches_single_stage(pp1: Single, pp2: Pp2) -> None:
    """Requests preempted (recomputed from their prompt and output) on the stages give the
    single-stage tokens, which are those of a run that preempts nothing."""
    assert pp2.stats["num_preemptions"] > 0, "nothing was preempted: the test proves nothing"
    assert pp2.preempted, "only the aborted request was preempted: the test proves nothing"
    for i in sorted(pp2.preempted):
        assert pp2.outputs[i] == pp1.outputs[i] == pp1.roomy[i], f"prompt {i}"


def test_only_the_last_stage_holds_the_drafter(pp1: Single, pp2: Pp2) -> None:
    """Stages before the last build no speculator and hold no drafter tensor; the last holds
    exactly what a single-stage engine's drafter holds."""
    reports, single = pp2.reports, pp1.drafter_bytes
    assert [r.rank for r in reports] == [0, 1]
    assert single > 0
    assert [(r.speculator, r.drafter_bytes) for r in reports] == [("", 0), ("MtpSpeculator", single)]
    assert {r.meta_digest for r in reports} == {pp2.core_digest}
