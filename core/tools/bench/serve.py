"""serve: HTTP load against `speckernel serve`, the way a client sees it. Streaming chat
requests (HumanEval prompts, greedy) at each concurrency C (C requests in flight over
max(C, --num-prompts) prompts), through httpx2 (the HTTP client the `openai` package uses).
Per run: requests/s, tokens/s, time to first token and time per output token at p50 and p99,
and the speculation counters from the server's /metrics over that run alone. With --hostile F,
each load runs a second time with hostile requests added (F of all requests: hostile.KINDS) and
the report puts the two side by side: how each hostile kind ended, and the well-behaved streams'
latency next to the quiet run's.

Without --url, one server per speculator (none first, then each --speculator) is started on a
free loopback port, measured and stopped, so the table compares them side by side; with --url,
the running server is measured as it is.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from ..datasets import humaneval_messages
from .args import split_speculator
from .command import cell, concurrency_axis, header, ms, percentile, preamble, ratio
from .hostile import KINDS, hostile_request

HOSTILE_WORKERS = 4

START_TIMEOUT_S = 600.0
SPEC_METRICS = ("spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_k0_steps_total")


class Chunk(msgspec.Struct):
    """The part of a streamed chat chunk the client measures."""

    choices: list[dict[str, Any]] = []
    usage: dict[str, int] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_flags(args: argparse.Namespace, speculator: str | None) -> list[str]:
    """`speckernel serve` flags for one run; speculator is NAME[:K[:KEY=VALUE,...]] as elsewhere."""
    flags = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs)]
    optional = (("--platform", args.platform), ("--dtype", args.dtype), ("--max-model-len", args.max_model_len or None))
    flags += [text for flag, value in optional if value is not None for text in (flag, str(value))]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if speculator is not None:
        run = split_speculator(speculator)
        flags += ["--speculator", run.name, "--num-speculative-tokens",
                  str(args.num_speculative_tokens if run.k is None else run.k)]
        for option in args.speculator_option if run.options is None else run.options:
            flags += ["--speculator-option", option]
        if args.draft_model:
            flags += ["--draft-model", args.draft_model]
        if args.adaptive_speculation is not None:
            flags.append("--adaptive-speculation" if args.adaptive_speculation else "--no-adaptive-speculation")
    return flags


@asynccontextmanager
async def started_server(flags: list[str]) -> AsyncIterator[str]:
    """A `speckernel serve` process on a free loopback port; yields its URL once /health is ok."""
    import httpx2  # optional: the `bench` extra

    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "speckernel", "serve", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx2.AsyncClient(base_url=url) as client:
                with anyio.fail_after(START_TIMEOUT_S):
                    while True:
                        if proc.poll() is not None:
                            log.seek(0)
                            raise RuntimeError(f"speckernel serve exited with {proc.returncode}:\n"
                                               + log.read().decode(errors="replace")[-4000:])
                        try:
                            if (await client.get("/health")).status_code == 200:
                                break
                        except httpx2.TransportError:
                            pass
                        await anyio.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                await anyio.to_thread.run_sync(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def scrape(client: Any) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    samples: dict[str, float] = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name.removeprefix("speckernel_")] = float(value)
    return samples


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_METRICS}
    steps, drafted, accepted = d["spec_drafts_total"], d["spec_draft_tokens_total"], d["spec_accepted_tokens_total"]
    return {"num_drafts": steps, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "num_k0_steps": d["spec_k0_steps_total"],
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": (accepted + steps) / steps if steps else None}


async def one_request(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: TTFT (to the first content), TPOT and the token count."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = last = None
    tokens = 0
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = msgspec.json.decode(line[6:], type=Chunk)
            if chunk.usage is not None:
                tokens = chunk.usage["completion_tokens"]
            for choice in chunk.choices:
                content = choice.get("delta", {}).get("content")
                if content:
                    last = time.monotonic()
                    first = first or last
                    text += content
    done = time.monotonic()
    return {"ttft": None if first is None else first - started,
            "tpot": (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None,
            "per_token": (last - started) / tokens if last is not None and tokens else None,
            "tokens": tokens, "latency": done - started, "text": text}


async def run_load(client: Any, model: str, prompts: list[list[dict[str, str]]], max_tokens: int,
                   concurrency: int, num_hostile: int = 0, url: str = "") -> dict[str, Any]:
    """C well-behaved streams in flight over the prompts; with num_hostile, HOSTILE_WORKERS more
    send that many hostile requests (the kinds in turn) meanwhile."""
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    pending = iter(range(len(prompts)))
    hostile = iter(range(num_hostile))
    outcomes: dict[str, dict[str, int]] = {}

    async def worker() -> None:
        for i in pending:  # shared by the workers: each prompt runs once
            results[i] = await one_request(client, model, prompts[i], max_tokens)

    async def attacker() -> None:
        for i in hostile:
            kind = KINDS[i % len(KINDS)]
            outcome = await hostile_request(client, url, model, prompts[i % len(prompts)], kind)
            counts = outcomes.setdefault(kind, {})
            counts[outcome] = counts.get(outcome, 0) + 1

    before = await scrape(client)
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(prompts))):
            tg.start_soon(worker)
        for _ in range(min(HOSTILE_WORKERS, num_hostile)):
            tg.start_soon(attacker)
    elapsed = time.monotonic() - started
    after = await scrape(client)
    done = [r for r in results if r is not None]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    per_token = [r["per_token"] for r in done if r["per_token"] is not None]
    generated = sum(r["tokens"] for r in done)
    return {
        "load": "hostile" if num_hostile else "quiet",
        "num_hostile": num_hostile,
        "hostile_outcomes": outcomes,
        "concurrency": concurrency,
        "num_requests": len(done),
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "tokens_per_s": generated / elapsed,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
        "per_token_p50_ms": ms(percentile(per_token, 50)),
        "per_token_p90_ms": ms(percentile(per_token, 90)),
        "latency_p50_ms": ms(percentile([r["latency"] for r in done], 50)),
        "spec": spec_delta(before, after),
        "texts": [r["text"] for r in done],
    }


async def measure(url: str, label: str, args: argparse.Namespace, prompts: list[list[dict[str, str]]],
                  sizes: dict[int, int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import httpx2  # optional: the `bench` extra

    limits = httpx2.Limits(max_connections=max(sizes) + 4, max_keepalive_connections=max(sizes) + 4)
    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=args.request_timeout) as client:
        info = (await client.get("/health")).json()
        model = info["model"]
        for c in sorted(sizes):  # warm-up: short requests at each concurrency, not measured
            async with anyio.create_task_group() as tg:
                for i in range(c):
                    tg.start_soon(one_request, client, model, prompts[i % len(prompts)], 4)
        runs = []
        for c, n in sizes.items():
            print(f"bench serve: {label} c={c}: {n} requests", file=sys.stderr)
            runs.append({"speculator": label} | await run_load(client, model, prompts[:n], args.max_tokens, c))
            if args.hostile:
                h = max(1, round(n * args.hostile / (1 - args.hostile)))
                print(f"bench serve: {label} c={c}: {n} requests and {h} hostile ones", file=sys.stderr)
                runs.append({"speculator": label} | await run_load(client, model, prompts[:n], args.max_tokens, c,
                                                                   h, url))
    return info, runs


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {c: max(c, args.num_prompts) for c in args.concurrency}
    conversations = humaneval_messages()
    prompts = [conversations[i % len(conversations)] for i in range(max(sizes.values()))]
    runs: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    if args.url:
        info, runs = await measure(args.url.rstrip("/"), args.label or "server", args, prompts, sizes)
    else:
        for name in [None, *(args.speculator or ["ngram"])]:
            async with started_server(server_flags(args, name)) as url:
                info, found = await measure(url, name or "none", args, prompts, sizes)
            runs += found
    for r in runs:
        base = next((b for b in runs if b["speculator"] == "none" and b["concurrency"] == r["concurrency"]
                     and b["load"] == r["load"]), None)
        r["ratio_to_none"] = ratio(r["tokens_per_s"], base["tokens_per_s"]) if base else None
        r["identical_to_none"] = (sum(a == b for a, b in zip(r["texts"], base["texts"], strict=False))
                                  if base else None)
        quiet = next((b for b in runs if b["speculator"] == r["speculator"] and b["concurrency"] == r["concurrency"]
                      and b["load"] == "quiet"), None)
        hostile = r["load"] == "hostile" and quiet is not None
        r["per_token_p50_ratio_to_quiet"] = ratio(r["per_token_p50_ms"], quiet["per_token_p50_ms"]) \
            if hostile and quiet else None
        r["per_token_p90_ratio_to_quiet"] = ratio(r["per_token_p90_ms"], quiet["per_token_p90_ms"]) \
            if hostile and quiet else None
        r["identical_to_quiet"] = (sum(a == b for a, b in zip(r["texts"], quiet["texts"], strict=False))
                                   if hostile and quiet else None)
    for r in runs:
        del r["texts"]
    return header("serve") | {
        "platform": info.get("platform"),
        "dtype": info.get("dtype"),
        "device": info.get("platform"),
        "model": info.get("model"),
        "url": args.url,
        "dataset": "HumanEval (chat, streamed)",
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "hostile": args.hostile,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Serve: HTTP load, {report['dataset']}, greedy, max_tokens {report['max_tokens']}, "
                             f"model {report['model']}")
    lines += [
        f"Each concurrency C keeps C streaming requests in flight over max(C, {report['num_prompts']}) prompts, "
        "through the server's OpenAI API on loopback (client and server share the host). TTFT: request sent to "
        "first content chunk; TPOT: per request, (last chunk - first chunk) / (tokens - 1). Ratio: tokens/s over "
        "no speculation at the same concurrency; identical: greedy texts equal to no speculation's.",
        "",
        "| speculator | concurrency | requests | requests/s | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
        "TPOT p99 ms | mean acceptance length | ratio to none | identical to none |",
        "|---" * 12 + "|",
    ]
    runs = report["runs"]
    hostile = [r for r in runs if r.get("load") == "hostile"]
    if hostile:  # the table's rows alternate quiet and hostile; say what the hostile rows add
        lines[-2:-2] = [
            f"Hostile rows: the same load with {report['hostile']:.0%} of all requests hostile, sent by "
            f"{HOSTILE_WORKERS} more clients meanwhile (kinds in turn: {', '.join(KINDS)}). The well-behaved "
            "streams' time per token from request to last token (p50, p90) is compared with the quiet row's, "
            "and their greedy texts with the quiet row's.", ""]
    for r in runs:
        same = "\N{EN DASH}" if r["identical_to_none"] is None else f"{r['identical_to_none']}/{r['num_requests']}"
        speculator = r["speculator"] + (f" + {r['num_hostile']} hostile" if r.get("load") == "hostile" else "")
        lines.append(
            f"| {speculator} | {r['concurrency']} | {r['num_requests']} | {r['requests_per_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {cell(r['ttft_p50_ms'], '.1f')} | {cell(r['ttft_p99_ms'], '.1f')} | "
            f"{cell(r['tpot_p50_ms'])} | {cell(r['tpot_p99_ms'])} | {cell(r['spec']['mean_acceptance_length'])} | "
            f"{cell(r['ratio_to_none'])} | {same} |")
    if hostile:
        lines += ["", "| speculator | concurrency | hostile | per-token p50 ms (quiet) | per-token p90 ms (quiet) | "
                      "p50 ratio | p90 ratio | identical to quiet | how the hostile requests ended |",
                  "|---" * 9 + "|"]
        for r in hostile:
            quiet = next(q for q in runs if q["speculator"] == r["speculator"] and q["concurrency"] == r["concurrency"]
                         and q.get("load") == "quiet")
            ended = "; ".join(f"{kind}: " + ", ".join(f"{n}\N{MULTIPLICATION SIGN} {o}" for o, n in sorted(c.items()))
                              for kind in KINDS if (c := r["hostile_outcomes"].get(kind)))
            lines.append(
                f"| {r['speculator']} | {r['concurrency']} | {r['num_hostile']} | "
                f"{cell(r['per_token_p50_ms'], '.1f')} ({cell(quiet['per_token_p50_ms'], '.1f')}) | "
                f"{cell(r['per_token_p90_ms'], '.1f')} ({cell(quiet['per_token_p90_ms'], '.1f')}) | "
                f"{cell(r['per_token_p50_ratio_to_quiet'])} | {cell(r['per_token_p90_ratio_to_quiet'])} | "
                f"{r['identical_to_quiet']}/{r['num_requests']} | {ended} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in report["runs"]:
        series.setdefault(r["speculator"] + (" + hostile" if r.get("load") == "hostile" else ""), []).append(r)
    panels = (("tokens_per_s", "tokens/s"), ("ttft_p50_ms", "time to first token p50 (ms)"),
              ("tpot_p50_ms", "time per output token p50 (ms)"))
    concurrencies = sorted({r["concurrency"] for r in report["runs"]})
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for label, rows in series.items():
            ax.plot([r["concurrency"] for r in rows], [r[key] or 0.0 for r in rows], marker="o", label=label)
        concurrency_axis(ax, concurrencies, "concurrent streaming requests", ylabel)
    axes[0].set_title(f"speckernel serve, {report['platform']} {report['dtype']}, max_tokens {report['max_tokens']}")
    return fig

