"""accept: acceptance of each speculator on the 164 HumanEval prompts, or on the 64 held-out
general-chat requests (`--dataset chat`: how much holds off the code domain), as chats at each
`--temperature` (default 0), next to a run without speculation on the same engine settings and
temperature. Every speculative run must reproduce that run's output token for token, sampled ones
too (request i draws with seed `--seed` + i, and verification draws the plain sampler's
uniforms), except a speculator whose drafts are sampled from its own distribution.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
import msgspec

from ... import registry
from ...config import EngineConfig
from ...frontend.async_engine import AsyncEngine
from ...progress import Progress
from ...sampling_params import SamplingParams
from ..datasets import humaneval_messages
from ..general_chat import general_chat_messages
from .command import MISSING, base_config, cell, header, with_speculator


async def run_one(config: EngineConfig, conversations: list[list[dict[str, str]]],
                  params: list[SamplingParams], label: str, concurrency: int = 0) -> dict[str, Any]:
    """One engine for one speculator at one temperature: its counters are engine-wide, so a
    fresh engine makes them this run's alone. params[i] is request i's (its own seed)."""
    async with AsyncEngine(config) as engine:
        outputs: list[list[int]] = [[] for _ in conversations]
        bar = Progress(f"bench accept: {label}", len(conversations), len(conversations) * params[0].max_tokens)
        limit = anyio.Semaphore(concurrency or len(conversations))
        if concurrency:  # compile and capture before the clock starts
            async for _ in engine.chat(conversations[0], msgspec.structs.replace(params[0], max_tokens=8)):
                pass

        async def one(i: int) -> None:
            async with limit:
                async for out in engine.chat(conversations[i], params[i]):
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


def sampled_drafts(speculator: str | None) -> bool:
    """The speculator's drafts are sampled from its own distribution (verified by rejection
    sampling): its sampled output equals the plain run's in distribution only."""
    return speculator is not None and registry.load("speculator", speculator).capabilities.sampled_drafts


def request_params(max_tokens: int, temperature: float, seed: int, n: int) -> list[SamplingParams]:
    """Greedy requests as before; sampled request i with seed `seed + i`, so that a sampled run
    repeats and every run at that temperature draws from the same streams."""
    if temperature == 0.0:
        return [SamplingParams(max_tokens=max_tokens, temperature=0.0)] * n
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i) for i in range(n)]


def temperature_text(temperature: float) -> str:
    return format(temperature, "g")


def run_key(label: str, temperature: float) -> str:
    """A run's key in `runs`: the row's label at temperature 0 (the layout of reports before
    `--temperature`), `label@T=1` at another."""
    return label if temperature == 0.0 else f"{label}@T={temperature_text(temperature)}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chat = args.dataset == "chat"
    conversations = (general_chat_messages() if chat else humaneval_messages())[: args.num_prompts]
    temperatures: list[float] = getattr(args, "temperature", None) or [0.0]
    seed: int = getattr(args, "seed", 0)
    base = base_config(args)
    runs: dict[str, Any] = {}
    for temperature in temperatures:
        params = request_params(args.max_tokens, temperature, seed, len(conversations))
        for name in [None, *(args.speculator or ["ngram", "draft_model"])]:
            config = with_speculator(base, args, name)
            label = "none" if name is None else f"{config.speculator}{args.label or ''}"
            if name is not None and ":" in name:
                label = f"{label} K={config.num_speculative_tokens}"
                if config.speculator_options:  # runs of one speculator with other options must not share a row
                    label = f"{label} " + ",".join(f"{k}={v}" for k, v in config.speculator_options.items())
            key = run_key(label, temperature)
            print(f"bench accept: {key} on {len(conversations)} prompts", file=sys.stderr)
            runs[key] = {"name": label, "temperature": temperature,
                         "coupled": temperature == 0.0 or not sampled_drafts(config.speculator)} | await run_one(
                config, conversations, params, key, args.concurrency)
    for temperature in temperatures:
        none = runs[run_key("none", temperature)]
        for r in (r for r in runs.values() if r["temperature"] == temperature):
            # Sampled too: verification draws the plain sampler's uniforms (`runner.verify`), so a seeded
            # request gives the plain run's tokens, unless the drafts were sampled from a distribution
            # of the drafter's own (`sampled_drafts`: equal in distribution only, not compared).
            r["identical_to_no_speculation"] = (
                sum(a == b for a, b in zip(r["outputs"], none["outputs"], strict=True)) if r.pop("coupled")
                else None)
            r["tokens_per_s_ratio"] = r["tokens_per_s"] / none["tokens_per_s"]
    for r in runs.values():
        r.pop("outputs")
    return header("accept") | {
        "dataset": f"{'held-out general chat' if chat else 'HumanEval'} ({len(conversations)} prompts, "
                   "chat template)",
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "concurrency": args.concurrency or len(conversations),
        "temperatures": temperatures,
        "seed": seed,
        "runs": runs,
    }


