"""compare: two sets of runs of one scenario, a baseline and a candidate (two trees, two settings),
row by row. Each side is one or more `--out` folders of the same scenario taken on the same device,
best interleaved (baseline, candidate, candidate, baseline) so the host's drift falls on both. A row
pools every run of its configuration on each side (a repeated run's every value, not only its
median), and its ratio is candidate median over baseline median; with as many folders on each
side, the ratio of each pair of folders (a round) shows how far the rounds agree. A row is within
the tolerance, faster or slower; where the rounds' ratios straddle a bound of the tolerance (with a
single round: the ratios of its extreme runs), the host's noise is larger than the difference asked
about, and the row says "noisy" instead of a verdict. Reads JSON only: it measures nothing itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from ...errors import InvalidInputError
from .command import MISSING, cell, header, preamble, ratio

IDENTITY = ("mode", "speculator", "concurrency", "temperature", "pipeline_parallel_size", "data_parallel_size")
"""The fields that name a row's configuration, those a scenario's runs have."""

Key = tuple[tuple[str, Any], ...]


def load(folder: str, scenario: str) -> dict[str, Any]:
    path = Path(folder) / f"{scenario}.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"bench compare: cannot read {path}: {e}") from None
    if report.get("scenario") != scenario or not isinstance(report.get("runs"), list):
        raise InvalidInputError(f"bench compare: {path} is no `bench {scenario}` report")
    return report


def identity(run: dict[str, Any]) -> Key:
    return tuple((field, run[field]) for field in IDENTITY if field in run)


def values(run: dict[str, Any], key: str) -> list[float]:
    """Every repeat's figure where the run was repeated, else the run's own."""
    rep = run.get("repeats")
    if isinstance(rep, dict) and rep.get("key") == key and rep.get("values"):
        return [float(v) for v in rep["values"]]
    return [] if run.get(key) is None else [float(run[key])]


def pooled(reports: list[dict[str, Any]], key: str) -> dict[Key, list[list[float]]]:
    """Per row, the figures of each report (one list per folder, in order)."""
    rows: dict[Key, list[list[float]]] = {}
    for i, report in enumerate(reports):
        for run in report["runs"]:
            rows.setdefault(identity(run), [[] for _ in reports])[i].extend(values(run, key))
    return rows


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def extremes(base: list[float], cand: list[float]) -> list[float]:
    """With fewer than two rounds, the widest ratios the runs allow: the slowest candidate run over
    the fastest baseline run, and the other way round."""
    if not base or not cand or min(base) <= 0:
        return []
    return [min(cand) / max(base), max(cand) / min(base)]


def verdict(overall: float | None, rounds: list[float], tolerance: float) -> str:
    if overall is None:
        return "missing"
    if rounds and any(min(rounds) < bound <= max(rounds) for bound in (1 - tolerance, 1 + tolerance)):
        return "noisy"  # the rounds fall on both sides of a bound: this host cannot tell
    if overall > 1 + tolerance:
        return "faster"
    if overall < 1 - tolerance:
        return "slower"
    return "within"


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = [load(f, args.compare_scenario) for f in args.baseline]
    cand = [load(f, args.compare_scenario) for f in args.candidate]
    devices = {r.get("device") for r in [*base, *cand]}
    if len(devices) > 1:
        named = ", ".join(map(str, devices))
        raise InvalidInputError(f"bench compare: the folders ran on different devices ({named}); "
                                "figures compare only where the device is the same")
    b, c = pooled(base, args.key), pooled(cand, args.key)
    paired = len(base) == len(cand)
    rows = []
    for key in [*b, *(k for k in c if k not in b)]:
        b_sets, c_sets = b.get(key, [[] for _ in base]), c.get(key, [[] for _ in cand])
        b_all, c_all = [v for s in b_sets for v in s], [v for s in c_sets for v in s]
        b_med, c_med = median(b_all), median(c_all)
        overall = ratio(c_med, b_med)
        rounds = [r for bs, cs in zip(b_sets, c_sets, strict=True)
                  if (r := ratio(median(cs), median(bs))) is not None] if paired else []
        evidence = rounds if len(rounds) > 1 else extremes(b_all, c_all)
        rows.append(dict(key) | {"baseline": b_med, "candidate": c_med, "ratio": overall,
                                 "baseline_n": len(b_all), "candidate_n": len(c_all),
                                 "round_ratios": rounds, "verdict": verdict(overall, evidence, args.tolerance)})
    first = base[0]
    # Where the figures were taken, not where this process reads them: the baseline's host and libraries.
    return header("compare") | {"host": first.get("host"), "versions": first.get("versions", {})} | {
        "platform": first.get("platform"), "dtype": first.get("dtype"), "device": first.get("device"),
        "scenario_compared": args.compare_scenario, "key": args.key, "tolerance": args.tolerance,
        "baseline": list(args.baseline), "candidate": list(args.candidate),
        "commands": {"baseline": first.get("command"), "candidate": cand[0].get("command")},
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    rows = report["rows"]
    fields = [f for f in IDENTITY if any(f in r for r in rows)]
    tol = report["tolerance"]
    lines = preamble(report, f"{report['scenario_compared']}: candidate against baseline, {report['key']}")
    lines += [f"Baseline: {', '.join(report['baseline'])}; candidate: {', '.join(report['candidate'])}. "
              f"A row pools every run of its configuration on each side; ratio: candidate median / baseline "
              f"median; rounds: the ratio of each pair of folders; verdict against ±{tol:.0%} (noisy: the rounds, "
              "or with one round its extreme runs, fall on both sides of a bound).", ""]
    lines += ["| " + " | ".join([*fields, "baseline", "candidate", "runs", "ratio", "rounds", "verdict"]) + " |",
              "|---" * (len(fields) + 6) + "|"]
    for r in rows:
        rounds = ", ".join(f"{x:.2f}" for x in r["round_ratios"]) or MISSING
        lines.append("| " + " | ".join([*(str(r.get(f, MISSING)) for f in fields), cell(r["baseline"], ".1f"),
                                        cell(r["candidate"], ".1f"), f"{r['baseline_n']} / {r['candidate_n']}",
                                        cell(r["ratio"]), rounds, r["verdict"]]) + " |")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("within", "faster", "slower", "noisy", "missing")}
    lines += ["", ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" of {len(rows)} rows."]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    rows = [r for r in report["rows"] if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    labels = [" ".join(str(r[f]) for f in IDENTITY if f in r and f != "mode") for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        if r["round_ratios"]:
            ax.plot([i] * len(r["round_ratios"]), r["round_ratios"], "k.", markersize=4)
    tol = report["tolerance"]
    ax.axhspan(1 - tol, 1 + tol, color="tab:green", alpha=0.15, label=f"±{tol:.0%}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize="small")
    ax.set_ylabel(f"candidate / baseline, {report['key']}")
    ax.legend(fontsize="small")
    return fig
