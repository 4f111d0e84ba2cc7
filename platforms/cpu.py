"""CPU platform: float32, host events stand in for streams, gloo for collectives."""

from __future__ import annotations

import os
import threading

import torch

from speckernel.platform import PlatformCapabilities


class HostStream:
    """CPU work is issued in order on the calling thread; a stream is only a name for it."""

    def wait_event(self, event: threading.Event) -> None:
        event.wait()


class CpuPlatform:
    name = "cpu"
    capabilities = PlatformCapabilities(device_type="cpu", default_dtype="float32",
                                        dist_backend="gloo", priority=0)

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def memory_info(self) -> tuple[int, int]:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * size
        return pages * size, total

    def new_stream(self) -> HostStream:
        return HostStream()

    def new_event(self) -> threading.Event:
        return threading.Event()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def synchronize(self) -> None:
        return None

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
