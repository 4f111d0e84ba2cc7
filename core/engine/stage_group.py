"""Which process-group backend and device a pipeline stage takes.

A stage owns device LOCAL_RANK of its host where the host has a device per local stage; then
its group is `cpu:gloo,<device>:<backend>`: token frames (host tensors) travel on gloo and the
residual stream on the platform's backend (nccl, hccl), device to device. Where more stages
than devices share a host (PP=2 on one GPU), the platform's backend cannot serve them: NCCL
refuses two ranks on one device. Those stages run on gloo and stage the residual stream
through host memory (a few KB per token), which is what sharing one device costs anyway.
"""

from __future__ import annotations

import msgspec

from ..platform import Platform


class StageGroup(msgspec.Struct, frozen=True):
    backend: str
    """For torch.distributed.init_process_group."""
    device_index: int
    host_staged: bool
    """The residual stream goes device -> host -> gloo -> host -> device."""


def plan_group(platform: Platform, local_rank: int, local_world: int) -> StageGroup:
    backend = platform.capabilities.dist_backend
    if platform.capabilities.device_type == "cpu" or backend == "gloo":
        return StageGroup(backend, 0, host_staged=False)
    count = platform.device_count()
    if local_world > count:
        return StageGroup("gloo", local_rank % count, host_staged=True)
    return StageGroup(f"cpu:gloo,{platform.capabilities.device_type}:{backend}", local_rank, host_staged=False)
