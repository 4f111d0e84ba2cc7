"""Repeated runs of one configuration: a table shows the median run and the spread of all of them
beside it, because one run on a busy host can be off by more than the difference it measures."""

from __future__ import annotations

import sys
from typing import Any

from .command import MISSING

SPREAD_WARNING = 0.10
"""A spread ((max - min) / median) above this share of the median is called out: the figures of
such a row differ from run to run by more than most effects the benchmarks look for."""


def median_run(runs: list[dict[str, Any]], key: str = "tokens_per_s") -> dict[str, Any]:
    """The run with the median `key` (the lower median for an even count, so every figure of the
    row comes from one real run), with every run's value, the min, max and spread under `repeats`."""
    if not runs:
        raise ValueError("median_run needs at least one run")
    values = [float(r[key]) for r in runs]
    chosen = sorted(runs, key=lambda r: float(r[key]))[(len(runs) - 1) // 2]
    median = float(chosen[key])
    low, high = min(values), max(values)
    return chosen | {"repeats": {"n": len(runs), "key": key, "values": values, "median": median, "min": low,
                                 "max": high, "spread": (high - low) / median if median else None}}


def spread_cell(run: dict[str, Any], spec: str = ".1f") -> str:
    """`min-max (±p%)` of a row's repeated figure, or a dash for a single run."""
    rep = run.get("repeats")
    if not rep or rep["n"] < 2 or rep["spread"] is None:
        return MISSING
    return f"{rep['min']:{spec}}-{rep['max']:{spec}} ({rep['spread']:.0%})"


def noisy(run: dict[str, Any]) -> bool:
    rep = run.get("repeats")
    return bool(rep and rep["n"] > 1 and rep["spread"] is not None and rep["spread"] > SPREAD_WARNING)


def warn_if_noisy(run: dict[str, Any], what: str) -> None:
    """One line on stderr when a row's runs disagree by more than SPREAD_WARNING of their median."""
    if noisy(run):
        rep = run["repeats"]
        print(f"bench: {what}: {rep['key']} spread {rep['spread']:.0%} of the median over {rep['n']} runs "
              f"({rep['min']:.1f}-{rep['max']:.1f}); take more --repeats or a quieter host before comparing",
              file=sys.stderr)


def spread_note(runs: list[dict[str, Any]], label: Any) -> list[str]:
    """The sentence after a table about its spread, made from the figures: which rows vary by more
    than SPREAD_WARNING, or the largest spread when none does."""
    repeated = [r for r in runs if r.get("repeats") and r["repeats"]["n"] > 1]
    if not repeated:
        return ["", "One run per row: no spread measured (--repeats N runs each row N times)."]
    n = ", ".join(sorted({str(r["repeats"]["n"]) for r in repeated}))
    wide = [r for r in repeated if noisy(r)]
    if not wide:
        largest = max((r["repeats"]["spread"] or 0.0) for r in repeated)
        return ["", f"Each row is the median of {n} runs; the largest spread (max - min over the median) is "
                    f"{largest:.0%}, within {SPREAD_WARNING:.0%}."]
    rows = "; ".join(f"{label(r)} {r['repeats']['spread']:.0%}" for r in wide)
    return ["", f"Each row is the median of {n} runs. Spread above {SPREAD_WARNING:.0%} of the median (differences "
                f"this small are noise there): {rows}."]
