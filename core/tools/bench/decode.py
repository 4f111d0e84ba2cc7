"""decode: decode speed on HumanEval chat prompts, greedy, without speculation and with each
speculator, at batch 1 (concurrency 1: one request after another over --num-prompts prompts)
and at each concurrency C (C streams at once over max(4 x C, --num-prompts) prompts), each
--repeats times on its engine (the table shows the median run by tokens/s and the spread). Per run:
tokens/s, time per output token (per request: (last token - first token) / (n - 1)) at p50 and
p99, time to first token p50, mean acceptance length, target steps/s and the ratio to no
speculation, time to first token p99 and the longest stall (the longest gap between two streamed
outputs of one request). Concurrency C > 1 runs at least 4 x C requests, so that one slow
request does not decide the figure. With transformers importable, the HF peers (hf.py) run the
batch-1 prompts on the same weights; each engine run at batch 1 gets its ratio to each peer, and
the table says how many HF outputs equal the engine's token for token. With vLLM importable, the
vLLM peers (vllm_peer.py: no speculation and ngram) run the same prompt ids at every
concurrency, and every engine run gets its ratio to both at its concurrency.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from ... import registry
from ...frontend.async_engine import AsyncEngine
from ...platform import parse_dtype
from ...sampling_params import SamplingParams
from . import hf as bench_hf
from . import vllm_peer
from .command import (
    MISSING,
    base_config,
    cell,
    concurrency_axis,
    device_name,
    header,
    preamble,
    ratio,
    with_speculator,
)
from .repeats import spread_cell, spread_note
from .streams import chat_prompts, identical, repeated_streams, warm_up


async def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = args.modes or (["process"] if args.process else ["inprocess"])
    speculators = args.speculator or ["ngram"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sizes = {c: args.num_prompts if c == 1 else max(4 * c, args.num_prompts) for c in args.concurrency}
    print(f"bench decode: {len(modes) * (1 + len(speculators))} engines x concurrency {args.concurrency} x "
          f"{args.repeats} repeats: {len(modes) * (1 + len(speculators)) * sum(sizes.values()) * args.repeats} "
          f"requests of up to {args.max_tokens} tokens"
          + ("" if args.no_hf else f"; HF peers: {len(bench_hf.PEERS)} x {args.num_prompts} requests"),
          file=sys.stderr)
    prompts: list[list[int]] = []
    eos_ids: tuple[int, ...] = ()
    info: Any = None
    runs: list[dict[str, Any]] = []
    for mode in modes:
        for name in [None, *speculators]:
            label = name or "none"
            config = with_speculator(msgspec.structs.replace(base_config(args), in_process=mode == "inprocess"),
                                     args, name)
            started = time.monotonic()
            async with AsyncEngine(config) as engine:
                start_s = time.monotonic() - started
                if not prompts:  # the engine's own chat template and tokenizer, for HF too
                    prompts = chat_prompts(engine, max(sizes.values()))
                    eos_ids, info = engine.tokenizer.eos_token_ids, engine.info
                await warm_up(engine, prompts, params, tuple(sizes))
                for c, n in sizes.items():
                    r = await repeated_streams(engine, prompts[:n], params, c, f"{mode} {label} c={c}", args.repeats)
                    runs.append({"mode": mode, "speculator": label, "engine_start_s": start_s} | r)
    peers: dict[str, dict[str, Any]] = {}
    if not args.no_hf and not bench_hf.available():
        print("bench decode: transformers not installed, no HF peers (pip install transformers)", file=sys.stderr)
    elif not args.no_hf:
        device = registry.pick_platform(info.platform).device
        peers = bench_hf.run_peers(args.model, prompts[: args.num_prompts], args.max_tokens, eos_ids,
                                   args.num_speculative_tokens, parse_dtype(info.dtype), device)
    vllm: dict[str, dict[str, Any]] = {}
    if args.no_vllm or info.platform == "cpu":
        pass
    elif not vllm_peer.available():
        print("bench decode: vllm not installed, no vLLM peers", file=sys.stderr)
    else:
        vllm = vllm_peer.run_peers(args.model, info.dtype, prompts, sizes, args.max_tokens,
                                   args.num_speculative_tokens, args.max_num_seqs, info.max_model_len,
                                   args.vllm_peers)
    compare(runs, peers, modes, vllm)
    return header("decode") | {
        "platform": info.platform,
        "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "dataset": "HumanEval (chat template)",
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "num_speculative_tokens": args.num_speculative_tokens,
        "modes": modes,
        "runs": runs,
        "peers": peers,
        "vllm": vllm,
    }


def compare(runs: list[dict[str, Any]], peers: dict[str, dict[str, Any]], modes: list[str],
            vllm: dict[str, dict[str, Any]] | None = None) -> None:
    """Adds the ratios and output checks to each run and peer, then drops the outputs."""
    by_key = {(r["mode"], r["speculator"], r["concurrency"]): r for r in runs}
    vllm_runs = {(name, v["concurrency"]): v for name, peer in (vllm or {}).items() for v in peer.get("runs", [])}
    for r in runs:
        none = by_key[(r["mode"], "none", r["concurrency"])]
        r["ratio_to_none"] = ratio(r["tokens_per_s"], none["tokens_per_s"])
        r["identical_to_none"] = identical(r["outputs"], none["outputs"])
        inproc = by_key.get(("inprocess", r["speculator"], r["concurrency"])) if len(modes) > 1 else None
        r["ratio_to_inprocess"] = ratio(r["tokens_per_s"], inproc["tokens_per_s"]) if inproc else None
        r["ratio_to_peers"] = {p: ratio(r["tokens_per_s"], peer["tokens_per_s"]) for p, peer in peers.items()
                               if r["concurrency"] == 1}
        r["ratio_to_vllm"] = {name: ratio(r["tokens_per_s"], v["tokens_per_s"])
                              for (name, c), v in vllm_runs.items() if c == r["concurrency"]}
    for (_, c), v in vllm_runs.items():
        engine = by_key.get((modes[0], "none", c))
        v["identical_to_engine"] = identical(v["outputs"], engine["outputs"]) if engine else None
    reference = by_key.get((modes[0], "none", 1))
    for peer in peers.values():
        peer["identical_to_engine"] = identical(peer["outputs"], reference["outputs"]) if reference else None
    for item in [*runs, *peers.values(), *vllm_runs.values()]:
        item.pop("outputs")


def host_table(runs: list[dict[str, Any]]) -> list[str]:
    """The engine core's host time per step and per row, by phase, beside the step period and the
    device's time per step: whether the host or the device sets the pace."""
    phases = list(dict.fromkeys(p for r in runs for p in r.get("host_us_per_step", {})))
    if not phases:
        return []
    lines = [
        "",
        "Host time of the engine core by phase (schedule: the scheduler, grammar masks included; launch: the "
        "runner's plan, its copy and the replay or eager launches; apply: the ledger and the governor), per step "
        "and per row launched, beside the step period (elapsed / steps) and the device's time per step (events "
        f"around each step's device work; {MISSING} where not measured: the CPU, where a launch runs the step, and "
        "pipeline stages). The frontend's share is not in these figures.",
        "",
        "| mode | speculator | concurrency | rows a step | step period ms | device ms a step | "
        + " | ".join(f"{p} us a step" for p in phases) + " | " + " | ".join(f"{p} us a row" for p in phases) + " |",
        "|---" * (6 + 2 * len(phases)) + "|",
    ]
    for r in runs:
        per_step, per_row = r.get("host_us_per_step", {}), r.get("host_us_per_row", {})
        lines.append(
            f"| {r['mode']} | {r['speculator']} | {r['concurrency']} | {cell(r.get('rows_per_step'), '.1f')} | "
            f"{cell(r.get('step_period_ms'), '.3f')} | {cell(r.get('device_ms_per_step'), '.3f')} | "
            + " | ".join(cell(per_step.get(p), '.0f') for p in phases) + " | "
            + " | ".join(cell(per_row.get(p), '.1f') for p in phases) + " |")
    return lines


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Decode, {report['dataset']}, greedy, max_tokens {report['max_tokens']}, "
                             f"K={report['num_speculative_tokens']}")
    requests = {r["concurrency"]: r["num_requests"] for r in report["runs"]}
    lines += [
        "Concurrency 1 is batch 1: requests one after another; concurrency C keeps C requests in flight. Requests "
        "per run, by concurrency: " + ", ".join(f"{c}: {n}" for c, n in requests.items()) + ". TPOT: per request, "
        "(last token - first token) / (n - 1). Ratios compare tokens/s. Each row is the run with the median "
        f"tokens/s of {report.get('repeats', 1)} on the same engine (every figure of the row is that run's); "
        "min-max: the tokens/s of all of them, and their spread over the median.",
        "",
    ]
    peer_names = list(report["peers"]) or list(bench_hf.PEERS)
    vllm_names = [n for n, p in report.get("vllm", {}).items() if p.get("runs")]
    lines += [
        "| mode | speculator | concurrency | requests | tokens | tokens/s | tokens/s min-max | TPOT p50 ms | "
        "TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | longest stall ms | kernel builds after start | "
        "mean acceptance length | target steps/s | ratio to none | identical to none | ratio to in-process | "
        + " | ".join(f"vs {p}" for p in [*peer_names, *vllm_names]) + " |",
        "|---" * (18 + len(peer_names) + len(vllm_names)) + "|",
    ]
    for r in report["runs"]:
        vs = [cell(r["ratio_to_peers"].get(p)) for p in peer_names]
        vs += [cell(r.get("ratio_to_vllm", {}).get(p)) for p in vllm_names]
        lines.append(
            f"| {r['mode']} | {r['speculator']} | {r['concurrency']} | {r['num_requests']} | "
            f"{r['generated_tokens']} | {r['tokens_per_s']:.1f} | {spread_cell(r)} | {cell(r['tpot_p50_ms'])} | "
            f"{cell(r['tpot_p99_ms'])} | {cell(r['ttft_p50_ms'], '.1f')} | {cell(r.get('ttft_p99_ms'), '.1f')} | "
            f"{cell(r.get('longest_stall_ms'), '.1f')} | {r.get('kernel_builds_after_start', MISSING)} | "
            f"{cell(r['spec']['mean_acceptance_length'])} | {r['steps_per_s']:.1f} | {cell(r['ratio_to_none'])} | "
            f"{r['identical_to_none']}/{r['num_requests']} | {cell(r['ratio_to_inprocess'])} | "
            + " | ".join(vs) + " |")
    lines += spread_note(report["runs"], lambda r: f"{r['mode']} {r['speculator']} c={r['concurrency']}")
    lines += host_table(report["runs"])
    for name, peer in report.get("vllm", {}).items():
        if not peer.get("runs"):
            lines += ["", f"vLLM peer {name}: {peer.get('error', 'no runs')}"]
            continue
        lines += [
            "",
            f"vLLM {peer.get('version', '?')} peer {name} (same prompt token ids, greedy, CUDA graphs, its defaults"
            + (f", ngram K={peer['speculative_config']['num_speculative_tokens']}" if peer.get("speculative_config")
               else "") + f"; start-up {peer['start_s']:.1f} s, not in tokens/s):",
            "",
            "| concurrency | requests | tokens | tokens/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | "
            "longest stall ms | identical to engine (none) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in peer["runs"]:
            same = (MISSING if v.get("identical_to_engine") is None
                    else f"{v['identical_to_engine']}/{v['num_requests']}")
            lines.append(
                f"| {v['concurrency']} | {v['num_requests']} | {v['generated_tokens']} | {v['tokens_per_s']:.1f} | "
                f"{cell(v['tpot_p50_ms'])} | {cell(v['tpot_p99_ms'])} | {cell(v['ttft_p50_ms'], '.1f')} | "
                f"{cell(v['ttft_p99_ms'], '.1f')} | {cell(v['longest_stall_ms'], '.1f')} | {same} |")
    if report["peers"]:
        lines += [
            "",
            "HF transformers peers, batch 1, same weights, dtype, device and prompt token ids "
            "(setup: warm-up, and compilation for the static cache; not in tokens/s):",
            "",
            "| peer | requests | tokens | tokens/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | setup s | "
            "identical to engine (none, batch 1) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, p in report["peers"].items():
            same = MISSING if p["identical_to_engine"] is None else f"{p['identical_to_engine']}/{p['num_requests']}"
            lines.append(
                f"| {name} | {p['num_requests']} | {p['generated_tokens']} | {p['tokens_per_s']:.1f} | "
                f"{cell(p['tpot_p50_ms'])} | {cell(p['tpot_p99_ms'])} | {cell(p['ttft_p50_ms'], '.1f')} | "
                f"{p['setup_s']:.1f} | {same} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, (tps, tpot) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in report["runs"]:
        label = r["speculator"] if len(report["modes"]) == 1 else f"{r['speculator']} ({r['mode']})"
        series.setdefault(label, []).append(r)
    for label, rows in series.items():
        xs = [r["concurrency"] for r in rows]
        tps.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        tpot.plot(xs, [r["tpot_p50_ms"] or 0.0 for r in rows], marker="o", label=label)
    for name, peer in report.get("vllm", {}).items():
        if peer.get("runs"):
            tps.plot([v["concurrency"] for v in peer["runs"]], [v["tokens_per_s"] for v in peer["runs"]],
                     marker="s", linestyle="--", label=name)
            tpot.plot([v["concurrency"] for v in peer["runs"]], [v["tpot_p50_ms"] or 0.0 for v in peer["runs"]],
                      marker="s", linestyle="--", label=name)
    for name, p in report["peers"].items():
        tps.scatter([1], [p["tokens_per_s"]], marker="x", label=name)
        tpot.scatter([1], [p["tpot_p50_ms"] or 0.0], marker="x", label=name)
    concurrencies = sorted({r["concurrency"] for r in report["runs"]})
    for ax, ylabel in ((tps, "tokens/s"), (tpot, "time per output token p50 (ms)")):
        concurrency_axis(ax, concurrencies, "concurrency (1: batch 1)", ylabel)
    tps.set_title(f"Decode, {report['platform']} {report['dtype']}, max_tokens {report['max_tokens']}")
    return fig
