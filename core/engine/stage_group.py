"""Which device a pipeline stage takes, and which torch.distributed backend its links may use.

A stage owns device LOCAL_RANK of its host where the host has a device per local stage; then a
transport built on torch.distributed may move tensors on the platform's backend (nccl, hccl),
device to device. Where more stages than devices share a host (PP=2 on one GPU), the platform's
backend cannot serve them (NCCL refuses two ranks on one device): their links get gloo, which
stages tensors through host memory, unless the transport needs no backend (cuda_ipc).
"""

from __future__ import annotations

import msgspec

from ..platform import Platform


class StageGroup(msgspec.Struct, frozen=True):
    backend: str
    """A torch.distributed backend string for a group of these stages (`cpu:gloo,cuda:nccl`)."""
    device_index: int
    host_staged: bool
    """The device backend cannot serve these stages: a link on torch.distributed uses gloo
    (device -> host -> gloo -> host -> device)."""


def plan_group(platform: Platform, local_rank: int, local_world: int) -> StageGroup:
    backend = platform.capabilities.dist_backend
    if platform.capabilities.device_type == "cpu" or backend == "gloo":
        return StageGroup(backend, 0, host_staged=False)
    count = platform.device_count()
    if local_world > count:
        return StageGroup("gloo", local_rank % count, host_staged=True)
    return StageGroup(f"cpu:gloo,{platform.capabilities.device_type}:{backend}", local_rank, host_staged=False)
