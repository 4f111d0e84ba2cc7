"""Engine: a blocking facade over AsyncEngine for scripts and notebooks.

The async engine runs on a private event loop thread (an anyio blocking portal).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        self._async = AsyncEngine(config, **overrides)
        cm = self._portal.wrap_async_context_manager(self._async)
        self._engine_cm: AbstractContextManager[AsyncEngine] | None = cm
        try:
            cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self._async.tokenizer

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._engine_cm is not None:
            cm, self._engine_cm = self._engine_cm, None
            try:
                cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        agen = self._async.generate(prompt, params)
        try:
            while True:
                try:
                    yield self._portal.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(agen.aclose)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Runs every prompt concurrently and returns each final output, in order."""

        async def one(prompt: str | Sequence[int]) -> RequestOutput:
            last = None
            async for last in self._async.generate(prompt, params):  # noqa: B007
                pass
            assert last is not None
            return last

        async def run_all() -> list[RequestOutput]:
            results: list[RequestOutput | None] = [None] * len(prompts)

            async def fill(i: int) -> None:
                results[i] = await one(prompts[i])

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(fill, i)
            except BaseExceptionGroup as group:  # callers expect the typed error, not a group
                raise group.exceptions[0] from None
            return [r for r in results if r is not None]

        (params or SamplingParams()).validate()
        return self._portal.call(run_all)

    def stats(self) -> dict[str, Any]:
        return self._portal.call(self._async.stats)
