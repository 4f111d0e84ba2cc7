"""Host arrays for host-to-device copies the host never waits for.

A copy from pageable memory waits for its stream (for everything queued there first), so a
step's numbers go through pinned buffers instead, in a ring: the host stages step N+1 while step
N's copy may still wait in the stream, and a buffer is rewritten only after the event recorded
behind its last copy has passed. With `size` buffers and at most two steps in flight, that wait
is over before it starts.
"""

from __future__ import annotations

import torch


class StagingRing:
    def __init__(self, device: torch.device, dtype: torch.dtype, pinned: bool, size: int = 4) -> None:
        self.device = device
        self.dtype = dtype
        self.pinned = pinned
        """False (the CPU): a fresh array each time, copied before `take` returns another."""
        self.size = size
        self._ring: list[tuple[torch.Tensor, torch.Event | None]] = []
        self._turn = 0

    def take(self, total: int, min_capacity: int = 0) -> torch.Tensor:
        """A host array of `total` elements that no pending copy still reads; a buffer that
        grows takes at least min_capacity elements, so it seldom grows again."""
        if not self.pinned:
            return torch.empty(total, dtype=self.dtype)
        self._turn = (self._turn + 1) % self.size
        while len(self._ring) <= self._turn:
            self._ring.append((torch.empty(0, dtype=self.dtype), None))
        buffer, event = self._ring[self._turn]
        if event is not None:
            event.synchronize()
        if buffer.numel() < total:
            buffer = torch.empty(max(total, min_capacity), dtype=self.dtype, pin_memory=True)
            self._ring[self._turn] = (buffer, None)
        return buffer[:total]

    def copied(self) -> None:
        """Records, behind the copy just issued from the latest `take`, when its buffer is free again."""
        if self.pinned:
            event = torch.Event(self.device)
            event.record()
            self._ring[self._turn] = (self._ring[self._turn][0], event)
