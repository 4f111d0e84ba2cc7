"""prefill: prefill-only requests (max_tokens=1) with long prompts, where no draft can ever be
verified: with skip_drafts the engine runs those steps at K=0 (no drafting); without it the
speculator drafts for nothing. Prompts are windows of --prompt-tokens tokens over the HumanEval
prompts' tokens, one after another. Per run: prefill tokens/s (prompt tokens / elapsed), steps,
K=0 steps, the ratio of skipping to not skipping, and the ratio to no speculation; each --repeats
times (the median run by prefill tokens/s, with the spread).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from ... import registry
from ...errors import InvalidInputError
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams
from ..datasets import humaneval_prompts
from .command import (
    MISSING,
    base_config,
    cell,
    device_name,
    header,
    preamble,
    ratio,
    with_speculator,
)
from .repeats import spread_cell, spread_note
from .streams import repeated_streams, warm_up


def long_prompts(stream: list[int], length: int, n: int) -> list[list[int]]:
    """n consecutive windows of `length` tokens over `stream`, wrapping round at its end."""
    return [[stream[(i * length + j) % len(stream)] for j in range(length)] for i in range(n)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_model_len and args.prompt_tokens >= args.max_model_len:
        raise InvalidInputError(f"--prompt-tokens {args.prompt_tokens} must be below --max-model-len "
                                f"{args.max_model_len}")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    configs: list[tuple[str, bool | None]] = [("none", None)]
    configs += [(name, skip) for name in args.speculator or ["ngram"] for skip in (True, False)]
    prompts: list[list[int]] = []
    info: Any = None
    runs: list[dict[str, Any]] = []
    for name, skip in configs:
        config = base_config(args)
        if skip is not None:
            config = msgspec.structs.replace(with_speculator(config, args, name), skip_drafts=skip)
        started = time.monotonic()
        async with AsyncEngine(config) as engine:
            start_s = time.monotonic() - started
            if not prompts:
                stream = [t for text in humaneval_prompts()
                          for t in engine.tokenizer.encode(text, add_special_tokens=False)]
                prompts = long_prompts(stream, args.prompt_tokens, args.num_prompts)
                info = engine.info
            await warm_up(engine, prompts, params, tuple(args.concurrency))
            for c in args.concurrency:
                r = await repeated_streams(engine, prompts, params, c, f"{name} skip_drafts={skip} c={c}",
                                           args.repeats, key="prefill_tokens_per_s")
                r.pop("outputs")
                runs.append({"speculator": name, "skip_drafts": skip, "engine_start_s": start_s} | r)
    by_key = {(r["speculator"], r["skip_drafts"], r["concurrency"]): r for r in runs}
    for r in runs:
        off = by_key.get((r["speculator"], False, r["concurrency"]))
        r["ratio_to_no_skip"] = ratio(r["prefill_tokens_per_s"], off["prefill_tokens_per_s"]) if off else None
        r["ratio_to_none"] = ratio(r["prefill_tokens_per_s"],
                                   by_key[("none", None, r["concurrency"])]["prefill_tokens_per_s"])
    return header("prefill") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "prompt_tokens": args.prompt_tokens,
        "num_prompts": args.num_prompts,
        "num_speculative_tokens": args.num_speculative_tokens,
        "repeats": args.repeats,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Prefill-only requests (max_tokens 1), {report['num_prompts']} prompts of "
                             f"{report['prompt_tokens']} tokens (HumanEval), K={report['num_speculative_tokens']}")
    lines += [
        "| speculator | skip_drafts | concurrency | prompt tokens | elapsed s | prefill tokens/s | "
        "prefill tokens/s min-max | steps | K=0 steps | host draft copies | ratio to skip_drafts off | ratio to none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        skip = MISSING if r["skip_drafts"] is None else r["skip_drafts"]
        lines.append(
            f"| {r['speculator']} | {skip} | {r['concurrency']} | {r['prompt_tokens']} | {r['elapsed_s']:.2f} | "
            f"{r['prefill_tokens_per_s']:.0f} | {spread_cell(r, '.0f')} | {r['num_steps']} | "
            f"{r['spec']['num_k0_steps']} | "
            f"{r['spec']['num_host_draft_copies']} | {cell(r['ratio_to_no_skip'])} | {cell(r['ratio_to_none'])} |")
    return lines + spread_note(report["runs"], lambda r: f"{r['speculator']} skip_drafts={r['skip_drafts']} "
                                                         f"c={r['concurrency']}")


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values = [], []
    for r in report["runs"]:
        skip = "" if r["skip_drafts"] is None else f"\nskip={r['skip_drafts']}"
        labels.append(f"{r['speculator']}{skip}\nc={r['concurrency']}")
        values.append(r["prefill_tokens_per_s"])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize="small")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title(f"Prefill only, {report['prompt_tokens']}-token prompts, {report['platform']} {report['dtype']}")
    return fig
