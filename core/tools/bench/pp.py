"""pp: pipeline and data parallelism. The same greedy requests at PP = 1, 2, 4 (stage processes
on this host, torch.distributed on the platform's backend) and at DP = 2 (two engine-core
ranks), each without and with a speculator. Per run: generated tokens/s, the step period
(elapsed / steps), and for pipelines the bubbles: the share of the run each stage spent not
running a step (mean and worst over the stages). Outputs are compared with PP=1's, token for
token.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from ... import registry
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams
from .command import base_config, cell, device_name, header, preamble, with_speculator
from .streams import chat_prompts, identical, run_streams, warm_up


def layouts(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(pp, 1) for pp in args.pipeline_sizes] + [(1, dp) for dp in args.data_parallel_sizes]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    info: Any = None
    prompts: list[list[int]] = []
    reference: dict[str | None, list[list[int]]] = {}
    for name in [None, *(args.speculator or ["mtp"])]:
        for pp, dp in layouts(args):
            config = msgspec.structs.replace(
                with_speculator(base_config(args), args, name), pipeline_parallel_size=pp, data_parallel_size=dp,
                max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype or "float32")
            started = time.monotonic()
            async with AsyncEngine(config) as engine:
                start_s = time.monotonic() - started
                if not prompts:
                    prompts = chat_prompts(engine, args.num_prompts)
                    info = engine.info
                await warm_up(engine, prompts, params, (args.concurrency,))
                before = await engine.stats()
                r = await run_streams(engine, prompts, params, args.concurrency, f"pp={pp} dp={dp} {name}")
                after = await engine.stats()
            outputs = r.pop("outputs")
            r.pop("requests")
            reference.setdefault(name, outputs)
            busy = None
            if "pipeline" in after:
                busy = [b - a for a, b in zip(before["pipeline"]["busy_s"], after["pipeline"]["busy_s"], strict=True)]
            bubbles = [max(0.0, 1.0 - b / r["elapsed_s"]) for b in busy] if busy else None
            runs.append({"speculator": name or "none", "pipeline_parallel_size": pp, "data_parallel_size": dp,
                         "engine_start_s": start_s,
                         "step_period_ms": 1e3 * r["elapsed_s"] / r["num_steps"] if r["num_steps"] else None,
                         "stage_busy_s": busy, "bubble_mean": sum(bubbles) / len(bubbles) if bubbles else None,
                         "bubble_max": max(bubbles) if bubbles else None,
                         "identical_to_pp1": identical(outputs, reference[name])} | r)
    return header("pp") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "num_speculative_tokens": args.num_speculative_tokens,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Pipeline and data parallelism: {report['num_prompts']} greedy requests of "
                             f"{report['max_tokens']} tokens at concurrency {report['concurrency']}, "
                             f"K={report['num_speculative_tokens']}")
    lines += [
        "| speculator | PP | DP | tokens/s | step period ms | steps | bubbles (mean) | bubbles (worst stage) "
        "| mean acceptance length | identical to PP=1 | engine start s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['speculator']} | {r['pipeline_parallel_size']} | {r['data_parallel_size']} | "
            f"{r['tokens_per_s']:.1f} | {cell(r['step_period_ms'], '.1f')} | {r['num_steps']} | "
            f"{cell(r['bubble_mean'], '.0%')} | {cell(r['bubble_max'], '.0%')} | "
            f"{cell(r['spec'].get('mean_acceptance_length'))} | {r['identical_to_pp1']}/{r['num_requests']} | "
            f"{r['engine_start_s']:.1f} |")
    lines += ["", "Steps and acceptance of a DP run are rank 0's. Bubbles: the share of the timed run a stage "
              "spent not running a step; PP=1 and DP runs have no stages."]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values = [], []
    for r in report["runs"]:
        labels.append(f"{r['speculator']}\nPP={r['pipeline_parallel_size']} DP={r['data_parallel_size']}")
        values.append(r["tokens_per_s"])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize="x-small")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"Pipeline / data parallelism, {report['platform']} {report['dtype']}")
    return fig
