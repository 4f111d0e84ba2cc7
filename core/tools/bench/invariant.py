"""invariant: what the batch-invariant mode (`--batch-invariant`) buys and costs. For no
speculation and each speculator, at batch 1 (one request after another) and at one concurrency,
in the default mode and in the batch-invariant one, on HumanEval chat prompts, greedy: tokens/s,
and how many outputs equal the same mode's plain greedy output (no speculation, batch 1) token
for token; plus each batch-invariant run's tokens/s over the default run's (its slowdown).

In bf16 the default mode's verification steps run the target's matmuls on other shapes than
decode steps, and near-ties flip; the batch-invariant mode must match on every prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from ... import registry
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams
from .command import MISSING, base_config, cell, device_name, header, preamble, ratio, with_speculator
from .streams import chat_prompts, identical, run_streams, warm_up

MODES = {"default": False, "invariant": True}
"""Mode name: EngineConfig.batch_invariant."""
DEFAULT_SPECULATORS = ["ngram:4", "mtp:3", "eagle3:3", "dflash:7", "dspark:4", "causal_cascade:4"]
"""ngram and the learned drafters with the K their shipped checkpoints are measured at."""


async def run(args: argparse.Namespace) -> dict[str, Any]:
    speculators = args.speculator or DEFAULT_SPECULATORS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    concurrencies = sorted({1, args.concurrency})
    engines = len(MODES) * (1 + len(speculators))
    print(f"bench invariant: {engines} engines x concurrency {concurrencies}: "
          f"{engines * len(concurrencies) * args.num_prompts} requests of up to {args.max_tokens} tokens",
          file=sys.stderr)
    prompts: list[list[int]] = []
    info: Any = None
    runs: list[dict[str, Any]] = []
    for mode, batch_invariant in MODES.items():
        for name in [None, *speculators]:
            config = with_speculator(msgspec.structs.replace(base_config(args), batch_invariant=batch_invariant),
                                     args, name)
            label = name.partition(":")[0] if name else "none"
            started = time.monotonic()
            async with AsyncEngine(config) as engine:
                start_s = time.monotonic() - started
                if not prompts:
                    prompts = chat_prompts(engine, args.num_prompts)
                    info = engine.info
                await warm_up(engine, prompts, params, tuple(concurrencies))
                for c in concurrencies:
                    r = await run_streams(engine, prompts, params, c, f"{mode} {label} c={c}")
                    runs.append({"mode": mode, "speculator": label, "num_speculative_tokens":
                                 config.num_speculative_tokens if name else 0, "engine_start_s": start_s} | r)
    compare(runs)
    return header("invariant") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "dataset": "HumanEval (chat template)",
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "concurrency": concurrencies,
        "runs": runs,
    }


def compare(runs: list[dict[str, Any]]) -> None:
    """Adds each run's output checks against its mode's plain runs and the batch-invariant runs'
    speed over the default ones, then drops the outputs."""
    by_key = {(r["mode"], r["speculator"], r["concurrency"]): r for r in runs}
    for r in runs:
        plain_1 = by_key[(r["mode"], "none", 1)]
        r["identical_to_plain_batch1"] = identical(r["outputs"], plain_1["outputs"])
        r["identical_to_plain_same_concurrency"] = identical(r["outputs"], by_key[(r["mode"], "none",
                                                                                  r["concurrency"])]["outputs"])
        default = by_key.get(("default", r["speculator"], r["concurrency"]))
        r["ratio_to_default"] = ratio(r["tokens_per_s"], default["tokens_per_s"]) if default else None
    for r in runs:
        r.pop("outputs")


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Batch-invariant mode, {report['dataset']}, greedy, max_tokens {report['max_tokens']}")
    lines += [
        f"{report['num_prompts']} prompts per run; concurrency 1 is batch 1 (one request after another), concurrency "
        "C keeps C requests in flight. Identical: outputs equal token for token to the same mode's run without "
        "speculation at batch 1, and at the same concurrency. vs default: tokens/s over the default mode's "
        "same run (the batch-invariant mode's cost).",
        "",
        "| mode | speculator | K | concurrency | requests | tokens | tokens/s | TPOT p50 ms | mean acceptance length | "
        "identical to plain (batch 1) | identical to plain (same concurrency) | vs default | "
        "kernel builds after start |",
        "|---" * 13 + "|",
    ]
    for r in report["runs"]:
        n = r["num_requests"]
        lines.append(
            f"| {r['mode']} | {r['speculator']} | {r['num_speculative_tokens'] or MISSING} | {r['concurrency']} | "
            f"{n} | {r['generated_tokens']} | {r['tokens_per_s']:.1f} | {cell(r['tpot_p50_ms'])} | "
            f"{cell(r['spec']['mean_acceptance_length'])} | {r['identical_to_plain_batch1']}/{n} | "
            f"{r['identical_to_plain_same_concurrency']}/{n} | "
            f"{cell(r['ratio_to_default']) if r['mode'] != 'default' else MISSING} | "
            f"{r.get('kernel_builds_after_start', MISSING)} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    concurrencies = report["concurrency"]
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5.5 * len(concurrencies), 4), squeeze=False)
    names = list(dict.fromkeys(r["speculator"] for r in report["runs"]))
    width = 0.8 / len(MODES)
    for ax, c in zip(axes[0], concurrencies, strict=True):
        for j, mode in enumerate(MODES):
            rows = {r["speculator"]: r for r in report["runs"] if r["mode"] == mode and r["concurrency"] == c}
            xs = [i + (j - (len(MODES) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [rows[s]["tokens_per_s"] if s in rows else 0.0 for s in names], width, label=mode)
            for x, s in zip(xs, names, strict=True):
                if s in rows:
                    ax.annotate(f"{rows[s]['identical_to_plain_batch1']}/{rows[s]['num_requests']}",
                                (x, rows[s]["tokens_per_s"]), ha="center", va="bottom", fontsize="x-small")
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{'batch 1' if c == 1 else f'concurrency {c}'} (labels: identical to plain)", fontsize="small")
        ax.legend(fontsize="small")
    fig.suptitle(f"Batch-invariant vs default, {report['platform']} {report['dtype']}, "
                 f"max_tokens {report['max_tokens']}")
    return fig
