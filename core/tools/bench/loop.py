"""loop: the kernel's host cost a row, with nothing but the kernel running. The scheduler, the
ledger and the block manager serve N requests in flight, each decoding one token a step (with a
fixed-width speculator: verifying K drafts that stay on the device, accepting some), while a
stand-in runner answers each frame at once; the clock runs only around the kernel's own work
(schedule, submit, apply), so the figures are what the kernel adds to every step on this host,
whatever the device. Each configuration runs twice: one frame in flight (sync), and two, with
each row scheduled again on its placeholder while its frame is in flight (run ahead, the
engine's default on a GPU, and the heavier path: eligibility, run-ahead draft slots). Runs on the
CPU in a second; its figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import platform as host_platform
import random
import time
from collections import deque
from typing import Any

import numpy as np

from ...kernel.block_manager import BlockManager
from ...kernel.frame import RowResult, StepFrame, StepResult
from ...kernel.ledger import Ledger
from ...kernel.request import Request
from ...kernel.scheduler import Scheduler
from ...kernel.spec_policy import SpecPolicy
from ...sampling_params import SamplingParams
from .command import header, preamble

BLOCK = 16
PROMPT = 64
EOS = 2


def stand_in(frame: StepFrame, k: int, rng: random.Random) -> StepResult:
    """What a runner answers: each sampling row accepts some of its drafts and adds one token;
    a speculator's next drafts stay on the device (their count only)."""
    rows = []
    for row in frame.rows:
        if row.sampling is None:
            rows.append(RowResult(row.key, row.generation, []))
            continue
        accepted = rng.randint(0, row.num_drafts)
        rows.append(RowResult(row.key, row.generation, [rng.randint(10, 30000) for _ in range(accepted + 1)],
                              row.num_drafts, accepted, None, k if k and not frame.skip_drafts else 0))
    return StepResult(frame.step_id, rows)


def measure(rows: int, k: int, steps: int, seed: int = 0, run_ahead: bool = False) -> dict[str, Any]:
    """Times `steps` decode steps of `rows` requests after their prompts ran; µs a step and a row.
    run_ahead: two frames in flight, the second scheduled before the first is applied."""
    rng = random.Random(seed)
    lookahead = k + 1
    per_request = -(-(PROMPT + (steps + 8) * 2 * (k + 1) + lookahead) // BLOCK)
    policy = SpecPolicy(num_speculative_tokens=k, lookahead_slots=lookahead, variable_width=False,
                        skip_drafts=False, run_ahead=run_ahead) if k else None
    sched = Scheduler(BlockManager(rows * per_request + 8, BLOCK), rows, max(rows * (k + 1), PROMPT * rows),
                      spec=policy, async_scheduling=run_ahead)
    ledger = Ledger(sched)
    params = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    for key in range(1, rows + 1):
        prompt = [rng.randint(10, 30000) for _ in range(PROMPT)]
        sched.add(Request(key, prompt, params, key, (EOS,), 1 << 30))
    depth = 2 if run_ahead else 1
    in_flight: deque[StepFrame] = deque()

    def turn() -> tuple[float, float, int]:
        """Schedules up to `depth` frames in flight, applies the oldest: (schedule s, apply s, rows)."""
        t0 = time.perf_counter()
        scheduled = 0
        while len(in_flight) < depth and (frame := sched.schedule()) is not None:
            ledger.submit(frame)
            in_flight.append(frame)
            scheduled += len(frame.rows)
        t1 = time.perf_counter()
        result = stand_in(in_flight.popleft(), k, rng)
        t2 = time.perf_counter()
        ledger.apply(result)
        return t1 - t0, time.perf_counter() - t2, scheduled

    for _ in range(100 * rows):  # the prompts, then `depth - 1` frames in flight
        if all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in sched.requests.values()) \
                and len(sched.running) == rows and len(in_flight) == depth - 1:
            break
        turn()
    else:
        raise RuntimeError(f"{rows} requests never all decoded with {depth} frames in flight")
    schedule_s, apply_s = [], []
    for _ in range(steps):
        s, a, scheduled = turn()
        assert scheduled == rows, "every request decodes in every step"
        schedule_s.append(s)
        apply_s.append(a)
    step_us = np.median(np.add(schedule_s, apply_s)) * 1e6
    return {"rows": rows, "num_speculative_tokens": k, "run_ahead": run_ahead, "steps": steps,
            "schedule_us": float(np.median(schedule_s) * 1e6), "apply_us": float(np.median(apply_s) * 1e6),
            "step_us": float(step_us), "us_per_row": float(step_us / rows)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runs = [measure(rows, k, args.steps, run_ahead=ahead) for ahead in (False, True) for k in args.loop_k
            for rows in args.rows]
    return header("loop") | {"platform": "cpu", "dtype": "-", "device": host_platform.processor() or "cpu",
                             "steps": args.steps, "runs": runs}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"The kernel's host work a step (schedule + apply, a stand-in runner), "
                             f"median of {report['steps']} decode steps")
    lines += ["| frames in flight | K | rows | schedule µs | apply µs | step µs | µs a row |",
              "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        mode = "2 (run ahead)" if r.get("run_ahead") else "1"
        lines.append(f"| {mode} | {r['num_speculative_tokens']} | {r['rows']} | {r['schedule_us']:.0f} | "
                     f"{r['apply_us']:.0f} | {r['step_us']:.0f} | {r['us_per_row']:.1f} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for ahead in (False, True):
        for k in sorted({r["num_speculative_tokens"] for r in report["runs"]}):
            runs = [r for r in report["runs"]
                    if r["num_speculative_tokens"] == k and r.get("run_ahead", False) == ahead]
            if runs:
                label = "no speculator" if k == 0 else f"K={k}, drafts on the device"
                ax.plot([r["rows"] for r in runs], [r["us_per_row"] for r in runs], marker="o",
                        linestyle="--" if ahead else "-", label=label + (", run ahead" if ahead else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (rows a step)")
    ax.set_ylabel("µs of kernel host work a row")
    ax.set_title("The kernel's schedule-and-apply loop")
    ax.legend()
    return fig
