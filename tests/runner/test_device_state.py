"""Kernel state on the device, end to end on the real model: every row reaches the
speculator (chunked prefill included), failures stay in their rows, and speculation is
lossless at the edges (EOS inside accepted drafts, preemption, the context boundary)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

from speckernel import AsyncEngine
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.frame import StepFrame
from speckernel.runner.model_runner import PendingStep
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest, RequestDelta
from tests.conftest import PROMPTS, run_to_completion

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def core_for(speculator: str | None = None, **kw: Any) -> EngineCore:
    kw.setdefault("max_model_len", 512)
    return EngineCore(EngineConfig(platform="cpu", speculator=speculator, **kw))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS[:6]]


@pytest.fixture(scope="module")
def plain_greedy(prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return run_to_completion(core_for(), prompts, GREEDY)


async def test_self_draft_accepts_every_draft_with_chunked_prefill(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The target as its own drafter must accept (nearly) every draft also when prompts arrive
    in chunks of 8 tokens: the drafter sees every chunk through the token buffer."""
    config = EngineConfig(platform="cpu", in_process=True, max_model_len=512, max_num_batched_tokens=8,
                          speculator="draft_model", num_speculative_tokens=4)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
    async with AsyncEngine(config) as engine:
        lengths = [len(engine.encode_chat(m)) for m in messages]
        assert min(lengths) > 8 * 3, "prompts must span several prefill chunks"
        for m in messages:
            async for _ in engine.chat(m, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)):
                pass
        spec = (await engine.stats())["spec"]
    assert spec["num_draft_tokens"] > 50
    assert spec["acceptance_rate"] >= 0.98, spec


def test_chunked_prefill_self_draft_equals_plain_greedy(prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    core = core_for("draft_model", num_speculative_tokens=3, max_num_batched_tokens=8)
    assert run_to_completion(core, prompts, GREEDY) == plain_greedy
    spec = core.stats()["spec"]
    assert spec["acceptance_rate"] >= 0.98 and spec["num_draft_tokens"] > 0


class FailFor:
    """Wraps the runner's step so that rows of one request raise, as a device fault would."""

    def __init__(self, core: EngineCore, victim: int, when: Any = lambda row: True) -> None:
        self.victim, self.when, self.inner = victim, when, core.runner._launch
        core.runner._launch = self  # type: ignore[method-assign]

    def __call__(self, frame: StepFrame) -> PendingStep:
        if any(r.key == self.victim and self.when(r) for r in frame.rows):
            raise RuntimeError("injected device fault")
        return self.inner(frame)


def add_all(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[int, list[int]]:
    outs: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        outs[i] = []
        assert core.add_request(AddRequest(i, np.asarray(ids), params)) is None
    return outs


def collect(outs: dict[int, list[int]], finals: dict[int, RequestDelta], deltas: list[RequestDelta]) -> None:
    for d in deltas:
        outs[d.key].extend(d.new_token_ids)
        if d.finish_reason is not None:
            finals[d.key] = d


@pytest.mark.parametrize("speculator", [None, "ngram", "draft_model"])
def test_a_failing_row_fails_only_its_request(speculator, prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    core = core_for(speculator, num_speculative_tokens=3)
    FailFor(core, victim=2, when=lambda row: row.sampling is not None and row.sampling.position >= 5)
    outs, finals = add_all(core, prompts, GREEDY), {}
    while core.scheduler.requests:
        collect(outs, finals, core.step())
    assert finals[2].finish_reason == "error" and "injected device fault" in (finals[2].error or "")
    for i in range(len(prompts)):
        if i != 2:
            assert outs[i] == plain_greedy[i] and finals[i].finish_reason == "length"
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks
    assert sorted(core.scheduler.free_slots) == list(range(core.config.max_num_seqs))


def test_a_successor_frame_never_reads_a_failed_predecessors_device_state(prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    """Async scheduling: frame N+1 was scheduled on a placeholder for the token frame N
    samples. Frame N fails that row: the placeholder row fails without running, the rest of
    frame N+1 goes on, and nothing fails the whole frame."""
    core = core_for(None, async_scheduling=True)
    FailFor(core, victim=1, when=lambda row: row.sampling is not None and row.sampling.position == 3)
    outs, finals = add_all(core, prompts, GREEDY), {}
    in_flight: deque[StepFrame] = deque()
    refused = 0
    while core.scheduler.requests or in_flight:
        while len(in_flight) < 2 and (frame := core.scheduler.schedule()) is not None:
            core.ledger.submit(frame)
            in_flight.append(frame)
        result = core.execute(in_flight.popleft())
        refused += sum("whose output this row reads" in (r.error or "") for r in result.rows)
        collect(outs, finals, core._apply(result))
    assert refused >= 1, "the test never put a placeholder row behind the failing one"
    assert finals[1].finish_reason == "error"
    for i in range(len(prompts)):
        if i != 1:
            assert outs[i] == plain_greedy[i]
    assert core.ledger.num_async_rows > 0


@pytest.mark.parametrize("speculator", ["ngram", "draft_model"])
def test_stop_token_inside_accepted_drafts(speculator, prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    """A stop token confirmed in the middle of a run of accepted drafts ends the request right
    there: no token after it is emitted, exactly as without speculation."""
    cases = []
    for ids, out in zip(prompts, plain_greedy, strict=True):
        stop = next((t for j, t in enumerate(out) if j >= 4 and t not in out[:j]), None)
        if stop is not None:
            cases.append((ids, out[: out.index(stop) + 1], stop))
    assert len(cases) >= 3
    core = core_for(speculator, num_speculative_tokens=4)
    for ids, want, stop in cases:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
        (got,) = run_to_completion(core, [ids], params)
        assert got == want
    assert core.stats()["spec"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("speculator", ["ngram", "draft_model"])
def test_preemption_with_speculation_keeps_greedy_output(speculator, prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    core = core_for(speculator, num_speculative_tokens=3, max_model_len=64, num_kv_blocks=20, block_size=4)
    assert run_to_completion(core, prompts, GREEDY) == plain_greedy
    assert core.scheduler.num_preemptions > 0
    assert core.stats()["spec"]["num_draft_tokens"] > 0
    assert core.scheduler.blocks.num_free == 20


@pytest.mark.parametrize("speculator", [None, "ngram", "draft_model"])
def test_context_length_boundary_with_drafts(speculator, prompts) -> None:  # type: ignore[no-untyped-def]
    """Requests that run into max_model_len stop exactly there, drafts or not."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    core = core_for(speculator, num_speculative_tokens=4, max_model_len=40)
    got = run_to_completion(core, prompts, params)
    for ids, out in zip(prompts, got, strict=True):
        assert len(ids) + len(out) == 40
    if speculator is not None:
        assert got == run_to_completion(core_for(None, max_model_len=40), prompts, params)


def test_unseeded_requests_draw_fresh_randomness_on_every_start(prompts) -> None:  # type: ignore[no-untyped-def]
    """Two starts give unseeded requests different seeds (once every start used seed 0, so the
    "random" text was the same every run); an engine seed makes them repeat."""
    def seed_of(core: EngineCore) -> int:
        assert core.add_request(AddRequest(1, np.asarray(prompts[0]), SamplingParams(max_tokens=2))) is None
        return core.scheduler.requests[1].seed

    assert seed_of(core_for(None, max_model_len=64)) != seed_of(core_for(None, max_model_len=64))
    assert seed_of(core_for(None, max_model_len=64, seed=5)) == seed_of(core_for(None, max_model_len=64, seed=5))
