"""AsyncEngine end to end, with the engine core in its own process, on the real default model."""

from __future__ import annotations

import time
from contextlib import aclosing

import anyio
import pytest

from speckernel import (
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    InvalidInputError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    SamplingParams,
    UnknownModelError,
    UnknownPluginError,
)
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(platform="cpu", max_model_len=512)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> list[int]:
    out = None
    async for out in engine.generate(prompt, params):  # noqa: B007 - the last output is kept
        pass
    assert out is not None and out.finished
    return out.token_ids


async def test_concurrent_streams_equal_solo_and_cancellation_frees_blocks() -> None:
    prompts = PROMPTS[:8]  # enough to batch, and to cancel half of them two ways
    async with AsyncEngine(CONFIG) as engine:
        solo = [await collect(engine, p, GREEDY) for p in prompts]
        assert all(len(s) == GREEDY.max_tokens for s in solo)

        results: dict[int, list[int]] = {}
        deltas_seen: dict[int, int] = {}

        async def stream(i: int) -> None:
            async for out in engine.generate(prompts[i], GREEDY):
                deltas_seen[i] = deltas_seen.get(i, 0) + 1
                results[i] = out.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(stream, i)
        assert [results[i] for i in range(len(prompts))] == solo
        assert all(deltas_seen[i] >= 2 for i in deltas_seen), "output must stream in several deltas"

        # Half the callers go away mid-stream: odd ones are cancelled, some stop iterating.
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        survivors: dict[int, list[int]] = {}

        async def cancelled(i: int) -> None:
            with anyio.CancelScope() as scope:
                async for out in engine.generate(prompts[i], long):
                    if len(out.token_ids) >= 3:
                        scope.cancel()

        async def stops_iterating(i: int) -> None:
            async with aclosing(engine.generate(prompts[i], long)) as agen:
                async for out in agen:
                    if len(out.token_ids) >= 3:
                        break

        async def survivor(i: int) -> None:
            survivors[i] = await collect(engine, prompts[i], GREEDY)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(survivor if i % 2 == 0 else cancelled if i % 4 == 1 else stops_iterating, i)
        assert survivors == {i: solo[i] for i in range(0, len(prompts), 2)}
        stats = await engine.stats()
        # The aborted requests wanted 400 tokens each; only the abort can have freed them by now.
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        proc = engine._client.proc  # type: ignore[union-attr]
    assert proc.poll() is not None, "engine core process must exit with the engine"


async def test_bad_input_gets_typed_errors_and_engine_keeps_serving() -> None:
    async with AsyncEngine(CONFIG) as engine:
        expected = await collect(engine, PROMPTS[0], GREEDY)

        async def background() -> list[int]:
            return await collect(engine, PROMPTS[0], GREEDY)

        box: list[list[int]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _store(box, background()))
            for bad in (SamplingParams(temperature=-1.0), SamplingParams(max_tokens=0),
                        SamplingParams(top_p=0.0), SamplingParams(top_k=-3)):
                with pytest.raises(InvalidSamplingParamsError):
                    await collect(engine, "hello", bad)
            with pytest.raises(PromptTooLongError):
                await collect(engine, "word " * 2000, GREEDY)
            with pytest.raises(InvalidInputError):
                await collect(engine, "", GREEDY)
            with pytest.raises(InvalidInputError, match="token ids"):  # checked by the core
                async for _ in engine.generate([1, 2, 10**7], GREEDY):
                    pass
            # Malformed frames straight onto the core's socket are dropped; the core goes on.
            client = engine._client
            client.tx.send_multipart([b"\x93not msgpack"])  # type: ignore[union-attr]
            client.tx.send_multipart([b"\xc1"])  # type: ignore[union-attr]
            # The core validates again, whatever the frontend let through.
            client.send(AddRequest(10**9, __import__("numpy").array([1, 2]), SamplingParams(temperature=-5.0)))  # type: ignore[union-attr]
        assert box == [expected]
        assert await collect(engine, PROMPTS[0], GREEDY) == expected


async def _store(box: list, coro) -> None:  # type: ignore[no-untyped-def]
    box.append(await coro)


@pytest.mark.timing  # requests fail within 10 s of the core's death
async def test_core_death_fails_pending_requests_at_once() -> None:
    async with AsyncEngine(CONFIG) as engine:
        errors: list[BaseException] = []

        async def pending(i: int) -> None:
            try:
                await collect(engine, PROMPTS[i], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
            except EngineDeadError as e:
                errors.append(e)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(pending, i)
            await anyio.sleep(1.0)
            engine._client.proc.kill()  # type: ignore[union-attr]
        assert len(errors) == 4 and all("died" in str(e) for e in errors)
        assert time.monotonic() - started < 10
        with pytest.raises(EngineDeadError):
            await collect(engine, "hello", GREEDY)
        with pytest.raises(EngineDeadError):
            await engine.stats()


async def test_unknown_model_and_platform_fail_before_start() -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        async with AsyncEngine(EngineConfig(model="no-such-model")):
            pass
    with pytest.raises(UnknownPluginError, match=r"available: .*cpu"):
        async with AsyncEngine(EngineConfig(platform="tpu")):
            pass


async def test_in_process_mode_seeds_and_stop_strings() -> None:
    async with AsyncEngine(CONFIG, in_process=True) as engine:
        sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
        first = await collect(engine, PROMPTS[2], sampled)
        # Same seed, other requests in the batch: the same tokens.
        async with anyio.create_task_group() as tg:
            box: list[list[int]] = []
            tg.start_soon(lambda: _store(box, collect(engine, PROMPTS[2], sampled)))
            for i in range(3, 7):
                tg.start_soon(collect, engine, PROMPTS[i], sampled)
        assert box == [first]
        other_seeds = {tuple(await collect(engine, PROMPTS[2], SamplingParams(
            max_tokens=16, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True))) for s in range(4)}
        assert len(other_seeds) > 1

        plain = None
        async for plain in engine.generate(PROMPTS[0], GREEDY):  # noqa: B007
            pass
        assert plain is not None
        stop = plain.text.split()[3]
        async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=(stop,))):
            assert stop not in out.text
        assert out.finished and out.finish_reason == "stop"
        assert out.text == plain.text[: plain.text.index(stop)]


def test_engine_core_exits_when_its_frontend_is_killed() -> None:
    """No orphan: a frontend killed with SIGKILL (no clean-up runs) still takes its core with it."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import anyio, os, sys\n"
        "from speckernel import AsyncEngine, EngineConfig\n"
        "async def main():\n"
        "    async with AsyncEngine(EngineConfig(platform='cpu', max_model_len=128)) as engine:\n"
        "        print(engine._client.proc.pid, flush=True)\n"
        "        os.kill(os.getpid(), 9)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    core_pid = int(proc.stdout.strip())
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(core_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(core_pid, signal.SIGKILL)
    raise AssertionError("the engine core outlived its frontend")
