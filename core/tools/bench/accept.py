"""accept: acceptance of each speculator on the 164 HumanEval prompts, or on the 64 held-out
general-chat requests (`--dataset chat`: how much holds off the code domain), as chats at
temperature 0, next to a run without speculation on the same engine settings, whose output
every speculative run must reproduce token for token.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
import msgspec

from ...config import EngineConfig
from ...frontend.async_engine import AsyncEngine
from ...progress import Progress
from ...sampling_params import SamplingParams
from ..datasets import humaneval_messages
from ..general_chat import general_chat_messages
from .command import base_config, header, with_speculator


async def run_one(config: EngineConfig, conversations: list[list[dict[str, str]]],
                  params: SamplingParams, label: str, concurrency: int = 0) -> dict[str, Any]:
    async with AsyncEngine(config) as engine:
        outputs: list[list[int]] = [[] for _ in conversations]
        bar = Progress(f"bench accept: {label}", len(conversations), len(conversations) * params.max_tokens)
        limit = anyio.Semaphore(concurrency or len(conversations))
        if concurrency:  # compile and capture before the clock starts
            async for _ in engine.chat(conversations[0], msgspec.structs.replace(params, max_tokens=8)):
                pass

        async def one(i: int) -> None:
            async with limit:
                async for out in engine.chat(conversations[i], params):
                    outputs[i] = out.token_ids
                    bar.tokens(len(out.delta_token_ids))
            bar.request_done()

        started = time.monotonic()
        with bar:
            async with anyio.create_task_group() as tg:
                for i in range(len(conversations)):
                    tg.start_soon(one, i)
        elapsed = time.monotonic() - started
        stats = await engine.stats()
        info = engine.info
    generated = sum(len(o) for o in outputs)
    return {"outputs": outputs, "elapsed_s": elapsed, "generated_tokens": generated,
            "tokens_per_s": generated / elapsed, "num_steps": stats["num_steps"], "spec": stats["spec"],
            "platform": info.platform, "dtype": info.dtype}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chat = args.dataset == "chat"
    conversations = (general_chat_messages() if chat else humaneval_messages())[: args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    base = base_config(args)
    runs: dict[str, Any] = {}
    for name in [None, *(args.speculator or ["ngram", "draft_model"])]:
        config = with_speculator(base, args, name)
        label = "none" if name is None else f"{config.speculator}{args.label or ''}"
        if name is not None and ":" in name:
            label = f"{label} K={config.num_speculative_tokens}"
            if config.speculator_options:  # runs of one speculator with other options must not share a row
                label = f"{label} " + ",".join(f"{k}={v}" for k, v in config.speculator_options.items())
        print(f"bench accept: {label} on {len(conversations)} prompts", file=sys.stderr)
        runs[label] = await run_one(config, conversations, params, label, args.concurrency)
    reference = runs["none"]["outputs"]
    for r in runs.values():
        r["identical_to_no_speculation"] = sum(a == b for a, b in zip(r["outputs"], reference, strict=True))
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / runs["none"]["tokens_per_s"]
        r.pop("outputs")
    return header("accept") | {
        "dataset": f"{'held-out general chat' if chat else 'HumanEval'} ({len(conversations)} prompts, "
                   "chat template)",
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "concurrency": args.concurrency or len(conversations),
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    first = next(iter(report["runs"].values()))
    lines = [
        f"# Acceptance on {report['dataset']}, temperature 0, max_tokens {report['max_tokens']}, "
        f"K={report['num_speculative_tokens']} unless the row says, {report.get('concurrency', 'all')} requests in "
        "flight",
        "",
        f"Command: `{report['command']}`  ",
        f"Platform: {first['platform']} ({first['dtype']}), host {report['host']}",
        "",
        "| speculator | acceptance rate | mean acceptance length | acceptance per position | "
        "draft tokens | accepted | K=0 steps | host draft copies | steps | tokens/s | ratio to none "
        "| identical to none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        s = r["spec"]
        per_pos = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
        lines.append(
            f"| {name} | {s['acceptance_rate']:.3f} | {s['mean_acceptance_length']:.2f} | {per_pos} | "
            f"{s['num_draft_tokens']} | {s['num_accepted_tokens']} | {s['num_k0_steps']} | "
            f"{s['num_host_draft_copies']} | {r['num_steps']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s_ratio']:.2f} | {r['identical_to_no_speculation']} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in report["runs"].items():
        per_pos = r["spec"]["acceptance_per_position"]
        if per_pos:
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance per position, {report['dataset'].split(' (')[0]}, temperature 0")
    ax.legend()
    return fig