def report_temperatures(report: dict[str, Any]) -> list[float]:
    """The temperatures run, in order (reports from before `--temperature` ran 0 alone)."""
    return report.get("temperatures") or [0.0]


def markdown(report: dict[str, Any]) -> list[str]:
    first = next(iter(report["runs"].values()))
    temperatures = report_temperatures(report)
    lines = [
        f"# Acceptance on {report['dataset']}, temperature "
        f"{' and '.join(temperature_text(t) for t in temperatures)}, max_tokens {report['max_tokens']}, "
        f"K={report['num_speculative_tokens']} unless the row says, {report.get('concurrency', 'all')} requests in "
        "flight",
        "",
        f"Command: `{report['command']}`  ",
        f"Platform: {first['platform']} ({first['dtype']}), host {report['host']}",
    ]
    for temperature in temperatures:
        lines += ["", f"## Temperature {temperature_text(temperature)}", ""]
        if temperature != 0.0:
            lines += [f"Sampled: request i draws with seed {report.get('seed', 0)} + i; verification draws the plain "
                      "sampler's uniforms, so the outputs equal none's token for token, unless the speculator's drafts "
                      f"are sampled from its own distribution ({MISSING}).", ""]
        lines += [
            "| speculator | acceptance rate | mean acceptance length | acceptance per position | "
            "draft tokens | accepted | K=0 steps | host draft copies | steps | tokens/s | ratio to none "
            "| identical to none |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, r in report["runs"].items():
            if r.get("temperature", 0.0) != temperature:
                continue
            s = r["spec"]
            per_pos = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
            identical = r["identical_to_no_speculation"]
            lines.append(
                f"| {r.get('name', key)} | {s['acceptance_rate']:.3f} | {cell(s['mean_acceptance_length'])} | "
                f"{per_pos} | {s['num_draft_tokens']} | {s['num_accepted_tokens']} | {s['num_k0_steps']} | "
                f"{s['num_host_draft_copies']} | {r['num_steps']} | {r['tokens_per_s']:.1f} | "
                f"{r['tokens_per_s_ratio']:.2f} | {MISSING if identical is None else identical} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    """One panel per temperature, side by side on one scale; a speculator keeps its colour."""
    temperatures = report_temperatures(report)
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), sharey=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(r.get("name", key) for key, r in report["runs"].items()))
    dataset = report["dataset"].split(" (")[0]
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for key, r in report["runs"].items():
            per_pos = r["spec"]["acceptance_per_position"]
            if r.get("temperature", 0.0) != temperature or not per_pos:
                continue
            name = r.get("name", key)
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=f"{name}, T={temperature_text(temperature)}",
                    color=colours[names.index(name) % len(colours)])
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Acceptance per position, {dataset}, temperature {temperature_text(temperature)}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[0][0].set_ylabel("acceptance (accepted / drafted)")
    return fig
