"""Where a launch never waits for the device, the serving loop launches each frame on its own
thread (`EngineConfig.launch_on_loop`) instead of handing it to a runner thread that would contend
with it for the GIL. On the real default model through the core's own loop: the frames are
launched on the loop's thread, and the output equals the runner thread's token for token; a
launch that raises surfaces where the runner thread's would, after the frames before it."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from speckernel.config import EngineConfig
from speckernel.engine import core as core_module
from speckernel.engine.core import EngineCore
from speckernel.runner.model_runner import ModelRunner
from speckernel.sampling_params import SamplingParams
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three tips for better sleep:"]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS]


def serve(prompts: list[list[int]], on_loop: bool, monkeypatch: pytest.MonkeyPatch, counts: list[int] | None = None,
          fail_at: int = 0, **config: Any) -> tuple[list[list[int]], set[str]]:
    """Outputs and the names of the threads that launched frames; `counts` gets the tokens
    streamed so far after each batch of deltas; launch number fail_at raises. On the CPU a launch
    runs the step, so `on_loop` stands in for a device whose launches return at once: the loop
    launches there all the same (correctness does not depend on it)."""
    if on_loop:
        monkeypatch.setattr(EngineCore, "_launches_on_loop", lambda self, depth: depth == 2)
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=256, async_scheduling=True, **config))
    threads: set[str] = set()
    launches = 0
    launch = core._launch

    def recorded(frame):  # type: ignore[no-untyped-def]
        nonlocal launches
        threads.add(threading.current_thread().name)
        launches += 1
        if launches == fail_at:
            raise RuntimeError("launch failed")
        return launch(frame)

    monkeypatch.setattr(core, "_launch", recorded)
    try:
        streamed = None if counts is None else lambda c, out: counts.append(sum(map(len, out.values())))
        outputs = run_loop(core, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           on_step=streamed)
        assert core.launch_on_loop is (on_loop and core.pipeline_depth() == 2)
        return outputs, threads
    finally:
        monkeypatch.undo()
        core.close()


def test_the_loop_launches_on_its_own_thread_and_outputs_equal_the_runner_threads(
        prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    loop_out, loop_threads = serve(prompts, True, monkeypatch)
    thread_out, runner_threads = serve(prompts, False, monkeypatch)
    assert loop_out == thread_out
    assert all(len(o) == 12 for o in loop_out)
    assert loop_threads == {threading.current_thread().name}, "every frame launched on the loop's thread"
    assert len(runner_threads) == 1 and runner_threads != loop_threads


def test_frames_that_wait_for_each_other_keep_the_runner_thread(
        prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """mtp on the CPU does not run ahead (its attention is planned on the host): one frame in
    flight, nothing for the loop to overlap, so the runner thread launches."""
    out, threads = serve(prompts, True, monkeypatch, speculator="mtp", num_speculative_tokens=3)
    assert threads != {threading.current_thread().name} and len(threads) == 1
    assert all(len(o) == 12 for o in out)


def test_a_launch_that_raises_on_the_loop_fails_after_the_frames_before_it(
        prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's launch hands its error to the frame's future, as the runner thread does: the
    frames before it are applied and streamed first, and the loop ends with that error."""
    streamed: list[list[int]] = []
    for on_loop in (True, False):
        counts: list[int] = []
        with pytest.raises(RuntimeError, match="launch failed"):
            serve(prompts, on_loop, monkeypatch, counts, fail_at=8)
        streamed.append(counts)
    assert streamed[0] == streamed[1] and streamed[0], "the same tokens reached the client before the failure"


class Gate:
    def __init__(self, blocks_host: bool) -> None:
        self.blocks_host = blocks_host


def decides(device: str, blocks_host: bool, depth: int, on: bool = True, runner: object | None = None) -> bool:
    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig(launch_on_loop=on)
    core.runner = ModelRunner.__new__(ModelRunner) if runner is None else runner  # type: ignore[assignment]
    core.device_apart = device != "cpu"
    core.platform = SimpleNamespace(host_gate=lambda: Gate(blocks_host))  # type: ignore[assignment]
    return core._launches_on_loop(depth)


def test_the_loop_launches_only_where_no_launch_can_wait() -> None:
    assert decides("cuda", blocks_host=False, depth=2)
    assert not decides("cuda", blocks_host=False, depth=2, on=False), "--no-launch-on-loop"
    assert not decides("cuda", blocks_host=False, depth=1), "frames that wait for each other: nothing to overlap"
    assert not decides("cuda", blocks_host=True, depth=2), "a gate the launching thread waits at, opened by the loop"
    assert not decides("cpu", blocks_host=False, depth=2), "a CPU launch runs the step"
    assert not decides("cuda", blocks_host=False, depth=2, runner=object()), "pipeline stages: launches are sends"


def test_a_landed_frame_is_taken_without_a_thread_hop(prompts: list[list[int]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame whose copy has reached the host by the time the loop gets to it is applied at once:
    no worker thread waits for it. Launched on the loop on the CPU, every frame has run by then;
    on the runner thread, the loop still waits on a thread for frames whose launch has not
    returned."""
    hops: list[str] = []
    to_thread = core_module.anyio.to_thread.run_sync

    async def counted(func, *args, **kwargs):  # type: ignore[no-untyped-def]
        if func is core_module._finish:
            hops.append(threading.current_thread().name)
        return await to_thread(func, *args, **kwargs)

    for on_loop in (True, False):
        hops.clear()
        monkeypatch.setattr(core_module.anyio.to_thread, "run_sync", counted)
        serve(prompts, on_loop, monkeypatch)  # undoes the patch as it ends
        assert (not hops) if on_loop else bool(hops), (on_loop, len(hops))
