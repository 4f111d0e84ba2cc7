"""Turns drafting off while verification does not pay, by measurement.

Whether drafts pay depends on the batch: verifying 1+K tokens a row is nearly free while a
step is bound by reading weights (small batches on a GPU) and costs up to (1+K)x once it is
bound by compute (large batches, or a CPU). The governor keeps, per batch-size bucket, a
moving average of the tokens per second of steps that verified drafts and of steps that did
not, and lets the scheduler draft only while the first is not slower than the second by more
than `margin`, once it has measured enough steps of both kinds. After that it still probes
the other way once every `explore_every` steps of the bucket, so both estimates follow the
workload. Greedy output never depends on it: a K=0 step only decides whether drafts exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(rows: int) -> int:
    """Batch sizes that cost alike share an estimate: 1, 2, 4, 8, ..."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Estimate:
    drafted: float | None = None
    plain: float | None = None
    num_drafted: int = 0
    num_plain: int = 0
    steps: int = 0


@dataclass
class SpecGovernor:
    margin: float = 0.1
    explore_every: int = 32
    min_samples: int = 8
    """Steps of each kind a bucket must have measured before drafting may be turned off."""
    smoothing: float = 0.2
    """Weight of the newest step in the moving averages."""
    estimates: dict[int, _Estimate] = field(default_factory=dict)
    num_vetoed: int = 0
    """Steps the governor turned into K=0 steps."""

    def record(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """One applied step: its rows, whether it verified drafts, tokens it confirmed, and its
        wall time."""
        if rows <= 0 or seconds <= 0:
            return
        est = self.estimates.setdefault(bucket(rows), _Estimate())
        rate = tokens / seconds
        old = est.drafted if verified else est.plain
        new = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
        if verified:
            est.drafted, est.num_drafted = new, est.num_drafted + 1
        else:
            est.plain, est.num_plain = new, est.num_plain + 1

    def allow(self, rows: int) -> bool:
        """May the step being scheduled (with this many rows) propose drafts?"""
        est = self.estimates.setdefault(bucket(rows), _Estimate())
        est.steps += 1
        explore = est.steps % self.explore_every == 0
        if est.drafted is None or est.plain is None or min(est.num_drafted, est.num_plain) < self.min_samples:
            return est.steps % 2 == 1  # measuring: alternate, so both kinds see the same load
        pays = est.drafted >= (1 - self.margin) * est.plain
        if pays != explore:
            return True
        self.num_vetoed += 1
        return False
