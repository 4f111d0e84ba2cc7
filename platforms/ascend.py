"""Ascend NPU platform through `torch_npu`, imported only when the platform is used.

It declares what it can do today: no device graphs, since its attention backend (the torch one;
there is no Triton on the NPU here) plans each step on the host, and a graph needs a backend
whose kernels read the block tables on the device; the host gate waits on the host (no
stream-side host function yet). Its stages group on `cpu:gloo,npu:hccl`, or on gloo with the
residual stream staged through host memory where stages share one NPU
(`speckernel.engine.stage_group`). Its code paths run in CI against a CPU-backed stand-in for
`torch_npu` (tests/platforms/test_ascend.py); none has run on Ascend hardware (see README)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from speckernel.platform import PlatformCapabilities
from speckernel.platforms.accelerator import TorchAcceleratorPlatform


class AscendPlatform(TorchAcceleratorPlatform):
    name = "ascend"
    capabilities = PlatformCapabilities(device_type="npu", default_dtype="bfloat16", dist_backend="hccl",
                                        supports_graphs=False, priority=5,
                                        preferred_transports=("torch_dist",))
    graph_class = "NPUGraph"
    """Where graphs would come from (`graph_capture`), once an attention backend plans on the NPU."""

    @classmethod
    def module(cls) -> Any:
        importlib.import_module("torch_npu")  # registers torch.npu
        return torch.npu  # type: ignore[attr-defined]

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("torch_npu") is not None and super().is_available()
