"""Ascend NPU platform through `torch_npu`, imported only when the platform is used."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from speckernel.platform import PlatformCapabilities


def _npu() -> Any:
    importlib.import_module("torch_npu")  # registers torch.npu
    return torch.npu  # type: ignore[attr-defined]


class AscendPlatform:
    name = "ascend"
    capabilities = PlatformCapabilities(device_type="npu", default_dtype="bfloat16",
                                        dist_backend="hccl", supports_graphs=True,
                                        supports_streams=True, priority=5)

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        return bool(_npu().is_available())

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return _npu().mem_get_info(self.index)

    def new_stream(self) -> Any:
        return _npu().Stream(self.device)

    def new_event(self) -> Any:
        return _npu().Event()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def synchronize(self) -> None:
        _npu().synchronize(self.device)

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        _npu().manual_seed_all(seed)
