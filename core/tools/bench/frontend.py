"""frontend: the serving path's host work a step beyond the runner, on the CPU. An in-process
`AsyncEngine` serves C streaming requests (tokenizer, incremental detokenizers, the per-request
streams, the bench's own clients) through the engine core's real loop (scheduler, ledger, two
frames in flight, launched on the loop's thread as on a GPU), while a stand-in runner answers each
frame at once with one token a row. Everything then runs on one thread, so the step period is the
host's whole share of a step; the core's phases (schedule, launch, apply) are timed inside it and
the rest is the frontend's. What `bench decode` on a device adds to these figures is the runner's
own launch (plan, copy, graph replay). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from ...config import EngineConfig
from ...engine.core import EngineCore
from ...engine.runner import Runner
from ...frontend.async_engine import AsyncEngine
from ...frontend.client import CoreClient, InprocClient
from ...kernel.frame import RowResult, StepFrame, StepResult
from ...runner.step_graphs import StepGraphs
from ...sampling_params import SamplingParams
from .command import concurrency_axis, device_name, header, preamble
from .streams import run_streams

PHASES = ("schedule", "launch", "apply")


class Answered:
    """A frame the stand-in answered: its result is there before the loop asks."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def ready(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._result


class StandInRunner:
    """Answers each frame at once: every sampling row gets one token, drawn from a spread of
    ordinary text tokens so the detokenizers do their usual work."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    @property
    def graphs(self) -> StepGraphs | None:
        return None

    @property
    def device_s(self) -> float | None:
        return None

    def launch(self, frame: StepFrame) -> Answered:
        rows = [RowResult(r.key, r.generation, [self.rng.randint(300, 20000)] if r.sampling is not None else [],
                          r.num_drafts, 0) for r in frame.rows]
        return Answered(StepResult(frame.step_id, rows))

    def execute(self, frame: StepFrame) -> StepResult:
        return self.launch(frame).result()

    def stop_speculation(self) -> None:
        """No speculator to stop."""


class StandInCore(EngineCore):
    """The engine core with the stand-in runner (no weights), launching on its loop's thread."""

    def _local_runner(self, *_: Any) -> Any:
        runner: Runner = StandInRunner()
        return runner

    def _launches_on_loop(self, depth: int) -> bool:
        return self.config.launch_on_loop and depth == 2


class StandInEngine(AsyncEngine):
    def _make_client(self) -> CoreClient:
        return InprocClient(self.config, core=StandInCore)


def prompts_for(engine: AsyncEngine, n: int) -> list[list[int]]:
    return [engine.tokenizer.encode(f"Request {i}: write a short story about a lighthouse keeper and a storm.")
            for i in range(n)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(model=args.model, platform="cpu", in_process=True, max_num_seqs=max(args.concurrency),
                          max_model_len=2048, launch_on_loop=not args.no_launch_on_loop)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    async with StandInEngine(config) as engine:
        for c in args.concurrency:
            prompts = prompts_for(engine, max(2 * c, args.num_prompts))
            await run_streams(engine, prompts[:c], SamplingParams(max_tokens=4, ignore_eos=True), c, f"warm-up c={c}")
            cpu = time.thread_time()
            result = await run_streams(engine, prompts, params, c, f"frontend c={c}")
            cpu = time.thread_time() - cpu
            steps = result["num_steps"]
            core_us = {p: result["host_us_per_step"].get(p, 0.0) for p in PHASES}
            period_us = 1e6 * result["elapsed_s"] / steps
            frontend_us = period_us - sum(core_us.values())
            rows = result["generated_tokens"] / steps
            runs.append({
                "concurrency": c, "num_requests": result["num_requests"], "steps": steps, "rows_per_step": rows,
                "tokens_per_s": result["tokens_per_s"], "step_us": period_us, "loop_cpu_us": 1e6 * cpu / steps,
                "core_us": core_us, "frontend_us": frontend_us,
                "us_per_row": period_us / rows, "frontend_us_per_row": frontend_us / rows})
    return header("frontend") | {"platform": "cpu", "dtype": "-", "device": device_name("cpu"),
                                 "max_tokens": args.max_tokens, "launch_on_loop": config.launch_on_loop,
                                 "runs": runs}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, "The serving path's host work a step beyond the runner (in-process frontend and "
                             "engine core loop, a stand-in runner)")
    lines += [f"Requests of {report['max_tokens']} tokens; one thread runs everything, so the step period is the "
              "host's whole share: the core's phases are timed inside it, the rest (streams, detokenizers, the "
              "clients, the event loop) is the frontend's.", "",
              "| in flight | rows a step | step µs | loop CPU µs | schedule µs | launch µs (stand-in) | apply µs "
              "| frontend µs | µs a row | frontend µs a row |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        core = r["core_us"]
        lines.append(f"| {r['concurrency']} | {r['rows_per_step']:.1f} | {r['step_us']:.0f} | {r['loop_cpu_us']:.0f} | "
                     f"{core['schedule']:.0f} | {core['launch']:.0f} | {core['apply']:.0f} | "
                     f"{r['frontend_us']:.0f} | {r['us_per_row']:.1f} | {r['frontend_us_per_row']:.1f} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = report["runs"]
    xs = [r["concurrency"] for r in runs]
    ax.plot(xs, [r["us_per_row"] for r in runs], marker="o", label="whole path")
    ax.plot(xs, [r["frontend_us_per_row"] for r in runs], marker="o", label="frontend")
    ax.plot(xs, [sum(r["core_us"].values()) / r["rows_per_step"] for r in runs], marker="o", label="engine core")
    ax.set_title("Host work a row beyond the runner")
    concurrency_axis(ax, xs, "requests in flight", "µs a row")
    return fig
