"""Ascend NPU platform through `torch_npu`, imported only when the platform is used. Graphs
through torch.npu.NPUGraph where the installed torch_npu has it; the host gate waits on the
host (no stream-side host function yet)."""

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
                                        supports_graphs=True, priority=5,
                                        preferred_transports=("torch_dist",))
    graph_class = "NPUGraph"

    @classmethod
    def module(cls) -> Any:
        importlib.import_module("torch_npu")  # registers torch.npu
        return torch.npu  # type: ignore[attr-defined]

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("torch_npu") is not None and super().is_available()
