"""CUDA platform: bfloat16 by default, real streams and events, nccl for collectives."""

from __future__ import annotations

import torch

from speckernel.platform import PlatformCapabilities


class CudaPlatform:
    name = "cuda"
    capabilities = PlatformCapabilities(device_type="cuda", default_dtype="bfloat16",
                                        dist_backend="nccl", supports_graphs=True,
                                        supports_streams=True, priority=10)

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.index)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
