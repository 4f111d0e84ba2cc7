"""Pipeline parallelism on the real default model (CPU, gloo, float32): PP=2 and PP=4 give the
single-stage tokens and acceptance counts, with and without speculators (fixed and variable
width), sync and async scheduling, chunked prefill on a small budget, preemption and aborts
with frames in flight; every rank sees the same frame metadata for every step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import NO_PIPELINE_LOGPROBS, SamplingParams
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = [tokenizer.encode(p) for p in PROMPTS[:5]]
    return [*ids, ids[0] + ids[1] + ids[2]]  # one prompt longer than the token budget: chunked prefill


def config(pp: int, speculator: str | None = None, **kw: Any) -> EngineConfig:
    extra: dict[str, Any] = {"speculator": speculator, "num_speculative_tokens": 3} if speculator else {}
    return EngineConfig(**({"platform": "cpu", "max_model_len": 256, "max_num_seqs": 8,
                            "max_num_batched_tokens": 16, "pipeline_parallel_size": pp} | extra | kw))


def outputs(cfg: EngineConfig, prompts: list[list[int]], params: Any = GREEDY,
            on_step: Any = None) -> tuple[list[list[int]], dict[str, Any], list[Any], int]:
    """The tokens, the speculation counters, a few digest comparisons and the rows that ran
    ahead of their frame in flight (num_async_rows)."""
    core = EngineCore(cfg)
    seen: list[Any] = []

    def check_meta(core: EngineCore, outs: dict[int, list[int]]) -> None:
        if on_step is not None:
            on_step(core, outs)
        if cfg.pipeline_parallel_size > 1 and len(seen) < 3:  # a few times, frames in flight or not
            seen.append(core.runner.digests())  # type: ignore[union-attr]

    try:
        got = run_loop(core, prompts, params, check_meta)
    finally:
        core.close()
    stats = core.stats()
    return got, stats["spec"], seen, stats["num_async_rows"]


CASES = [
    pytest.param(2, None, True, id="pp2-plain-async"),
    pytest.param(4, None, True, id="pp4-plain-async"),
    pytest.param(2, None, False, id="pp2-plain-sync"),
    pytest.param(2, "mtp", True, id="pp2-mtp-async"),
    pytest.param(4, "eagle3", False, id="pp4-eagle3-sync"),
    pytest.param(2, "ngram", True, id="pp2-ngram-async"),
    pytest.param(2, "dflash", False, id="pp2-dflash-sync"),
    pytest.param(2, "mtp", True, {"pipeline_transport": "torch_dist"}, id="pp2-mtp-async-torch_dist"),
    pytest.param(2, "mtp", True, {"pipeline_transport": "cuda_ipc"}, id="pp2-mtp-async-cuda_ipc"),
]
_reference: dict[Any, Any] = {}


def reference(speculator: str | None, async_scheduling: bool, prompts: list[list[int]]) -> Any:
    key = (speculator, async_scheduling)
    if key not in _reference:
        _reference[key] = outputs(config(1, speculator, async_scheduling=async_scheduling), prompts)[:2]
    return _reference[key]


@pytest.mark.parametrize(("pp", "speculator", "async_scheduling", "extra"),
                         [p if len(p.values) == 4 else pytest.param(*p.values, {}, id=p.id) for p in CASES])
def test_pipeline_matches_single_stage(pp: int, speculator: str | None, async_scheduling: bool,
                                       extra: dict[str, Any], prompts: list[list[int]]) -> None:
    """On the platform's transport (zmq on the CPU) and on one named by configuration."""
    want, want_spec = reference(speculator, async_scheduling, prompts)
    got, spec, seen, ahead = outputs(config(pp, speculator, async_scheduling=async_scheduling, **extra), prompts)
    assert got == want
    # A decoding row is scheduled again while its frame is in flight, its input read from the last
    # stage's token window on the device (plain decoding; a speculator's rows wait for their frame).
    assert (ahead > 0) == (async_scheduling and speculator is None), ahead
    if speculator is not None:
        assert spec["num_draft_tokens"] > 0, "the speculator never drafted: the test proves nothing"
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert spec[key] == want_spec[key], key
    assert seen, "no frame metadata was compared"
    for reports, core_digest in seen:
        assert len(reports) == pp
        assert {r.meta_digest for r in reports} == {core_digest}, "a rank saw other frame metadata"
        assert len({r.num_steps for r in reports}) == 1


