"""The serving loop takes a launched frame's result (`engine.core.landing`): where it launched
the frame itself it looks again between its other tasks for a while, and only then hands the
wait to a worker thread; a frame launched by a runner thread gets the thread at once."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.to_thread
import pytest

from speckernel.engine import core as core_module
from speckernel.engine.core import landing
from speckernel.kernel.frame import StepResult


class Landing:
    """A launched step whose copy reaches the host after `polls` looks, or once `event` is set."""

    def __init__(self, polls: int = 10**9, event: threading.Event | None = None) -> None:
        self.polls, self.event, self.looked = polls, event, 0
        self.step = StepResult(7, [])

    def ready(self) -> bool:
        self.looked += 1
        return self.looked > self.polls or (self.event is not None and self.event.is_set())

    def result(self) -> StepResult:
        if self.event is not None:
            assert self.event.wait(5)
        return self.step


def launched(pending: Landing) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(pending)
    return future


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the waits handed to a worker thread."""
    counted: list[int] = []
    run_sync = anyio.to_thread.run_sync

    async def counting(fn: Any, *args: Any, **kw: Any) -> Any:
        counted.append(1)
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(core_module.anyio.to_thread, "run_sync", counting)
    return counted


async def test_a_frame_due_soon_is_taken_on_the_loop_while_other_tasks_run(hops: list[int]) -> None:
    pending, turns = Landing(polls=5), 0

    async def frontend() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(frontend)
        result = await landing(launched(pending), poll_s=5.0)
        tg.cancel_scope.cancel()
    assert result is pending.step and pending.looked == 6
    assert not hops
    assert turns >= 5  # the loop served its other tasks between looks


async def test_a_frame_that_takes_longer_is_waited_for_on_a_thread(hops: list[int]) -> None:
    event = threading.Event()
    pending = Landing(event=event)
    threading.Timer(0.2, event.set).start()
    result = await landing(launched(pending), poll_s=0.01)
    assert result is pending.step and hops == [1]


async def test_a_frame_launched_elsewhere_gets_a_thread_at_once(hops: list[int]) -> None:
    pending = Landing(polls=1)
    result = await landing(launched(pending), poll_s=0.0)
    assert result is pending.step and hops == [1] and pending.looked == 1


async def test_a_landed_frame_needs_no_wait(hops: list[int]) -> None:
    pending = Landing(polls=0)
    assert await landing(launched(pending), poll_s=0.0) is pending.step
    assert not hops


async def test_a_failed_launch_raises_at_once(hops: list[int]) -> None:
    future: Future[Any] = Future()
    future.set_exception(RuntimeError("launch failed"))
    with pytest.raises(RuntimeError, match="launch failed"):
        await landing(future, poll_s=5.0)
    assert not hops
