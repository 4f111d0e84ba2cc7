"""`bench frontend`: the serving path's host work beyond the runner, an in-process AsyncEngine
over the core's real loop with a stand-in runner, on the CPU. Its figures are printed, never
asserted; what is asserted is that they measure what they say."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import anyio
import pytest

from speckernel.config import EngineConfig
from speckernel.sampling_params import SamplingParams
from speckernel.tools import cli
from speckernel.tools.bench.frontend import StandInCore, StandInEngine, StandInRunner, prompts_for


async def test_every_request_streams_whole_through_the_real_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request gets all its tokens, one step each, from frames the loop launched on its own
    thread; no weights are read."""
    launched_on: set[str] = set()
    launch = StandInRunner.launch

    def recorded(self, frame):  # type: ignore[no-untyped-def]
        launched_on.add(threading.current_thread().name)
        return launch(self, frame)

    monkeypatch.setattr(StandInRunner, "launch", recorded)
    config = EngineConfig(platform="cpu", in_process=True, max_num_seqs=4, max_model_len=256)
    async with StandInEngine(config) as engine:
        assert isinstance(engine._client.core, StandInCore)  # type: ignore[union-attr]
        outputs: list[list[int]] = []

        async def one(prompt: list[int]) -> None:
            streamed = [out async for out in engine.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True))]
            assert streamed[-1].finished
            outputs.append(streamed[-1].token_ids)

        async with anyio.create_task_group() as tg:
            for prompt in prompts_for(engine, 4):
                tg.start_soon(one, prompt)
        stats = await engine.stats()
    assert [len(o) for o in outputs] == [9] * 4
    assert launched_on == {threading.main_thread().name}
    assert stats["num_steps"] >= 9 and stats["device_s"] is None


def test_bench_frontend_writes_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["bench", "frontend", "--concurrency", "1,4", "--max-tokens", "16", "--num-prompts", "4",
            "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["speckernel", *argv])
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "frontend.json").read_text())
    assert report["scenario"] == "frontend" and report["launch_on_loop"] is True
    assert [r["concurrency"] for r in report["runs"]] == [1, 4]
    for r in report["runs"]:
        assert r["steps"] > 0 and r["rows_per_step"] > 0
        assert r["frontend_us"] == pytest.approx(r["step_us"] - sum(r["core_us"].values()))
        assert set(r["core_us"]) == {"schedule", "launch", "apply"}
    table = (tmp_path / "frontend.md").read_text()
    assert "| 4 |" in table and "frontend µs a row" in table
