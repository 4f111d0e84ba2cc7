"""Shared body of platforms whose torch device module has the CUDA-style API (torch.cuda,
torch.npu): only how to reach the module, the capability struct, the graph class and the host
gate differ."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

import torch

from speckernel.ops.paged_attention import PagedAttention, TorchPagedAttention, TritonPagedAttention
from speckernel.platform import (
    GATE_TIMEOUT_S,
    DeviceGraph,
    GraphCaptureUnsupportedError,
    HostGate,
    PlatformCapabilities,
    parse_dtype,
)
from speckernel.platforms.gate import HostWaitGate


class TorchAcceleratorPlatform:
    name: ClassVar[str]
    capabilities: ClassVar[PlatformCapabilities]
    graph_class: ClassVar[str]
    """The device module's graph class (CUDAGraph, NPUGraph), captured through `module().graph`."""
    kv_fraction: ClassVar[float] = 0.5
    """Share of the free device memory (weights already loaded) the KV cache takes; the rest is
    for activations and the allocator's slack."""

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
        return parse_dtype(self.capabilities.default_dtype)

    def device_count(self) -> int:
        return int(self.module().device_count())

    def on_device(self, index: int) -> TorchAcceleratorPlatform:
        if not 0 <= index < self.device_count():
            raise ValueError(f"platform {self.name!r}: no device {index} (this host has {self.device_count()})")
        return type(self)(index)

    def memory_info(self) -> tuple[int, int]:
        return self.module().mem_get_info(self.index)

    def kv_budget_bytes(self) -> int:
        free, _ = self.memory_info()
        return int(free * self.kv_fraction)

    def attention_backend(self, block_size: int, max_tokens: int, max_rows: int = 1,
                          max_blocks: int = 0, batch_invariant: bool = False) -> PagedAttention:
        cls = TritonPagedAttention if self.capabilities.triton else TorchPagedAttention
        return cls(block_size, max_tokens, self.device, pin_host=True, max_rows=max_rows, max_blocks=max_blocks,
                   batch_invariant=batch_invariant)

    def graph_capture(self, pool: object | None = None) -> AbstractContextManager[DeviceGraph]:
        module = self.module()
        graph_cls, capture = getattr(module, self.graph_class, None), getattr(module, "graph", None)
        if graph_cls is None or capture is None:
            raise GraphCaptureUnsupportedError(
                f"platform {self.name!r} cannot capture device graphs: torch.{self.capabilities.device_type} "
                f"has no {self.graph_class} or graph()")
        return _capturing(module, self.index, graph_cls(), capture, pool)

    def host_gate(self, timeout_s: float = GATE_TIMEOUT_S) -> HostGate:
        """The host-side gate; platforms whose stream can wait for the host override this."""
        return HostWaitGate(timeout_s)

    def synchronize(self) -> None:
        self.module().synchronize(self.device)


@contextmanager
def _capturing(module: Any, index: int, graph: DeviceGraph, capture: Any, pool: object | None) -> Iterator[DeviceGraph]:
    with module.device(index), capture(graph, pool=pool):
        yield graph
