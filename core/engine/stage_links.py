"""The tensor edges between pipeline stages on their torch.distributed group: p2p sends that do
not wait for the peer (a few stay in flight), receives the device waits for in stream order.
Stages sharing a device (on gloo) stage a tensor through host memory."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


class DistLink:
    MAX_PENDING = 4

    def __init__(self, group: Any, peer: int, device: torch.device, host_staged: bool = False) -> None:
        self.group, self.peer, self.device, self.host_staged = group, peer, device, host_staged
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous().to("cpu") if self.host_staged else tensor.contiguous()
        self.pending.append((self.group.send([tensor], self.peer, 0), tensor))
        while len(self.pending) > self.MAX_PENDING:
            self.pending.popleft()[0].wait()

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device="cpu" if self.host_staged else self.device)
        self.group.recv([out], self.peer, 0).wait()
        return out.to(self.device, non_blocking=True) if self.host_staged else out

    def close(self) -> None:
        """Waits for the sends still in flight (their peer receives them)."""
        while self.pending:
            self.pending.popleft()[0].wait()
