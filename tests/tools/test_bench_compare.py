"""`speckernel bench compare`: rows pooled from each side's folders, the ratio of the medians, one
ratio a round, and a verdict that says "noisy" where the rounds disagree across a bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from speckernel.tools import cli


def report(folder: Path, figures: dict[tuple[str, int], list[float]], device: str = "NVIDIA H200") -> str:
    """A `bench decode` report whose rows ran len(values) times, with the fields compare reads."""
    runs = []
    for (speculator, concurrency), values in figures.items():
        chosen = sorted(values)[(len(values) - 1) // 2]
        runs.append({"mode": "inprocess", "speculator": speculator, "concurrency": concurrency, "tokens_per_s": chosen,
                     "repeats": {"n": len(values), "key": "tokens_per_s", "values": values, "median": chosen}})
    folder.mkdir(parents=True)
    (folder / "decode.json").write_text(json.dumps({
        "scenario": "decode", "command": "speckernel bench decode", "host": "x86_64 Linux",
        "versions": {"torch": "2.11.0"}, "platform": "cuda", "dtype": "bfloat16", "device": device, "runs": runs}))
    return str(folder)


def compare(args: list[str], out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    argv = ["bench", "compare", *args, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["speckernel", *argv])
    assert cli.main(argv) == 0
    result = json.loads((out / "compare.json").read_text())
    assert (out / "compare.md").read_text().count("| inprocess |") == len(result["rows"])
    return result


def test_each_row_gets_the_ratio_of_pooled_medians_and_a_verdict(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    a1 = report(tmp_path / "a1", {("none", 1): [100, 102, 98], ("none", 64): [100, 100, 100],
                                  ("mtp:3", 1): [100, 100, 100], ("mtp:3", 64): [100, 100, 100],
                                  ("dflash:7", 1): [100, 100, 100]})
    b1 = report(tmp_path / "b1", {("none", 1): [101, 103, 99], ("none", 64): [110, 110, 110],
                                  ("mtp:3", 1): [90, 90, 90], ("mtp:3", 64): [92, 92, 92],
                                  ("dflash:7", 16): [50, 50, 50]})
    b2 = report(tmp_path / "b2", {("none", 1): [100, 100, 100], ("none", 64): [110, 110, 110],
                                  ("mtp:3", 1): [90, 90, 90], ("mtp:3", 64): [99, 99, 99]})
    a2 = report(tmp_path / "a2", {("none", 1): [100, 100, 100], ("none", 64): [100, 100, 100],
                                  ("mtp:3", 1): [100, 100, 100], ("mtp:3", 64): [100, 100, 100]})
    r = compare(["--baseline", a1, "--candidate", b1, "--candidate", b2, "--baseline", a2], tmp_path / "out",
                monkeypatch)
    rows = {(row["speculator"], row["concurrency"]): row for row in r["rows"]}
    assert rows["none", 1]["ratio"] == pytest.approx(1.0) and rows["none", 1]["verdict"] == "within"
    assert rows["none", 1]["baseline_n"] == rows["none", 1]["candidate_n"] == 6
    assert rows["none", 64]["verdict"] == "faster" and rows["none", 64]["round_ratios"] == pytest.approx([1.1, 1.1])
    assert rows["mtp:3", 1]["verdict"] == "slower" and rows["mtp:3", 1]["ratio"] == pytest.approx(0.9)
    # 0.92 in one round, 0.99 in the other: across the -5% bound, so no verdict either way
    assert rows["mtp:3", 64]["round_ratios"] == pytest.approx([0.92, 0.99]) and rows["mtp:3", 64]["verdict"] == "noisy"
    assert rows["dflash:7", 1]["verdict"] == rows["dflash:7", 16]["verdict"] == "missing"
    assert r["device"] == "NVIDIA H200" and r["versions"] == {"torch": "2.11.0"} and r["tolerance"] == 0.05


def test_a_wider_tolerance_calls_the_same_figures_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = report(tmp_path / "a", {("none", 1): [100.0]})
    b = report(tmp_path / "b", {("none", 1): [92.0]})
    assert compare(["--baseline", a, "--candidate", b], tmp_path / "o5", monkeypatch)["rows"][0]["verdict"] == "slower"
    wide = compare(["--baseline", a, "--candidate", b, "--tolerance", "0.1"], tmp_path / "o10", monkeypatch)
    assert wide["rows"][0]["verdict"] == "within"


def test_folders_from_two_devices_or_another_scenario_are_refused(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a = report(tmp_path / "a", {("none", 1): [100.0]})
    b = report(tmp_path / "b", {("none", 1): [100.0]}, device="NVIDIA H100 80GB HBM3")
    assert cli.main(["bench", "compare", "--baseline", a, "--candidate", b, "--out", str(tmp_path / "o")]) != 0
    assert "different devices" in capsys.readouterr().err
    assert cli.main(["bench", "compare", "--baseline", a, "--candidate", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "o")]) != 0
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_one_round_is_noisy_where_its_runs_disagree_across_a_bound(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A single round has no second ratio to disagree with: its extreme runs stand in for it."""
    a = report(tmp_path / "a", {("none", 1): [95.0, 100.0, 105.0], ("none", 16): [99.0, 100.0, 101.0]})
    b = report(tmp_path / "b", {("none", 1): [90.0, 100.0, 110.0], ("none", 16): [89.0, 90.0, 91.0]})
    rows = compare(["--baseline", a, "--candidate", b], tmp_path / "o", monkeypatch)["rows"]
    assert rows[0]["ratio"] == pytest.approx(1.0) and rows[0]["verdict"] == "noisy"
    assert rows[1]["ratio"] == pytest.approx(0.9) and rows[1]["verdict"] == "slower"
