"""Shared body of platforms whose torch device module has the CUDA-style API (torch.cuda,
torch.npu): only how to reach the module and the capability struct differ."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from speckernel.platform import PlatformCapabilities


class TorchAcceleratorPlatform:
    name: ClassVar[str]
    capabilities: ClassVar[PlatformCapabilities]

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    def module(cls) -> Any:
        raise NotImplementedError

    @classmethod
    def is_available(cls) -> bool:
        return bool(cls.module().is_available())

    @property
    def device(self) -> torch.device:
        return torch.device(self.capabilities.device_type, self.index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return self.module().mem_get_info(self.index)

    def new_stream(self) -> Any:
        return self.module().Stream(self.device)

    def new_event(self) -> Any:
        return self.module().Event()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def synchronize(self) -> None:
        self.module().synchronize(self.device)

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.module().manual_seed_all(seed)
