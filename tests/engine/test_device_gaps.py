"""The device's gaps: host time from a result to the next launch, counted only while nothing else
was in flight, and never while the engine had no work."""

from __future__ import annotations

import pytest

from speckernel.engine import device_gaps
from speckernel.engine.device_gaps import DeviceGaps


def test_a_gap_runs_from_a_lone_result_to_the_next_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([1.0, 1.25, 2.0, 5.0, 5.5])
    monkeypatch.setattr(device_gaps.time, "perf_counter", lambda: next(now))
    gaps = DeviceGaps()
    gaps.launched()  # the first launch: nothing came back before it
    gaps.applied(still_in_flight=0)  # 1.0: the device has nothing queued
    gaps.launched()  # 1.25
    gaps.applied(still_in_flight=1)  # another frame runs: no gap
    gaps.launched()
    gaps.applied(still_in_flight=0)  # 2.0
    gaps.no_work()  # the clients' wait, not the host's
    gaps.launched()
    gaps.applied(still_in_flight=0)  # 5.0
    gaps.launched()  # 5.5
    assert gaps.stats() == {"num_device_gaps": 2, "device_gap_s": pytest.approx(0.75)}
