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


def applied(sched: Scheduler, frame: object) -> None:
    """What the ledger does to the counters when a frame lands (each sampling row emits 7)."""
    assert frame is not None
    for row in frame.rows:  # type: ignore[attr-defined]
        req = sched.requests[row.key]
        req.in_flight -= 1
        if row.sampling is not None:
            req.num_placeholders -= 1
            req.output_token_ids.append(7)


def step_kinds(sched: Scheduler, steps: int, arrivals: dict[int, list[Request]], max_prompt_rows: int = 1) -> str:
    """Runs `steps` steps, adding each step's arrivals first; each step's kind: D (decode rows
    only), P (one prompt row) or the number of prompt rows. Every prompt row is at most the
    scheduler's prompt_tokens_apart, and a prompt never shares its step with a decode row."""
    kinds = []
    for step in range(steps):
        for req in arrivals.get(step, []):
            sched.add(req)
        frame = sched.schedule()
        assert frame is not None
        prompt = [r for r in frame.rows if r.num_tokens > 1]
        assert all(r.num_tokens <= sched.prompt_tokens_apart for r in prompt), frame.rows
        assert not prompt or len(frame.rows) == 1 or len(frame.rows) == len(prompt) <= max_prompt_rows, frame.rows
        kinds.append(str(len(prompt)) if len(prompt) > 1 else "P" if prompt else "D")
        applied(sched, frame)
    return "".join(kinds)


def test_prompts_apart_take_turns_with_decode_rows_one_prompt_at_a_time() -> None:
    """Where prompts run apart, a step is decode rows only or one prompt chunk of at most N
    tokens, and while both have work they alternate: decode rows never wait two prompt steps."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, prompt_tokens_apart=8)
    assert sched.prompt_steps_per_decode == 1 and sched.prompt_batch == (1, 0), "the scheduler's defaults"
    kinds = step_kinds(sched, 24, {0: [make(k, 5, max_tokens=30) for k in range(2)],
                                   4: [make(k, 20, max_tokens=30) for k in range(2, 5)]})
    # Two short prompts, then three of 20 tokens (3 chunks each) from step 4: 11 prompt steps.
    assert kinds == "PD" * 11 + "DD"


def test_a_burst_of_prompts_takes_several_prompt_steps_per_decode_step() -> None:
    """Five prompts arrive while two requests decode: up to three prompt steps run between two
    decode steps while more than one prompt waits; the last one, alone, alternates again."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, prompt_tokens_apart=8,
                      prompt_steps_per_decode=3)
    kinds = step_kinds(sched, 16, {0: [make(k, 5, max_tokens=40) for k in range(2)],
                                   4: [make(k, 6, max_tokens=40) for k in range(2, 7)]})
    # Two prompts alternate with decode steps (one waits at a time); from step 4 five wait: three
    # prompt steps, a decode step, the fourth (two waited), then the fifth, alone, after a decode.
    assert kinds == "PDPD" + "PPPD" + "PD" + "PD" + "D" * 4, kinds


def test_a_burst_of_prompts_shares_steps_of_several_prompts() -> None:
    """With several-prompt steps of up to 3 rows and 16 tokens: the two first prompts share a
    step, and five 6-token prompts that arrive at once take two (6 + 6 + a 4-token chunk, then
    that chunk's 2 + 6 + 6), not five."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, prompt_tokens_apart=8,
                      prompt_steps_per_decode=3, prompt_batch=(3, 16))
    kinds = step_kinds(sched, 10, {0: [make(k, 5, max_tokens=40) for k in range(2)],
                                   4: [make(k, 6, max_tokens=40) for k in range(2, 7)]}, max_prompt_rows=3)
    assert kinds == "2DDD" + "33" + "D" * 4, kinds


@pytest.mark.parametrize("batch", [(1, 0), (3, 16)], ids=["one-prompt", "several-prompts"])
def test_prompts_apart_under_pipeline_stages_pipeline_their_intermediate_chunks(batch: tuple[int, int]) -> None:
    """With pipeline stages, a long prompt's intermediate chunks are scheduled while the chunks
    before them are in flight (they read no output of those frames); its final chunk, which
    samples, waits for its predecessor."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, prompt_tokens_apart=8,
                      pipeline=True, async_scheduling=True, prompt_batch=batch)
    sched.add(make(1, 30))
    chunks = []
    while (frame := sched.schedule()) is not None:
        chunks.append([(r.num_tokens, r.sampling is not None) for r in frame.rows])
    assert chunks == [[(8, False)], [(8, False)], [(8, False)]], "the final chunk waits; the others pipeline"


def test_prompts_apart_preempt_rather_than_stall() -> None:
    """Two prompts in flight at once (the second starts while the first's chunk runs) that
    together outgrow the cache: the later one is preempted so the earlier goes on, as in mixed
    steps; nothing is left stuck with nothing in flight."""
    sched = Scheduler(BlockManager(6, 4), max_num_seqs=4, max_num_batched_tokens=64, prompt_tokens_apart=4)
    a, b = make(1, 14, max_tokens=2), make(2, 14, max_tokens=2)
    sched.add(a)
    sched.add(b)
    in_flight: list[object] = []
    for _ in range(60):
        while len(in_flight) < 2 and (frame := sched.schedule()) is not None:
            in_flight.append(frame)
        if not in_flight:
            break
        frame = in_flight.pop(0)
        if all(r.generation == sched.requests[r.key].generation for r in frame.rows if r.key in sched.requests):
            applied(sched, frame)
        for req in [r for r in (a, b) if r.status is Status.RUNNING and len(r.output_token_ids) >= 2]:
            sched.finish(req, "length")
    assert a.status is Status.FINISHED and b.status is Status.FINISHED
    assert sched.num_preemptions >= 1


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
