"""The platform plugin contract: what the kernel needs from a device runtime.

A platform is a class registered under the `speckernel.platforms` entry point. The kernel
reads its frozen capability struct and calls only the methods below; it never patches torch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec
import torch


class PlatformCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    device_type: str
    default_dtype: str
    dist_backend: str
    """torch.distributed backend: gloo, nccl or hccl."""
    supports_graphs: bool = False
    supports_streams: bool = False
    priority: int = 0
    """Automatic selection takes the available platform with the highest priority."""


@runtime_checkable
class Platform(Protocol):
    name: str
    capabilities: PlatformCapabilities

    @classmethod
    def is_available(cls) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    def default_dtype(self) -> torch.dtype: ...

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache is carved from."""
        ...

    def new_stream(self) -> object: ...

    def new_event(self) -> object: ...

    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def synchronize(self) -> None: ...

    def seed_all(self, seed: int) -> None: ...


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fmt: skip


def parse_dtype(name: str) -> torch.dtype:
    from .errors import InvalidInputError

    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidInputError(f"unknown dtype {name!r}; available: {', '.join(DTYPES)}") from None
