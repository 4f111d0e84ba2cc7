"""Where the engine core's host time goes: scheduling a frame (the grammars' masks included),
launching it (the runner's plan, its copy to the device, the graph replay or the eager
launches), applying its result (the ledger, the governor) and the masks of grammar rows run
ahead, computed once the frame before them is applied (`runner.late_masks`). With the rows launched, `bench
decode` turns these into host time per step and per row beside the step period, which is what
says whether the host or the device sets the pace at high concurrency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("schedule", "launch", "apply", "masks")


class HostTimes:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_rows = 0
        """Rows of the frames launched."""

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started

    def stats(self) -> dict[str, object]:
        return {"host_s": dict(self.seconds), "num_rows_launched": self.num_rows}
