"""Request streams through one AsyncEngine at a fixed concurrency, for the decode, hostsync and
prefill scenarios: per-request timings, and the engine's counters over that stretch alone (they
are engine-wide and cumulative, so a run reports the difference of two snapshots and several
runs can share one engine and its start-up cost).
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from ...frontend.async_engine import AsyncEngine
from ...progress import Progress
from ...sampling_params import SamplingParams
from ..datasets import humaneval_messages
from .command import log_run, ms, percentile
from .repeats import median_run, warn_if_noisy

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_k0_steps", "num_host_draft_copies",
            "num_invalid_drafts", "num_forced_drafts", "num_forced_accepted")


def chat_prompts(engine: AsyncEngine, n: int) -> list[list[int]]:
    """The first n HumanEval problems as chat prompts, going round the 164 as often as needed,
    tokenized as the engine's chat() does (the HF peers get these very token ids)."""
    conversations = humaneval_messages()
    return [engine.encode_chat(conversations[i % len(conversations)]) for i in range(n)]


async def warm_up(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                  concurrencies: tuple[int, ...] = (1,)) -> None:
    """Short requests first, at each concurrency to be measured, so that lazy initialisation
    (kernels compiled for a new batch shape on first use, allocator growth) is not charged to
    the first measured requests."""
    warm = SamplingParams(max_tokens=min(params.max_tokens, 8), temperature=0.0, ignore_eos=params.ignore_eos)

    async def one(prompt: list[int]) -> None:
        async for _ in engine.generate(prompt, warm):
            pass

    for c in sorted(set(concurrencies)):
        async with anyio.create_task_group() as tg:
            for i in range(c):
                tg.start_soon(one, prompts[i % len(prompts)])


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in COUNTERS}
    steps = d["num_drafts"]  # steps that verified drafts, summed over requests
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    d["mean_acceptance_length"] = (d["num_accepted_tokens"] + steps) / steps if steps else None
    return d


async def run_streams(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                      desc: str) -> dict[str, Any]:
    """Runs every prompt with `concurrency` requests in flight at once (1: one after another):
    each of that many workers takes the next prompt as soon as its request finished."""
    outputs: list[list[int]] = [[] for _ in prompts]
    ttft: list[float] = []
    tpot: list[float] = []
    spans: list[tuple[float, float]] = []
    requests: list[list[float]] = []
    longest_gap = 0.0
    pending = iter(range(len(prompts)))
    bar = Progress(desc, len(prompts), len(prompts) * params.max_tokens)

    async def worker() -> None:
        nonlocal longest_gap
        for i in pending:  # one iterator shared by the workers: each prompt runs once
            out, seen = None, None
            async for out in engine.generate(prompts[i], params):
                now = time.monotonic()
                if seen is not None:
                    longest_gap = max(longest_gap, now - seen)
                seen = now
                bar.tokens(len(out.delta_token_ids))
            assert out is not None and out.timing is not None
            outputs[i] = out.token_ids
            t = out.timing
            spans.append((t.arrival, time.monotonic()))
            requests.append([round(x, 3) for x in (ms(t.first_token - t.arrival) if t.first_token else 0.0,
                                                   ms(spans[-1][1] - t.arrival), len(out.token_ids))])
            if t.first_token is not None:
                ttft.append(t.first_token - t.arrival)
                if t.finished is not None and len(out.token_ids) > 1:
                    tpot.append((t.finished - t.first_token) / (len(out.token_ids) - 1))
            bar.request_done()

    before = await engine.stats()
    started = time.monotonic()
    with bar:
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(prompts))):
                tg.start_soon(worker)
    elapsed = time.monotonic() - started
    after = await engine.stats()
    generated = sum(len(o) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    steps = after["num_steps"] - before["num_steps"]
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "idle_s": idle_time(spans, started, started + elapsed),
        "tokens_per_s": generated / elapsed,
        "prefill_tokens_per_s": prompt_tokens / elapsed,
        "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "ttft_max_ms": ms(max(ttft, default=None)),
        "longest_stall_ms": ms(longest_gap),
        "num_steps": steps,
        "steps_per_s": steps / elapsed,
        "num_graph_steps": after.get("num_graph_steps", 0) - before.get("num_graph_steps", 0),
        **device_gaps(before, after, elapsed),
        **late_masks(before, after),
        **host_and_device(before, after, steps, elapsed),
        # Since the engine was ready, warm-up requests included: Triton builds while serving.
        "kernel_builds_after_start": after.get("num_kernel_builds_after_warmup", 0),
        "spec": spec_delta(before["spec"], after["spec"]),
        "outputs": outputs,
        "requests": requests,  # per request, in finishing order: TTFT ms, time in flight ms, tokens
    }
    log_run({"run": desc} | {k: v for k, v in result.items() if k not in ("outputs", "requests")})
    return result


