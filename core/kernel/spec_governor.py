"""Turns drafting off while verification does not pay, by measurement.

Whether drafts pay depends on the batch: verifying 1+K tokens a row is nearly free while a
step is bound by reading weights (small batches on a GPU) and costs up to (1+K)x once it is
bound by compute (large batches, or a CPU). The governor keeps, per batch-size bucket, a
moving average of the tokens per second of steps that verified drafts and of steps that did
not, and lets the scheduler draft only while the first is not slower than the second by more
than `margin`, once it has measured enough steps of both kinds. After that it still probes
the other way once every `explore_every` steps of the bucket, so both estimates follow the
workload. Greedy output never depends on it: a K=0 step only decides whether drafts exist.

Where the engine timed its step graphs at start (`step_costs`: a bucket's plain and drafting
step, each a captured graph replayed), a bucket decides from those costs and the acceptance
measured on every verifying row instead: drafting pays while the tokens a verifying row
confirms per drafting step's second are at least (1 - margin) of one token per plain step's
second. No plain step is spent measuring; while drafting does not pay, a bucket still drafts
once every `explore_every` of its steps, so the acceptance follows the workload. Acceptance is
weighed per row over about the last `row_memory` verifying rows, not per step: at batch 1 a
step is one row, whose acceptance swings from 1 to K+1, and a per-step average turned a drafter
off after a few steps without a match (below the line, it learns again on exploration steps only).
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
    margin: float = 0.05
    explore_every: int = 32
    min_samples: int = 8
    """Steps of each kind a bucket must have measured before drafting may be turned off (with
    step costs: verifying rows measured before acceptance counts)."""
    smoothing: float = 0.2
    """Weight of the newest step in the online moving averages of tokens per second."""
    row_memory: int = 256
    """Verifying rows the acceptance estimate remembers, roughly (each row's weight decays by
    1 - 1/row_memory per later row)."""
    estimates: dict[int, _Estimate] = field(default_factory=dict)
    num_vetoed: int = 0
    """Steps the governor turned into K=0 steps."""
    step_costs: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per bucket, seconds of a (plain, drafting) step measured at start; empty: measure online."""
    num_verified_rows: int = 0
    _tokens: float = 0.0
    _rows: float = 0.0
    """Decayed sums of the tokens verifying rows confirmed and of those rows."""

    @property
    def tokens_per_row(self) -> float | None:
        """Tokens a verifying row confirms in a step (its accepted drafts + 1), over the recent rows."""
        return self._tokens / self._rows if self._rows else None

    def record_rows(self, num_rows: int, tokens: int) -> None:
        """A step's verifying rows and the tokens they confirmed (what acceptance is worth)."""
        if num_rows <= 0:
            return
        keep = (1 - 1 / self.row_memory) ** num_rows
        self._tokens = keep * self._tokens + tokens
        self._rows = keep * self._rows + num_rows
        self.num_verified_rows += num_rows

    def pays(self, rows: int) -> bool | None:
        """Whether drafting pays for a step of this many rows by the measured costs and acceptance
        (None: no cost measured for its bucket, or too few verified rows yet)."""
        costs = self.step_costs.get(bucket(rows))
        if costs is None or self.tokens_per_row is None or self.num_verified_rows < self.min_samples:
            return None
        plain_s, drafting_s = costs
        return self.tokens_per_row / drafting_s >= (1 - self.margin) / plain_s

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
        if bucket(rows) in self.step_costs:  # costs measured at start: only acceptance is learnt
            if self.pays(rows) is not False or explore:
                return True
            self.num_vetoed += 1
            return False
        if est.drafted is None or est.plain is None or min(est.num_drafted, est.num_plain) < self.min_samples:
            return est.steps % 2 == 1  # measuring: alternate, so both kinds see the same load
        pays = est.drafted >= (1 - self.margin) * est.plain
        if pays != explore:
            return True
        self.num_vetoed += 1
        return False
