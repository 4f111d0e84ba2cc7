"""Async scheduling on the real model: running ahead on placeholders changes no token."""

from __future__ import annotations

import anyio
import pytest

from speckernel import AsyncEngine, EngineConfig, SamplingParams
from speckernel.engine.core import EngineCore
from tests.conftest import PROMPTS, run_to_completion

pytestmark = pytest.mark.slow


async def test_async_scheduling_equals_sync_stepping(tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(platform="cpu", max_model_len=256, in_process=True)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=7, ignore_eos=True)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    sync_core = EngineCore(config)
    expected = run_to_completion(sync_core, prompts[:4], greedy)
    expected += run_to_completion(sync_core, prompts[4:], seeded, "s")
    del sync_core

    async with AsyncEngine(config) as engine:
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            async for out in engine.generate(prompts[i], greedy if i < 4 else seeded):
                got[i] = out.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        stats = await engine.stats()
    assert [got[i] for i in range(8)] == expected
    assert stats["num_async_rows"] > 0, "no step ran ahead: async scheduling was not exercised"
    assert stats["num_stale_rows"] == 0