def device_gaps(before: dict[str, Any], after: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """The device's waits for the host between two steps with nothing else in flight
    (`engine.device_gaps`): how many, the mean one, and their share of the run."""
    count = after.get("num_device_gaps", 0) - before.get("num_device_gaps", 0)
    total = after.get("device_gap_s", 0.0) - before.get("device_gap_s", 0.0)
    return {"num_device_gaps": count, "device_gap_ms": 1e3 * total / count if count else None,
            "device_gap_share": total / elapsed_s if elapsed_s > 0 else None}


def late_masks(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The steps whose masks came after launch (`runner.late_masks`), with the mean time their
    sampling waited for them."""
    late = after.get("num_late_mask_steps", 0) - before.get("num_late_mask_steps", 0)
    held = after.get("late_mask_wait_s", 0.0) - before.get("late_mask_wait_s", 0.0)
    return {"num_late_mask_steps": late, "late_mask_wait_ms": 1e3 * held / late if late else None}


def host_and_device(before: dict[str, Any], after: dict[str, Any], steps: int, elapsed_s: float) -> dict[str, Any]:
    """The engine core's host time per step and per row launched, by phase (`engine.host_times`),
    beside the step period and the device's time per step (None where the engine does not measure
    it: the CPU, pipeline stages)."""
    rows = after.get("num_rows_launched", 0) - before.get("num_rows_launched", 0)
    host = {phase: spent for phase in after.get("host_s", {})  # the phases this run spent time in
            if (spent := after["host_s"][phase] - before["host_s"].get(phase, 0.0)) > 0}
    device = (after["device_s"] - before["device_s"]
              if after.get("device_s") is not None and before.get("device_s") is not None else None)
    return {"step_period_ms": 1e3 * elapsed_s / steps if steps else None,
            "rows_per_step": rows / steps if steps else None,
            "host_us_per_step": {p: 1e6 * s / steps for p, s in host.items()} if steps else {},
            "host_us_per_row": {p: 1e6 * s / rows for p, s in host.items()} if rows else {},
            "device_ms_per_step": 1e3 * device / steps if device is not None and steps else None}


async def repeated_streams(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                           desc: str, repeats: int, key: str = "tokens_per_s") -> dict[str, Any]:
    """run_streams `repeats` times on the same engine; the median run by `key`, with the spread of
    all of them (repeats.median_run), and a warning on stderr when they disagree widely."""
    runs = [await run_streams(engine, prompts, params, concurrency, desc if repeats == 1 else f"{desc} #{i + 1}")
            for i in range(repeats)]
    run = median_run(runs, key)
    warn_if_noisy(run, desc)
    return run


def idle_time(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] when no request was in flight (between requests at batch 1: what
    the frontend and the benchmark loop cost, not the engine's steps)."""
    busy, reach = 0.0, start
    for lo, hi in sorted(spans):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            busy += hi - lo
            reach = hi
    return max(0.0, end - start - busy)


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    """How many outputs match token for token (a free correctness signal for greedy runs)."""
    return sum(x == y for x, y in zip(a, b, strict=True))
