"""pp: pipeline and data parallelism. The same greedy requests at PP = 1, 2, 4 (stage processes
on this host, torch.distributed on the platform's backend) and at DP = 2 (two engine-core
ranks), each without a speculator and with each named one (default: mtp and dflash), each at
every concurrency (default: 1, 16, 64), on one engine per layout and speculator. Per run:
generated tokens/s and its ratio to PP=1 at the same speculator and concurrency; the step
period (elapsed / steps); for pipelines the bubbles (the share of the run each stage spent not
running a step, mean and worst over the stages) and the transport that carried the stages'
frames; for data parallelism the period of the ranks' lockstep turns and the share of it spent
in the vote (the all-reduce, waiting for the slowest rank included). Outputs are compared with
PP=1's, token for token.

Data-parallel ranks run both as their own processes, as `--data-parallel-size` serves them,
and as threads of this process (`--dp-ranks`): threads share one interpreter lock, so their host
work runs one rank at a time, and they share one device context, so their kernels need no
context switch. The graph steps column shows whether the ranks replayed device graphs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from ... import registry
from ...config import EngineConfig
from ...errors import InvalidInputError
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams
from .command import MISSING, base_config, cell, device_name, header, preamble, ratio, with_speculator
from .streams import chat_prompts, identical, run_streams, warm_up

DEFAULT_SPECULATORS = ["mtp", "dflash"]


DP_RANKS = ("process", "in-process")


def layouts(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """(PP, DP, where the cores run) of each engine: PP=1 first, the reference of the others."""
    if unknown := set(args.dp_ranks) - set(DP_RANKS):
        raise InvalidInputError(f"--dp-ranks: unknown {', '.join(sorted(unknown))}; expected {', '.join(DP_RANKS)}")
    ranks = [r for r in DP_RANKS if r in args.dp_ranks]
    return [(pp, 1, "default") for pp in args.pipeline_sizes] + [
        (1, dp, r) for dp in args.data_parallel_sizes if dp > 1 for r in ranks]  # DP=1 is PP=1's layout


def transport_name(config: EngineConfig, stats: dict[str, Any]) -> str | None:
    """The transport between pipeline stages, as the engine reports it (the one it picked: its
    config's, or the platform's preferred); None for a single stage."""
    if config.pipeline_parallel_size == 1:
        return None
    return str(stats["pipeline"]["transport"])


def layout_config(args: argparse.Namespace, name: str | None, pp: int, dp: int, ranks: str) -> EngineConfig:
    config = msgspec.structs.replace(
        with_speculator(base_config(args), args, name), pipeline_parallel_size=pp, data_parallel_size=dp,
        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype or "float32")
    if ranks != "default":
        config = msgspec.structs.replace(config, in_process=ranks == "in-process")
    if args.pipeline_transport:
        if "pipeline_transport" not in EngineConfig.__struct_fields__:
            raise InvalidInputError("--pipeline-transport: this engine has no pipeline_transport setting")
        config = msgspec.structs.replace(config, pipeline_transport=args.pipeline_transport)
    return config


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0) - before.get(key, 0))


def parallel_figures(config: EngineConfig, before: dict[str, Any], after: dict[str, Any],
                     elapsed_s: float) -> dict[str, Any]:
    """Bubbles and transport of a pipeline, lockstep timing of data-parallel ranks (rank 0's),
    over the stretch between two stats snapshots."""
    busy = None
    if "pipeline" in after:
        busy = [b - a for a, b in zip(before["pipeline"]["busy_s"], after["pipeline"]["busy_s"], strict=True)]
    bubbles = [max(0.0, 1.0 - b / elapsed_s) for b in busy] if busy and elapsed_s > 0 else None
    found: dict[str, Any] = {
        "transport": transport_name(config, after), "stage_busy_s": busy,
        "bubble_mean": sum(bubbles) / len(bubbles) if bubbles else None,
        "bubble_max": max(bubbles) if bubbles else None,
        "dp_step_period_ms": None, "dp_vote_share": None, "dp_vote_ms": None, "dp_dummy_steps": None,
    }
    if "data_parallel" in after:
        a, b = before["data_parallel"], after["data_parallel"]
        turns, turn_s, vote_s = _delta(a, b, "num_timed_turns"), _delta(a, b, "turn_s"), _delta(a, b, "vote_s")
        found |= {"dp_step_period_ms": 1e3 * turn_s / turns if turns else None,
                  "dp_vote_ms": 1e3 * vote_s / turns if turns else None,
                  "dp_vote_share": vote_s / turn_s if turn_s else None,
                  "dp_dummy_steps": int(_delta(a, b, "num_dummy_steps"))}
    return found


async def run(args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    info: Any = None
    prompts: list[list[int]] = []
    concurrencies = sorted(set(args.concurrency))
    for name in [None, *(args.speculator or DEFAULT_SPECULATORS)]:
        for pp, dp, ranks in layouts(args):
            config = layout_config(args, name, pp, dp, ranks)
            started = time.monotonic()
            async with AsyncEngine(config) as engine:
                start_s = time.monotonic() - started
                if not prompts:
                    prompts = chat_prompts(engine, max(args.num_prompts, *concurrencies))
                    info = engine.info
                await warm_up(engine, prompts, params, tuple(concurrencies))
                for c in concurrencies:
                    batch = prompts[:max(args.num_prompts, c)]
                    before = await engine.stats()
                    r = await run_streams(engine, batch, params, c, f"pp={pp} dp={dp} {name or 'none'} c={c}")
                    after = await engine.stats()
                    r.pop("requests")
                    runs.append({"speculator": name or "none", "pipeline_parallel_size": pp,
                                 "data_parallel_size": dp, "ranks": "in-process" if config.in_process else "process",
                                 "engine_start_s": start_s,
                                 "step_period_ms": 1e3 * r["elapsed_s"] / r["num_steps"] if r["num_steps"] else None}
                                | parallel_figures(config, before, after, r["elapsed_s"]) | r)
    reference = {(r["speculator"], r["concurrency"]): r for r in runs
                 if r["pipeline_parallel_size"] == 1 and r["data_parallel_size"] == 1}
    for r in runs:
        ref = reference.get((r["speculator"], r["concurrency"]))
        r["ratio_to_pp1"] = ratio(r["tokens_per_s"], ref["tokens_per_s"]) if ref else None
        r["identical_to_pp1"] = identical(r["outputs"], ref["outputs"]) if ref else None
    for r in runs:
        r.pop("outputs")
    return header("pp") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "concurrency": concurrencies,
        "num_speculative_tokens": args.num_speculative_tokens,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    conc = ", ".join(str(c) for c in report["concurrency"])
    lines = preamble(report, f"Pipeline and data parallelism: greedy requests of {report['max_tokens']} tokens "
                             f"at concurrency {conc}, K={report['num_speculative_tokens']}")
    lines += [
        "| speculator | PP | DP | concurrency | requests | tokens/s | x PP=1 | step period ms | graph steps "
        "| bubbles (mean) | bubbles (worst stage) | transport | DP turn ms | DP vote share "
        "| mean acceptance length | identical to PP=1 | engine start s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        same = MISSING if r["identical_to_pp1"] is None else f"{r['identical_to_pp1']}/{r['num_requests']}"
        dp = f"{r['data_parallel_size']}" + (f" ({r['ranks']})" if r["data_parallel_size"] > 1 else "")
        lines.append(
            f"| {r['speculator']} | {r['pipeline_parallel_size']} | {dp} | {r['concurrency']} | "
            f"{r['num_requests']} | {r['tokens_per_s']:.1f} | {cell(r['ratio_to_pp1'])} | "
            f"{cell(r['step_period_ms'], '.2f')} | {r['num_graph_steps']}/{r['num_steps']} | "
            f"{cell(r['bubble_mean'], '.0%')} | {cell(r['bubble_max'], '.0%')} | "
            f"{r['transport'] or MISSING} | {cell(r['dp_step_period_ms'], '.2f')} | "
            f"{cell(r['dp_vote_share'], '.0%')} | "
            f"{cell(r['spec'].get('mean_acceptance_length'))} | {same} | {r['engine_start_s']:.1f} |")
    lines += ["", "Step period: elapsed / steps (a DP run's steps are rank 0's, as is its acceptance). Bubbles: "
              "the share of the timed run a stage spent not running a step; PP=1 and DP runs have no stages. "
              "DP turn: rank 0's lockstep period, vote to vote; vote share: the part of it spent in the "
              "all-reduce, waiting for the slowest rank included. x PP=1: tokens/s over PP=1's at the same "
              "speculator and concurrency."]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    concurrencies = report["concurrency"]
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(4.5 * len(concurrencies), 4), squeeze=False)
    for ax, c in zip(axes[0], concurrencies, strict=True):
        runs = [r for r in report["runs"] if r["concurrency"] == c]
        labels = [f"{r['speculator']}\nPP={r['pipeline_parallel_size']} DP={r['data_parallel_size']}"
                  + (f" {r['ranks']}" if r["data_parallel_size"] > 1 else "") for r in runs]
        ax.bar(range(len(runs)), [r["tokens_per_s"] for r in runs])
        ax.set_xticks(range(len(runs)), labels, fontsize="xx-small", rotation=90)
        ax.set_title(f"concurrency {c}", fontsize="small")
        ax.set_ylabel("generated tokens/s")
    fig.suptitle(f"Pipeline / data parallelism, {report['platform']} {report['dtype']}")
    fig.tight_layout()
    return fig
