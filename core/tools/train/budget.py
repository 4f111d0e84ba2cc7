"""`train-drafter --minutes`: one deadline for the whole run, shared out between its phases.

The clock starts when the command does. Generating data may take `--data-share` of the time
when training follows (all of it with `--generate-only`); training steps until the deadline
less a reserve for writing the checkpoint, and a step, or a held-out measurement, starts only
when its expected length still fits. So a run ends near its deadline with a checkpoint saved,
whatever the host's speed, instead of overrunning by a phase.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

SAVE_RESERVE_S = 3.0
SAVE_RESERVE_SHARE = 0.05
SAVE_RESERVE_MAX_SHARE = 0.25
"""Time kept for the final save (checkpoint, state.pt, train_log.json, loss.png): the larger of
SAVE_RESERVE_S and SAVE_RESERVE_SHARE of the run, so a long run keeps more for a larger log and
a busy host; never more than SAVE_RESERVE_MAX_SHARE of it, so a run of seconds still trains."""


class Budget:
    """The run's deadline (`--minutes`, 0: none) and what each phase may use of it."""

    def __init__(self, minutes: float, data_share: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.seconds = 60.0 * minutes
        self.data_share = data_share
        self.end = self.start + self.seconds if minutes else math.inf
        self.reserve = min(max(SAVE_RESERVE_S, SAVE_RESERVE_SHARE * self.seconds),
                           SAVE_RESERVE_MAX_SHARE * self.seconds)

    @property
    def limited(self) -> bool:
        return math.isfinite(self.end)

    def data_deadline(self, training_follows: bool) -> float:
        """When generating data stops (time.monotonic()): its share of the run when training
        follows, else the run's end."""
        if not self.limited or not training_follows:
            return self.end
        return self.start + self.data_share * self.seconds

    @property
    def training_end(self) -> float:
        """When training must have stopped, leaving the reserve to save."""
        return self.end - self.reserve

    def left(self) -> float:
        """Seconds to the deadline (inf without one)."""
        return self.end - self.clock()

    def fits(self, seconds: float) -> bool:
        """Whether work expected to take `seconds`, started now, ends before training must stop."""
        return self.clock() + seconds <= self.training_end
