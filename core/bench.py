"""`speckernel bench SCENARIO`: measurements side by side in one run, written as JSON, a
markdown table and a plot.

accept: acceptance of each speculator on the 164 HumanEval prompts (chat template,
temperature 0), next to a run without speculation on the same engine settings, whose output
every speculative run must reproduce token for token.
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
from tqdm import tqdm

from .async_engine import AsyncEngine
from .config import EngineConfig
from .datasets import humaneval_messages
from .sampling_params import SamplingParams


def add_arguments(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark scenarios (JSON, markdown table, plot)")
    scenarios = bench.add_subparsers(dest="scenario", required=True)
    acc = scenarios.add_parser("accept", help="acceptance per speculator on HumanEval")
    acc.add_argument("--speculator", action="append", default=None,
                     help="speculator to measure (repeatable; default: ngram and draft_model)")
    acc.add_argument("--num-speculative-tokens", type=int, default=4)
    acc.add_argument("--draft-model", default=None)
    acc.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE")
    acc.add_argument("--label", default=None, help="name of the speculative runs in the table")
    acc.add_argument("--max-tokens", type=int, default=256)
    acc.add_argument("--limit", type=int, default=None, help="first N prompts only")
    acc.add_argument("--max-num-seqs", type=int, default=64)
    acc.add_argument("--model", default="smollm2-135m")
    acc.add_argument("--platform", default=None)
    acc.add_argument("--dtype", default=None, help="float32 makes speculative and plain greedy runs bit-comparable")
    acc.add_argument("--out", default="bench-results/accept")


async def run_one(config: EngineConfig, conversations: list[list[dict[str, str]]],
                  params: SamplingParams, label: str) -> dict[str, Any]:
    async with AsyncEngine(config) as engine:
        outputs: list[list[int]] = [[] for _ in conversations]
        bar = tqdm(total=len(conversations), desc=label, unit="req", file=sys.stderr, disable=None)

        async def one(i: int) -> None:
            async for out in engine.chat(conversations[i], params):
                outputs[i] = out.token_ids
            bar.update(1)

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


async def bench_accept(args: argparse.Namespace) -> dict[str, Any]:
    conversations = humaneval_messages()[: args.limit]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    base = EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=2048, in_process=True)
    runs: dict[str, Any] = {}
    for name in [None, *(args.speculator or ["ngram", "draft_model"])]:
        from .cli import parse_options

        config = base if name is None else msgspec.structs.replace(
            base, speculator=name, num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
            speculator_options=parse_options(args.speculator_option))
        label = "none" if name is None else f"{name}{args.label or ''}"
        print(f"bench accept: {label} on {len(conversations)} prompts", file=sys.stderr)
        runs[label] = await run_one(config, conversations, params, label)
    reference = runs["none"]["outputs"]
    for run in runs.values():
        run["identical_to_no_speculation"] = sum(a == b for a, b in zip(run["outputs"], reference, strict=True))
        run["tokens_per_s_ratio"] = run["tokens_per_s"] / runs["none"]["tokens_per_s"]
        run.pop("outputs")
    return {
        "scenario": "accept",
        "command": "speckernel " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "dataset": f"HumanEval ({len(conversations)} prompts, chat template)",
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "host": f"{host_platform.machine()} {host_platform.system()}",
        "runs": runs,
    }


def write_accept(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "accept.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Acceptance on {report['dataset']}, temperature 0, max_tokens {report['max_tokens']}, "
        f"K={report['num_speculative_tokens']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Platform: {next(iter(report['runs'].values()))['platform']} "
        f"({next(iter(report['runs'].values()))['dtype']}), host {report['host']}",
        "",
        "| speculator | acceptance rate | mean acceptance length | acceptance per position | "
        "draft tokens | accepted | K=0 steps | host draft copies | steps | tokens/s | ratio to none "
        "| identical to none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in report["runs"].items():
        s = run["spec"]
        per_pos = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
        lines.append(
            f"| {name} | {s['acceptance_rate']:.3f} | {s['mean_acceptance_length']:.2f} | {per_pos} | "
            f"{s['num_draft_tokens']} | {s['num_accepted_tokens']} | {s['num_k0_steps']} | "
            f"{s['num_host_draft_copies']} | {run['num_steps']} | {run['tokens_per_s']:.1f} | "
            f"{run['tokens_per_s_ratio']:.2f} | {run['identical_to_no_speculation']} |")
    (out / "accept.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed, no plot (pip install 'speckernel[bench]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in report["runs"].items():
        per_pos = run["spec"]["acceptance_per_position"]
        if per_pos:
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per position, HumanEval, temperature 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accept.png", dpi=120)


def main(args: argparse.Namespace) -> int:
    report = anyio.run(bench_accept, args)
    write_accept(report, Path(args.out))
    print((Path(args.out) / "accept.md").read_text())
    return 0
