"""The platform plugin contract: what the kernel needs from a device runtime.

A platform is a class registered under the `speckernel.platforms` entry point. The kernel
reads its frozen capability struct and calls only the methods below, so it never branches on
a device's name and never patches torch. Vendor SDKs are imported lazily, inside the methods
that need them: every platform imports (and its tests run) without its SDK.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from .attention import AttentionBackend
from .errors import InvalidInputError, SpeckernelError

if TYPE_CHECKING:  # annotations only: a platform's class loads without torch (the frontend checks it)
    import torch


class PlatformCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    device_type: str
    """torch device type: cpu, cuda, npu."""
    default_dtype: str
    """Model dtype when the user names none (a key of DTYPES)."""
    dist_backend: str
    """torch.distributed backend: gloo, nccl or hccl."""
    supports_graphs: bool = False
    """`graph_capture` works here."""
    triton: bool = False
    """Triton kernels run here natively."""
    packed_weights: bool = False
    """The model's linear weights are packed once for oneDNN here (`speckernel.ops.packed_linear`),
    where that torch has oneDNN and the weights' second copy fits the free memory."""
    priority: int = 0
    """Automatic selection takes the available platform with the highest priority."""
    preferred_transports: tuple[str, ...] = ("zmq",)
    """Transport entry-point names for the links between pipeline stages, best first: the engine
    takes the first one installed unless configuration names one (`pipeline_transport`). The
    default works wherever processes on the host (or across hosts) reach each other."""


class GraphCaptureUnsupportedError(SpeckernelError, NotImplementedError):
    """This platform cannot capture device graphs; check `capabilities.supports_graphs` first."""


class DeviceGraph(Protocol):
    """A captured sequence of device work."""

    def replay(self) -> None:
        """Runs the captured work again, on the same memory."""
        ...

    def pool(self) -> object:
        """Its memory pool: pass it to the next `graph_capture` so graphs share one pool."""
        ...


class HostGate(Protocol):
    """Makes device work issued after `enqueue()` wait until the host calls `open()`.

    The runner calls enqueue() at the point in stream order where gated work starts, wait()
    right before it issues that work, and open() once the host has written what the work
    reads. Where the stream itself can wait for the host, wait() returns at once and the host
    never stalls; elsewhere wait() blocks the issuing thread. A gate is used once, and opens by
    itself after its timeout (setting `timed_out` and logging it), so a lost open() stalls the
    device for a while, never forever.
    """

    timed_out: bool
    blocks_host: bool
    """wait() blocks the issuing thread (the stream cannot wait for the host): whoever issues
    gated work must not be the thread that opens the gate."""
    opened_at: float
    """perf_counter() when open() was first called (0: not yet)."""
    blocked_at: float
    """perf_counter() when the gated work reached the gate (0: not yet)."""
    passed_at: float
    """perf_counter() when the gated work went on (0: not yet): passed_at - blocked_at is how
    long the device (or the issuing thread) was held."""

    def enqueue(self) -> None: ...

    def wait(self) -> None: ...

    def open(self) -> None: ...


GATE_TIMEOUT_S = 30.0
"""A gate spans one step's host work (milliseconds); one still shut after this is a bug."""


@runtime_checkable
class Platform(Protocol):
    name: str
    capabilities: PlatformCapabilities

    @classmethod
    def is_available(cls) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    def default_dtype(self) -> torch.dtype: ...

    def device_count(self) -> int:
        """Devices of this platform's kind on the host (1 for the CPU): a process per device can
        own one; more processes than devices share them (pipeline stages on one GPU)."""
        ...

    def on_device(self, index: int) -> Platform:
        """The same platform on device `index` of this host (a stage process takes its
        LOCAL_RANK's device, as torchrun numbers them)."""
        ...

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache is carved from."""
        ...

    def kv_budget_bytes(self) -> int:
        """Bytes for the paged KV cache (target and draft) when the user gives no budget."""
        ...

    def attention_backend(self, block_size: int, max_tokens: int, max_rows: int = 1,
                          max_blocks: int = 0, batch_invariant: bool = False) -> AttentionBackend:
        """A fresh backend sized for steps of up to `max_tokens` tokens and `max_rows` rows, with
        block tables `max_blocks` wide (0: as wide as each step needs); one per model, since a
        backend's metadata lives only until its next prepare(). Where `capabilities.triton`,
        the project's Triton kernels run attention. `batch_invariant`: each query token's output
        does not depend on the rest of the step (`EngineConfig.batch_invariant`)."""
        ...

    def graph_capture(self, pool: object | None = None) -> AbstractContextManager[DeviceGraph]:
        """`with platform.graph_capture() as graph:` captures the device work of the block into
        `graph` instead of running it. Raises GraphCaptureUnsupportedError where graphs are not
        supported."""
        ...

    def host_gate(self, timeout_s: float = GATE_TIMEOUT_S) -> HostGate: ...

    def synchronize(self) -> None:
        """Waits for all work issued to the device (benchmarks time device work with it)."""
        ...


DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # fmt: skip
"""A dtype name → the torch dtype's attribute name (names only: the contract imports without torch)."""


def parse_dtype(name: str) -> torch.dtype:
    import torch  # here, not at the top: a platform's class loads without torch (the frontend checks it)

    try:
        dtype: torch.dtype = getattr(torch, DTYPES[name])
    except KeyError:
        raise InvalidInputError(f"unknown dtype {name!r}; available: {', '.join(DTYPES)}") from None
    return dtype