def test_pipeline_preemption_and_aborts_with_frames_in_flight(prompts: list[list[int]]) -> None:
    """Few KV blocks force preemption; one request is aborted while its frames are in flight.
    The others give the single-stage tokens; stale frames are discarded."""
    victim: dict[str, int] = {}

    def abort_one(core: EngineCore, outs: dict[int, list[int]]) -> None:
        key = min(outs)
        if not victim and len(outs[key]) >= 3 and key in core.scheduler.requests:
            victim["key"] = key
            core.abort([key])

    params = [GREEDY] * len(prompts)
    small = {"num_kv_blocks": 8, "block_size": 8, "max_model_len": 64}
    want, _ = outputs(config(1, **small), prompts)[:2]
    core = EngineCore(config(2, **small))
    try:
        got = run_until_done(core, prompts, params, abort_one)
        stats = core.stats()
    finally:
        core.close()
    assert stats["num_preemptions"] > 0, "nothing was preempted: the test proves nothing"
    assert victim, "nothing was aborted"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i == 0:
            assert w[: len(g)] == g  # the aborted request: a prefix, then nothing
        else:
            assert g == w


def run_until_done(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams], on_step: Any) -> Any:
    """run_loop, where an aborted request counts as done."""
    import anyio  # local: only this driver runs its own loop
    import numpy as np

    from speckernel.wire.messages import AddRequest, CoreOutputs, Shutdown

    outs: dict[int, list[int]] = {900_000 + i: [] for i in range(len(prompts))}

    async def emit(msg: Any) -> None:
        if isinstance(msg, CoreOutputs):
            for d in msg.deltas:
                outs[d.key].extend(d.new_token_ids)
            on_step(core, outs)
            if not core.scheduler.requests and not core.scheduler.waiting:
                core.deliver(Shutdown())

    async def main() -> None:
        for i, ids in enumerate(prompts):
            core.deliver(AddRequest(900_000 + i, np.asarray(ids), params[i], f"p{i}"))
        await core.run(emit)

    anyio.run(main)
    return [outs[900_000 + i] for i in range(len(prompts))]


PENALIZED = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.6),
    SamplingParams(max_tokens=14, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=1.5, top_k=20),
    GREEDY,  # a row without penalties next to rows with them
    SamplingParams(max_tokens=14, temperature=0.7, seed=5, ignore_eos=True, frequency_penalty=-1.0),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=0.8),
]
"""One per prompt: the last stage samples, so its counts come from its own token buffer."""


def test_pipeline_penalties_match_single_stage(prompts: list[list[int]]) -> None:
    """Penalties under PP=2 with speculation (ngram, async) give the single-stage tokens."""
    want, want_spec = outputs(config(1, "ngram", async_scheduling=True), prompts, PENALIZED)[:2]
    unpenalized, _ = reference("ngram", True, prompts)
    changed = [i for i, p in enumerate(PENALIZED) if p.greedy and p.penalized and want[i] != unpenalized[i]]
    assert changed, "no penalty changed a greedy output: the test proves nothing"
    got, spec, _, _ = outputs(config(2, "ngram", async_scheduling=True), prompts, PENALIZED)
    assert got == want
    assert spec["num_accepted_tokens"] == want_spec["num_accepted_tokens"]


def test_pipeline_refuses_logprobs(prompts: list[list[int]]) -> None:
    """The stages' token frames carry tokens alone: a request for logprobs fails at once, typed and
    naming the field, and the engine serves the next request."""
    core = EngineCore(config(2))
    try:
        refused = core.add_request(AddRequest(0, np.asarray(prompts[0]), SamplingParams(max_tokens=2, logprobs=0)))
        assert refused is not None and refused.finish_reason == "error"
        assert refused.error == f"InvalidSamplingParamsError: {NO_PIPELINE_LOGPROBS}"
        assert run_loop(core, prompts[:1], GREEDY) == reference(None, False, prompts)[0][:1]
    finally:
        core.close()
