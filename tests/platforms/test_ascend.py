"""The Ascend platform's own code against a CPU-backed stand-in for torch_npu
(`tests/platforms/npu_stand_in.py`): device selection, the stages' group (hccl across NPUs,
gloo with host staging where stages share one, formed for real), memory info, the host gate,
and capabilities that claim only what runs today. None of it has run on Ascend hardware."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from speckernel import registry
from speckernel.engine.stage_group import plan_group
from speckernel.frontend.dp_client import free_port
from speckernel.platforms.ascend import AscendPlatform
from speckernel.platforms.cpu import CpuPlatform
from speckernel.platforms.gate import HostWaitGate
from tests.platforms.npu_stand_in import FakeNpu, torch_npu

__all__ = ["torch_npu"]  # the fixture, used by name below


def test_device_selection(torch_npu: FakeNpu) -> None:
    assert AscendPlatform.is_available()
    platform = registry.pick_platform("ascend")
    assert type(platform) is AscendPlatform and platform.device == torch.device("npu", 0)
    assert platform.device_count() == 2 and platform.on_device(1).device == torch.device("npu", 1)
    with pytest.raises(ValueError, match="no device 2 \\(this host has 2\\)"):
        platform.on_device(2)
    if not torch.cuda.is_available():  # ascend outranks cpu, cuda outranks ascend
        assert type(registry.pick_platform()) is AscendPlatform
    platform.on_device(1).synchronize()
    assert torch_npu.synchronized == [torch.device("npu", 1)]
    torch_npu.count = 0
    assert not AscendPlatform.is_available()


def test_memory_info_and_the_kv_budget_come_from_the_device_module(torch_npu: FakeNpu) -> None:
    platform = AscendPlatform()
    free, total = platform.memory_info()
    assert (free, total) == CpuPlatform().memory_info() and 0 < free <= total
    assert platform.kv_budget_bytes() == int(free * AscendPlatform.kv_fraction)
    with pytest.raises(RuntimeError, match="invalid device index"):
        AscendPlatform(index=5).memory_info()


def test_no_graph_claim_while_attention_plans_on_the_host(torch_npu: FakeNpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph replays one plan; a backend planned on the host cannot serve it, so the engine
    would never capture one here: the platform must not say it can."""
    monkeypatch.setattr(AscendPlatform, "device", property(lambda self: torch.device("cpu")))  # CPU-backed
    backend = AscendPlatform().attention_backend(16, 64, max_rows=4, max_blocks=4)
    assert not backend.device_planned
    assert AscendPlatform.capabilities.supports_graphs is False
    assert registry.describe()["platforms"]["ascend"]["supports_graphs"] is False  # what `speckernel plugins` shows


def test_stages_group_on_hccl_across_npus_and_fall_back_to_gloo_on_a_shared_one(torch_npu: FakeNpu) -> None:
    platform = AscendPlatform()
    for rank in range(2):  # one NPU per stage: frames on gloo, the residual stream on hccl
        group = plan_group(platform, rank, 2)
        assert (group.backend, group.device_index, group.host_staged) == ("cpu:gloo,npu:hccl", rank, False)
    torch_npu.count = 1  # two stages on one NPU: hccl would refuse two ranks on one device
    groups = [plan_group(platform, rank, 2) for rank in range(2)]
    assert [(g.backend, g.device_index, g.host_staged) for g in groups] == [("gloo", 0, True)] * 2
    # The fallback group forms, and carries a residual staged through host memory.
    port, got = free_port(), [None, None]

    def stage(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        pg: Any = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
        hidden = torch.full((3, 4), float(rank + 1))
        if rank == 0:
            pg.send([hidden], 1, 0).wait()
        else:
            pg.recv([hidden], 0, 0).wait()
        got[rank] = hidden

    threads = [threading.Thread(target=stage, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[1] is not None and torch.equal(got[1], torch.ones(3, 4))


def test_the_host_gate_holds_the_issuing_thread_until_opened(torch_npu: FakeNpu) -> None:
    gate = AscendPlatform().host_gate(timeout_s=10.0)
    assert type(gate) is HostWaitGate  # no stream-side host function on the NPU yet
    gate.enqueue()
    waiter = threading.Thread(target=gate.wait)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive(), "the gate let the issuing thread through before it was opened"
    gate.open()
    waiter.join(5)
    assert not waiter.is_alive() and not gate.timed_out and gate.passed_at >= gate.opened_at
    late = AscendPlatform().host_gate(timeout_s=0.05)
    late.enqueue()
    late.wait()
    assert late.timed_out
