"""hostsync: what keeping draft IDs on the device saves. A fixed-width speculator needs no host
copy of its drafts, nor does a variable-width one where steps are planned on the device (its
drafts are padded there); `EngineConfig.force_host_drafts` makes the engine copy them after every
drafting step anyway, as a variable-width speculator must on the CPU. Both settings run the same greedy
HumanEval requests at batch 1 and at a concurrency: target steps/s, tokens/s, host draft copies,
and the ratio of keeping the drafts on the device to copying them; each --repeats times (the
median run by tokens/s, with the spread).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from ... import registry
from ...errors import InvalidInputError
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams
from .command import base_config, cell, device_name, header, preamble, ratio, with_speculator
from .repeats import spread_cell, spread_note
from .streams import chat_prompts, identical, repeated_streams, warm_up


async def run(args: argparse.Namespace) -> dict[str, Any]:
    platform = registry.pick_platform(args.platform)
    if (registry.load("speculator", args.speculator).capabilities.draft_width != "fixed"
            and not getattr(platform.attention_backend(16, 16), "device_planned", False)):
        raise InvalidInputError(f"hostsync: {args.speculator!r} drafts a variable number of tokens, which travel to "
                                f"the host on {platform.name} (its steps are planned on the host); take a "
                                "fixed-width speculator")
    if args.speculator_option is None:  # the default options, recorded in the report as if given
        args = argparse.Namespace(**vars(args) | {
            "speculator_option": ["num_layers=4"] if args.speculator == "draft_model" else []})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sizes = {c: args.num_prompts if c == 1 else max(c, args.num_prompts) for c in args.concurrency}
    prompts: list[list[int]] = []
    info: Any = None
    runs: list[dict[str, Any]] = []
    for force in (False, True):
        config = msgspec.structs.replace(with_speculator(base_config(args), args, args.speculator),
                                         force_host_drafts=force)
        started = time.monotonic()
        async with AsyncEngine(config) as engine:
            start_s = time.monotonic() - started
            if not prompts:
                prompts = chat_prompts(engine, max(sizes.values()))
                info = engine.info
            await warm_up(engine, prompts, params, tuple(sizes))
            for c, n in sizes.items():
                r = await repeated_streams(engine, prompts[:n], params, c, f"force_host_drafts={force} c={c}",
                                           args.repeats)
                runs.append({"force_host_drafts": force, "engine_start_s": start_s} | r)
    by_key = {(r["force_host_drafts"], r["concurrency"]): r for r in runs}
    for r in runs:
        copied = by_key[(True, r["concurrency"])]
        r["ratio_to_host_copies"] = ratio(r["tokens_per_s"], copied["tokens_per_s"])
        r["identical_to_host_copies"] = identical(r["outputs"], copied["outputs"])
    for r in runs:
        r.pop("outputs")
    if not any(r["spec"]["num_host_draft_copies"] for r in runs):
        print("bench hostsync: no host draft copies in any run: force_host_drafts had no effect", file=sys.stderr)
    return header("hostsync") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "speculator": args.speculator,
        "speculator_options": args.speculator_option,
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "repeats": args.repeats,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    options = " ".join(report["speculator_options"])
    lines = preamble(report, f"Host draft copies, {report['speculator']} {options}, "
                             f"K={report['num_speculative_tokens']}, HumanEval chat prompts, greedy, "
                             f"max_tokens {report['max_tokens']}")
    lines += [
        "Ratio: tokens/s over the same concurrency with force_host_drafts (a copy of the draft IDs to the host "
        "after every drafting step).",
        "",
        "| force_host_drafts | concurrency | requests | tokens | tokens/s | tokens/s min-max | target steps/s | "
        "host draft copies | mean acceptance length | TPOT p50 ms | ratio | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['force_host_drafts']} | {r['concurrency']} | {r['num_requests']} | {r['generated_tokens']} | "
            f"{r['tokens_per_s']:.1f} | {spread_cell(r)} | {r['steps_per_s']:.1f} | "
            f"{r['spec']['num_host_draft_copies']} | "
            f"{cell(r['spec']['mean_acceptance_length'])} | {cell(r['tpot_p50_ms'])} | "
            f"{cell(r['ratio_to_host_copies'])} | {r['identical_to_host_copies']}/{r['num_requests']} |")
    return lines + spread_note(report["runs"], lambda r: f"force_host_drafts={r['force_host_drafts']} "
                                                         f"c={r['concurrency']}")


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    concurrencies = sorted({r["concurrency"] for r in report["runs"]})
    width = 0.4
    for j, force in enumerate((False, True)):
        rows = {r["concurrency"]: r for r in report["runs"] if r["force_host_drafts"] == force}
        ax.bar([i + (j - 0.5) * width for i in range(len(concurrencies))],
               [rows[c]["steps_per_s"] for c in concurrencies], width,
               label="drafts copied to the host" if force else "drafts stay on the device")
    ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("target steps/s")
    ax.set_title(f"Host draft copies, {report['speculator']}, {report['platform']} {report['dtype']}")
    ax.legend()
    return fig
