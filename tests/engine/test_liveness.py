"""Liveness measures the core, not the frontend: a frontend whose event loop (or GIL) is busy for
seconds must not declare a healthy core dead. A real core process on the default model, with its
own tokenizer: a multi-MB prompt is tokenized off the event loop, and user code that holds the GIL
for longer than the heartbeat bound leaves the core alive.
"""

from __future__ import annotations

import sys
import time

import anyio
import pytest

from speckernel import AsyncEngine, EngineConfig, SamplingParams
from speckernel.errors import PromptTooLongError
from speckernel.frontend.client import HEARTBEAT_TIMEOUT_S, ProcessClient

CONFIG = EngineConfig(platform="cpu", max_model_len=256, num_kv_blocks=64, seed=0)
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def hold_the_gil(seconds: float) -> None:
    """What a C extension that never releases the GIL does to every other thread: with a switch
    interval longer than the hold, no other thread runs until it is over."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 30)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(previous)


def client_of(engine: AsyncEngine) -> ProcessClient:
    client = engine._client
    assert isinstance(client, ProcessClient)
    return client


async def test_a_5mb_prompt_and_5s_of_gil_held_by_user_code_leave_the_core_alive() -> None:
    async with AsyncEngine(CONFIG) as engine:
        client = client_of(engine)
        before = [o async for o in engine.generate("The capital of France is", GREEDY)][-1].token_ids
        prompt = "hello world " * (5 * 2**20 // 12)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.05)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            t0 = time.monotonic()
            with pytest.raises(PromptTooLongError, match="tokens; the context holds 256"):
                async for _ in engine.generate(prompt, GREEDY):
                    pass
            took = time.monotonic() - t0
            tg.cancel_scope.cancel()
        # The event loop kept running while the prompt was tokenized (a worker thread did it).
        assert ticks >= took / 0.05 / 4, (ticks, took)
        await anyio.sleep(0.3)  # the receiving thread is inside its poll of the socket now
        hold_the_gil(HEARTBEAT_TIMEOUT_S + 2)
        await anyio.sleep(0.5)  # the receiving side listens again, and finds the beats queued
        assert client.gave_up is None, client.gave_up
        assert client.proc is not None and client.proc.poll() is None
        after = [o async for o in engine.generate("The capital of France is", GREEDY)][-1].token_ids
        assert after == before
        assert (await engine.stats())["num_running"] == 0
