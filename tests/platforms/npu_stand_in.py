"""A CPU-backed stand-in for `torch_npu`, so the Ascend platform's own code runs in CI: a fake
module installed into sys.modules, and the `torch.npu` device module it registers, answering from
the host (memory info is the host's, synchronize records what it was asked). Like torch_npu at
import, it names torch's private-use backend "npu", so `torch.device("npu", i)` parses; that
name stays for the rest of the process (torch cannot rename it back), which nothing else reads."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from speckernel.platforms.cpu import CpuPlatform


class FakeNpu(types.ModuleType):
    """torch.npu as the platform uses it: availability, count, memory, synchronize, device()."""

    def __init__(self, count: int) -> None:
        super().__init__("torch.npu")
        self.count = count
        self.synchronized: list[torch.device] = []
        self.entered: list[int] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def mem_get_info(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.count:
            raise RuntimeError(f"invalid device index {index}")
        return CpuPlatform().memory_info()

    def synchronize(self, device: torch.device | None = None) -> None:
        self.synchronized.append(torch.device(device) if device is not None else torch.device("npu", 0))

    @contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.entered.append(index)
        yield


def name_npu_backend() -> bool:
    """What torch_npu does at import; False where another backend already took the name."""
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")
        return True
    return name == "npu"


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNpu]:
    """Two stand-in NPUs for the test (`npu.count` changes how many the host has). The backend's
    name cannot be given back, so torch.npu stays afterwards with no device: torch then finds no
    accelerator, as on a host whose torch_npu sees no NPU, and the worker's next tests run as
    before (an optimizer's step asks torch.accelerator, which asks torch.npu)."""
    if not name_npu_backend():
        pytest.skip("torch's private-use backend is taken by another device type")
    npu = FakeNpu(count=2)
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.npu = npu  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    torch.npu = npu  # type: ignore[attr-defined]
    yield npu
    torch.npu = FakeNpu(count=0)  # type: ignore[attr-defined]
