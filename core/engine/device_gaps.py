"""How long the device waits for the host between two steps.

When the frame just applied was the only one in flight, the device has nothing queued from its
result until the next frame's launch returns: applying the result, scheduling, the grammar's
masks and the step's plan all sit there. That stretch is what structured output (a constrained
row waits for its frame) and any request that cannot run ahead pay on every step. Where a launch
runs the step itself (the CPU), the gap includes the step.
"""

from __future__ import annotations

import time


class DeviceGaps:
    def __init__(self) -> None:
        self.total_s = 0.0
        self.count = 0
        self._since: float | None = None

    def applied(self, still_in_flight: int) -> None:
        """A result came back; with nothing else in flight the device idles from here."""
        self._since = time.perf_counter() if still_in_flight == 0 else None

    def launched(self) -> None:
        """A frame's launch returned: the device has work again."""
        since, self._since = self._since, None
        if since is not None:
            self.total_s += time.perf_counter() - since
            self.count += 1

    def no_work(self) -> None:
        """Nothing to schedule: the wait that follows is the clients', not the host's."""
        self._since = None

    def stats(self) -> dict[str, float | int]:
        return {"num_device_gaps": self.count, "device_gap_s": self.total_s}
