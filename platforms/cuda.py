"""CUDA platform: bfloat16 by default, nccl for collectives, CUDA graphs, and a host gate that
the stream itself waits on (cudaLaunchHostFunc through cuda-bindings, imported lazily)."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import torch

from speckernel.platform import GATE_TIMEOUT_S, HostGate, PlatformCapabilities
from speckernel.platforms.accelerator import TorchAcceleratorPlatform
from speckernel.platforms.gate import HostWaitGate


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    capabilities = PlatformCapabilities(device_type="cuda", default_dtype="bfloat16", dist_backend="nccl",
                                        supports_graphs=True, triton=importlib.util.find_spec("triton") is not None,
                                        priority=10, preferred_transports=("cuda_ipc", "torch_dist"))
    graph_class = "CUDAGraph"

    @classmethod
    def module(cls) -> Any:
        return torch.cuda

    def host_gate(self, timeout_s: float = GATE_TIMEOUT_S) -> HostGate:
        """The stream waits when cuda-bindings is installed; the issuing thread otherwise."""
        launcher = _host_funcs()
        return HostWaitGate(timeout_s) if launcher is None else StreamGate(timeout_s, launcher, self.device)


class StreamGate(HostWaitGate):
    """enqueue() puts on the current stream a host function that blocks until open(): the
    stream waits and the host goes on. CUDA runs a process's host functions on one thread, so a
    shut gate also delays other host functions, never other streams' kernels."""

    blocks_host = False

    def __init__(self, timeout_s: float, launcher: _HostFuncs, device: torch.device) -> None:
        super().__init__(timeout_s)
        self._launcher, self._device = launcher, device

    def enqueue(self) -> None:
        self._launcher.launch(torch.cuda.current_stream(self._device).cuda_stream, self.block)

    def wait(self) -> None:
        """The stream waits, not the host."""


class _HostFuncs:
    """Runs Python callables in stream order (cudaLaunchHostFunc). One ctypes trampoline serves
    the process and lives as long as it, since the driver may call it after any gate is gone;
    each launch passes the key of the callable to run."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.pending: dict[int, Callable[[], None]] = {}
        self.keys = itertools.count(1)
        self.trampoline = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._run)
        self.host_fn = runtime.cudaHostFn_t(_ptr=ctypes.addressof(self.trampoline))

    def _run(self, key: int) -> None:
        """On CUDA's callback thread: must not call CUDA; holds the GIL only while not waiting."""
        self.pending.pop(key)()

    def launch(self, stream: int, fn: Callable[[], None]) -> None:
        key = next(self.keys)
        self.pending[key] = fn
        (err,) = self.runtime.cudaLaunchHostFunc(self.runtime.cudaStream_t(stream), self.host_fn, key)
        if err != self.runtime.cudaError_t.cudaSuccess:
            del self.pending[key]
            raise RuntimeError(f"cudaLaunchHostFunc failed: {err!r}")


@functools.cache
def _host_funcs() -> _HostFuncs | None:
    try:
        runtime = importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        return None
    return _HostFuncs(runtime)
