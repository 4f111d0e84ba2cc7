"""Liveness measures the core, not the frontend: a frontend whose event loop (or GIL) is busy for
seconds must not declare a healthy core dead. A real core process on the default model, with its
own tokenizer: a multi-MB prompt is tokenized off the event loop, and user code that holds the GIL
for longer than the heartbeat bound leaves the core alive.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import anyio
import pytest

from speckernel import AsyncEngine, EngineConfig, SamplingParams
from speckernel.errors import EngineDeadError, PromptTooLongError
from speckernel.frontend import client as client_module
from speckernel.frontend.client import HEARTBEAT_TIMEOUT_S, ProcessClient

pytestmark = pytest.mark.timing  # heartbeat and silence bounds

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


TINY = EngineConfig(model="random:tiny", platform="cpu", max_model_len=64, num_kv_blocks=64)


async def test_the_core_beats_while_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading takes seconds (torch's import alone); beats from the core's start-up thread keep a
    frontend with a start-up bound shorter than that from declaring it hung."""
    monkeypatch.setattr(client_module, "STARTUP_HEARTBEAT_TIMEOUT_S", 2.5)
    client = ProcessClient(TINY)
    try:
        async with anyio.create_task_group() as tg:
            t0 = time.monotonic()
            await client.start(tg)
            took = time.monotonic() - t0
            assert client.gave_up is None
            await client.close()
    finally:
        client.release()
    print(f"started in {took:.1f} s")


async def test_a_core_stopped_while_it_starts_is_reported_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not after the whole start-up timeout (300 s): the silence bound applies from the first
    moment, and the message names the pid and how it ended."""
    monkeypatch.setattr(client_module, "STARTUP_HEARTBEAT_TIMEOUT_S", 2.0)
    client = ProcessClient(TINY)
    try:
        async with anyio.create_task_group() as tg:

            async def stop_it() -> None:
                while client.proc is None:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.5)
                os.kill(client.proc.pid, signal.SIGSTOP)

            tg.start_soon(stop_it)
            t0 = time.monotonic()
            with anyio.fail_after(10), pytest.raises(
                    EngineDeadError, match=r"^engine core failed during start-up: pid \d+ stopped answering during "
                                           r"start-up \(no heartbeat for 2\.\d s\); killed it with SIGKILL$"):
                await client.start(tg)
            took = time.monotonic() - t0
    finally:
        client.release()
    assert took < 2.0 + 3, took
    assert client.proc is not None and client.proc.returncode == -signal.SIGKILL
