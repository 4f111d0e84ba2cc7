"""Which backend and device a pipeline stage takes: its own device where the host has one per
stage, gloo with the residual stream staged through host memory where stages share a device."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from speckernel.engine.stage_group import StageGroup, plan_group
from speckernel.platform import PlatformCapabilities
from speckernel.platforms.cpu import CpuPlatform


def accelerator(devices: int, backend: str = "nccl") -> Any:
    caps = PlatformCapabilities(device_type="cuda", default_dtype="bfloat16", dist_backend=backend)
    return SimpleNamespace(capabilities=caps, device_count=lambda: devices)


def test_cpu_stages_share_the_host_on_gloo() -> None:
    assert plan_group(CpuPlatform(), 3, 4) == StageGroup("gloo", 0, host_staged=False)


@pytest.mark.parametrize(("local_rank", "local_world", "devices", "want"), [
    (1, 2, 2, StageGroup("cpu:gloo,cuda:nccl", 1, host_staged=False)),  # a device per stage
    (0, 4, 8, StageGroup("cpu:gloo,cuda:nccl", 0, host_staged=False)),
    (1, 2, 1, StageGroup("gloo", 0, host_staged=True)),  # two stages on one GPU: NCCL refuses that
    (3, 4, 2, StageGroup("gloo", 1, host_staged=True)),
])
def test_accelerator_stages(local_rank: int, local_world: int, devices: int, want: StageGroup) -> None:
    assert plan_group(accelerator(devices), local_rank, local_world) == want

