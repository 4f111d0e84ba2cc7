"""Host arrays to the device without the host waiting."""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` on the device, through pinned memory in a copy the host does not wait for: a copy
    from pageable memory waits for its stream, so for everything queued there first (a stream
    gate included). On the CPU, `a` itself."""
    host = torch.from_numpy(a)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
