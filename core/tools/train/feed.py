"""Training batches onto the device without making it wait for the host.

A pageable host-to-device copy holds the host until the copy has run, and the copy runs after
every kernel queued before it: a host sync at the start of every step. Here each batch goes
through pinned memory, copied non-blocking on a side stream one batch ahead, so the next
batch is built and copied while the device still runs the step before it, and the host keeps
queueing work. Building a batch ahead loses nothing when a run stops: each step's batch is a
function of the seed and the step (`data.step_batches`), so a resumed run builds it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceBatch:
    """One training batch on the device, and what the host knows of it without asking the device."""

    tokens: torch.Tensor
    """[B, T] int64."""
    mask: torch.Tensor
    """[B, T] bool: positions whose label counts."""
    counted: int
    """How many entries of mask are True (training tokens), counted on the host."""


class DeviceFeed:
    """Batches from host arrays (`data.batches`), each copied while the step before it runs: on
    CUDA from pinned memory on a side stream, which the consuming stream then waits for on the
    device (an event, not a host wait); elsewhere a plain copy."""

    def __init__(self, source: Iterator[tuple[np.ndarray, np.ndarray]], device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: tuple[DeviceBatch, torch.cuda.Event | None] | None = None

    def _start(self) -> tuple[DeviceBatch, torch.cuda.Event | None]:
        """The next host batch, its copy under way."""
        tokens, mask = next(self.source)
        counted = int(np.count_nonzero(mask))
        host = torch.from_numpy(tokens), torch.from_numpy(mask)
        if self.stream is None:
            return DeviceBatch(host[0].to(self.device), host[1].to(self.device), counted), None
        # The pinned buffers come from the caching host allocator, which keeps them until the copy is done.
        pinned = [t.pin_memory() for t in host]
        with torch.cuda.stream(self.stream):
            moved = [t.to(self.device, non_blocking=True) for t in pinned]
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return DeviceBatch(moved[0], moved[1], counted), copied

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> DeviceBatch:
        batch, copied = self.ahead if self.ahead is not None else self._start()
        if copied is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            for t in (batch.tokens, batch.mask):  # made on the side stream, used and freed on this one
                t.record_stream(current)
        self.ahead = self._start()
        return batch
