"""Pipeline faults: a killed or stopped (SIGSTOP: no beats) stage fails every pending request
with EngineDeadError naming it within 5 s and leaves no process behind; bad pipeline values
fail before any weight loads."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from speckernel import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from speckernel.engine.check import check, check_pipeline
from speckernel.engine.stage_links import transport_name
from speckernel.errors import InvalidInputError, UnknownPluginError
from speckernel.platforms.cpu import CpuPlatform
from speckernel.plugin import SpeculatorCapabilities
from tests.conftest import exited

pytestmark = pytest.mark.timing  # a dead stage is named within 5 s

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "said"), [(signal.SIGKILL, "exited with code"),
                                           (signal.SIGSTOP, "stopped answering")], ids=["killed", "stopped"])
async def test_killed_or_stopped_stage_fails_every_request_naming_it(sig: int, said: str) -> None:
    config = EngineConfig(platform="cpu", max_model_len=512, max_num_seqs=4, pipeline_parallel_size=2)
    engine = AsyncEngine(config)
    await engine.__aenter__()
    try:
        core_pid = engine._client.proc.pid  # type: ignore[union-attr]
        stages = [p for p in children(core_pid) if b"stage_process" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(stages) == 2, stages
        started = anyio.Event()
        results: dict[int, Any] = {}
        killed_at: list[float] = []

        async def one(i: int) -> None:
            try:
                async for _ in engine.generate([1, 2, 3, 4 + i], LONG):
                    started.set()
            except EngineDeadError as e:
                results[i] = (e, time.monotonic())
            else:
                results[i] = ("finished", time.monotonic())

        with anyio.fail_after(60):  # a missed death would leave the requests waiting for ever
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                await started.wait()
                await anyio.sleep(0.3)
                os.kill(stages[1], sig)
                killed_at.append(time.monotonic())
        for _i, (err, when) in results.items():
            assert isinstance(err, EngineDeadError), err
            assert "pipeline stage 1" in str(err) and said in str(err), err
            assert when - killed_at[0] < 5.0
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(exited(p) for p in [*stages, core_pid]):
            await anyio.sleep(0.1)
        assert all(exited(p) for p in [*stages, core_pid]), "a process was left behind"
    finally:
        await engine.shutdown()


class RemoteDrafter:
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=4, placement="remote")


def test_bad_pipeline_values_fail_before_weights() -> None:
    with pytest.raises(InvalidInputError, match="at most one stage per layer"):
        check(EngineConfig(platform="cpu", pipeline_parallel_size=31))
    with pytest.raises(InvalidInputError, match="pipeline_parallel_size: expected"):
        check(EngineConfig(platform="cpu", pipeline_parallel_size=0))
    with pytest.raises(InvalidInputError, match="placement 'remote'"):
        check_pipeline(EngineConfig(platform="cpu", pipeline_parallel_size=2, speculator="x"), 30, RemoteDrafter)
    check_pipeline(EngineConfig(platform="cpu", pipeline_parallel_size=1, speculator="x"), 30, None)
    with pytest.raises(InvalidInputError, match="reads the target's KV cache"):
        check(EngineConfig(platform="cpu", pipeline_parallel_size=2, speculator="causal_cascade"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(InvalidInputError, match=f"pipeline_port {port}"):
            check(EngineConfig(platform="cpu", pipeline_parallel_size=2, pipeline_port=port))
    with pytest.raises(UnknownPluginError, match=r"unknown transport 'carrier-pigeon'; available: .*torch_dist"):
        check(EngineConfig(platform="cpu", pipeline_parallel_size=2, pipeline_transport="carrier-pigeon"))


def test_the_transport_is_configurations_else_the_platforms_first_installed() -> None:
    """The engine names no transport: configuration does, or the platform's preference does,
    skipping names not installed; one that links a single process only cannot carry stages."""
    cpu = CpuPlatform.capabilities
    assert transport_name(EngineConfig(), cpu) == cpu.preferred_transports[0]
    assert transport_name(EngineConfig(pipeline_transport="torch_dist"), cpu) == "torch_dist"
    prefers = msgspec.structs.replace(cpu, preferred_transports=("not-installed", "torch_dist"))
    assert transport_name(EngineConfig(), prefers) == "torch_dist"
    with pytest.raises(InvalidInputError, match=r"none of the transports .* installed"):
        transport_name(EngineConfig(), msgspec.structs.replace(cpu, preferred_transports=("not-installed",)))
    with pytest.raises(InvalidInputError, match="one process only"):
        transport_name(EngineConfig(pipeline_transport="inproc"), cpu)
