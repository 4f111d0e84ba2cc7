"""`bench loop`: the kernel's schedule-and-apply loop under a stand-in runner, on the CPU. Its
figures are printed for the log, never asserted: speed lives in benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speckernel.tools.bench.loop import measure
from speckernel.tools.cli import main


def test_every_row_decodes_in_every_timed_step() -> None:
    """The measured steps are the ones the figure is about: all requests in flight, one frame
    scheduled a step (measure asserts it), with one frame in flight or two."""
    for k in (0, 3):
        for ahead in (False, True):
            r = measure(rows=8, k=k, steps=5, run_ahead=ahead)
            assert r["rows"] == 8 and r["steps"] == 5 and r["run_ahead"] is ahead
            assert r["step_us"] == pytest.approx(r["us_per_row"] * 8)


def test_bench_loop_writes_its_report(tmp_path: Path) -> None:
    """It prints its table (shown with `pytest -s`)."""
    code = main(["bench", "loop", "--rows", "1,64", "--loop-k", "0,3", "--steps", "50", "--out", str(tmp_path)])
    assert code in (0, None)
    report = json.loads((tmp_path / "loop.json").read_text())
    grid = [(0, 1), (0, 64), (3, 1), (3, 64)]
    assert [(r["run_ahead"], r["num_speculative_tokens"], r["rows"]) for r in report["runs"]] == \
        [(False, *g) for g in grid] + [(True, *g) for g in grid]
    table = (tmp_path / "loop.md").read_text()
    assert "| 1 | 3 | 64 |" in table and "| 2 (run ahead) | 3 | 64 |" in table
