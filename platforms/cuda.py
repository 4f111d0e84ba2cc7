"""CUDA platform: bfloat16 by default, real streams and events, nccl for collectives."""

from __future__ import annotations

from typing import Any

import torch

from speckernel.platform import PlatformCapabilities

from .accelerator import TorchAcceleratorPlatform


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    capabilities = PlatformCapabilities(device_type="cuda", default_dtype="bfloat16",
                                        dist_backend="nccl", supports_graphs=True,
                                        supports_streams=True, priority=10)

    @classmethod
    def module(cls) -> Any:
        return torch.cuda
