"""CPU platform: float32, gloo for collectives; work runs in issue order on the calling thread."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar

from speckernel.platform import (
    GATE_TIMEOUT_S,
    DeviceGraph,
    GraphCaptureUnsupportedError,
    PlatformCapabilities,
    parse_dtype,
)
from speckernel.platforms.gate import HostWaitGate

if TYPE_CHECKING:  # torch loads where the platform is used, not where it is checked (the frontend)
    import torch

    from speckernel.ops.paged_attention import PagedAttention


class CpuPlatform:
    name = "cpu"
    capabilities = PlatformCapabilities(device_type="cpu", default_dtype="float32", dist_backend="gloo", priority=0,
                                        preferred_transports=("zmq", "torch_dist"), packed_weights=True)
    kv_budget_cap: ClassVar[int] = 1 << 30
    """The KV cache shares host memory with everything else: take at most this, and at most a
    quarter of what is free."""

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        import torch  # here, not at the top: the frontend loads this class to check it, without torch

        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return parse_dtype(self.capabilities.default_dtype)

    def device_count(self) -> int:
        return 1

    def on_device(self, index: int) -> CpuPlatform:
        """The host is one device whatever the index: every process shares it."""
        return self

    def memory_info(self) -> tuple[int, int]:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * size
        return pages * size, total

    def kv_budget_bytes(self) -> int:
        free, _ = self.memory_info()
        return min(self.kv_budget_cap, free // 4)

    def attention_backend(self, block_size: int, max_tokens: int, max_rows: int = 1,
                          max_blocks: int = 0, batch_invariant: bool = False) -> PagedAttention:
        from speckernel.ops.paged_attention import TorchPagedAttention, TritonPagedAttention  # torch: see device

        cls = TritonPagedAttention if self.capabilities.triton else TorchPagedAttention
        return cls(block_size, max_tokens, self.device, pin_host=False, max_rows=max_rows, max_blocks=max_blocks,
                   batch_invariant=batch_invariant)

    def graph_capture(self, pool: object | None = None) -> AbstractContextManager[DeviceGraph]:
        raise GraphCaptureUnsupportedError("platform 'cpu' cannot capture device graphs "
                                           "(capabilities.supports_graphs is False)")

    def host_gate(self, timeout_s: float = GATE_TIMEOUT_S) -> HostWaitGate:
        return HostWaitGate(timeout_s)

    def synchronize(self) -> None:
        """CPU ops have finished when they return."""
