"""Scheduler and block manager: budgets, chunked prefill, preemption by recompute."""

from __future__ import annotations

import pytest

from speckernel.config import EngineConfig
from speckernel.kernel.block_manager import BlockManager
from speckernel.kernel.request import Request, Status
from speckernel.kernel.scheduler import Scheduler
from speckernel.sampling_params import SamplingParams
from tests.conftest import PROMPTS, run_to_completion


def make(key: int, n_prompt: int, max_tokens: int = 8) -> Request:
    return Request(key, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), 0, (), 10_000)


def test_chunked_prefill_respects_token_budget_and_samples_only_at_the_end() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    req = make(1, 23)
    sched.add(req)
    chunks = []
    while req.num_computed_tokens < 23:
        frame = sched.schedule()
        assert frame is not None and frame.num_tokens <= 10
        (row,) = frame.rows
        chunks.append((row.start_pos, len(row.token_ids), row.sampling is not None))
        assert row.token_ids == req.prompt_token_ids[row.start_pos : row.start_pos + len(row.token_ids)]
        req.in_flight -= 1  # as the ledger would on apply
    assert chunks == [(0, 10, False), (10, 10, False), (20, 3, True)]
    assert len(req.block_ids) == 6


def test_max_num_seqs_caps_running_requests() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(make(i, 3))
    frame = sched.schedule()
    assert frame is not None and [r.key for r in frame.rows] == [0, 1]
    assert len(sched.waiting) == 2


def test_request_with_frame_in_flight_is_not_scheduled_again() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add(make(1, 3))
    assert sched.schedule() is not None
    assert sched.schedule() is None


def test_preemption_frees_blocks_and_bumps_generation() -> None:
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make(1, 8), make(2, 7)
    sched.add(a)
    sched.add(b)
    frame = sched.schedule()
    assert frame is not None and len(frame.rows) == 2 and sched.blocks.num_free == 0
    a.in_flight = b.in_flight = 0
    b_generation = b.generation
    a.output_token_ids.append(99)  # a needs a third block for its next token: b is preempted
    frame = sched.schedule()
    assert frame is not None and [r.key for r in frame.rows] == [1]
    assert b.status is Status.WAITING and b.generation > b_generation and b.num_computed_tokens == 0
    assert b.block_ids == [] and sched.waiting[0] is b and sched.num_preemptions == 1


def test_finish_returns_blocks_and_forgets_request() -> None:
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=100)
    req = make(1, 9)
    sched.add(req)
    sched.schedule()
    generation = req.generation
    sched.finish(req, "abort")
    assert sched.blocks.num_free == 8 and 1 not in sched.requests and req.generation > generation


@pytest.mark.slow
def test_preemption_by_recompute_keeps_greedy_output(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """With a KV cache too small for the batch, requests are preempted and recomputed, and
    every output still equals the one computed with room to spare."""
    from speckernel.engine.core import EngineCore

    prompts = [tokenizer.encode(p) for p in PROMPTS[:6]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = EngineCore(EngineConfig(platform="cpu", max_model_len=256, num_kv_blocks=64, block_size=4))
    expected = run_to_completion(roomy, prompts, params)
    del roomy
    tight = EngineCore(EngineConfig(platform="cpu", max_model_len=64, num_kv_blocks=32, block_size=4))
    got = run_to_completion(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert tight.ledger.num_stale_rows == 0
    assert got == expected
    assert tight.scheduler.blocks.num_free == 32
