"""startup: how long `speckernel generate` takes to its first token, by phase, each repetition in
a fresh interpreter (so imports, the engine-core process and the model load are paid as a user
pays them). Phases: python (interpreter start), import (speckernel and what it pulls in), load
(model resolved and checked, tokenizer, engine core started with its weights) and first token
(the request's prefill and first sample). The model must be cached: a first-use fetch or
conversion would be timed otherwise, so one untimed run goes first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import msgspec

from ... import registry
from ...config import EngineConfig
from .command import device_name, header, preamble

PHASES = ("python", "import", "load", "first_token")
PROMPT = "What are the three primary colors?"


def probe(spawned: float, started: float, config_json: str) -> None:
    """Runs in the fresh interpreter (`started`: before its first import of speckernel): times
    one start to the first token, prints one JSON line of wall-clock phase ends (time.time is
    shared with the parent)."""
    # Imported here, after `started`: importing them is the phase being timed.
    import anyio

    from ...frontend.async_engine import AsyncEngine
    from ...sampling_params import SamplingParams

    imported = time.time()
    config = msgspec.json.decode(config_json, type=EngineConfig)

    async def first_token() -> dict[str, Any]:
        async with AsyncEngine(config) as engine:
            ready = time.time()
            async for out in engine.chat([{"role": "user", "content": PROMPT}], SamplingParams(max_tokens=1)):
                if out.token_ids:
                    return {"ready": ready, "first_token": time.time(), "platform": engine.info.platform,
                            "dtype": engine.info.dtype}
        raise RuntimeError("no token")

    result = anyio.run(first_token)
    print(json.dumps({"spawned": spawned, "started": started, "imported": imported, **result}))


def one_run(config_json: str, timeout: float) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.time()
    code = ("import time; started = time.time(); from speckernel.tools.bench.startup import probe; "
            f"probe({spawned!r}, started, {config_json!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"startup probe failed (rc {proc.returncode}): {tail}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        # CPU seconds of the process and its engine core, start to exit: less swayed by other
        # work on a busy host than the wall-clock phases.
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "python_s": t["started"] - t["spawned"],
        "import_s": t["imported"] - t["started"],
        "load_s": t["ready"] - t["imported"],
        "first_token_s": t["first_token"] - t["ready"],
        "total_s": t["first_token"] - t["spawned"],
        "platform": t["platform"],
        "dtype": t["dtype"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = args.modes or ["process"]
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for mode in modes:
        config = EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype,
                              max_model_len=args.max_model_len, in_process=mode == "inprocess")
        config_json = msgspec.json.encode(config.validate()).decode()
        one_run(config_json, args.timeout)  # untimed: fetches, converts and warms the page cache
        runs = [one_run(config_json, args.timeout) for _ in range(args.repeats)]
        info = {"platform": runs[0]["platform"], "dtype": runs[0]["dtype"]}
        results[mode] = {
            "runs": runs,
            "median": {f"{p}_s": statistics.median(r[f"{p}_s"] for r in runs) for p in (*PHASES, "total")},
            "min_total_s": min(r["total_s"] for r in runs),
            "max_total_s": max(r["total_s"] for r in runs),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
        }
    return header("startup") | info | {
        "device": device_name(registry.pick_platform(info["platform"]).device),
        "model": args.model,
        "repeats": args.repeats,
        "prompt": PROMPT,
        "cpu_count": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "modes": results,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Start-up to the first token, {report['model']}, median of {report['repeats']} "
                             "fresh processes")
    lines += [
        "| engine core | python s | import s | load s | first token s | total s (median) | total s (min-max) "
        "| CPU s, whole run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        m = r["median"]
        lines.append(f"| {mode} | {m['python_s']:.2f} | {m['import_s']:.2f} | {m['load_s']:.2f} | "
                     f"{m['first_token_s']:.2f} | {m['total_s']:.2f} | "
                     f"{r['min_total_s']:.2f}-{r['max_total_s']:.2f} | {r['median_cpu_s']:.2f} |")
    load = report["load_average"]
    busy = load["before"] >= 0.5 * (report["cpu_count"] or 1)  # before: this run's own processes not yet in it
    lines += ["", f"Host load average (1 min) {load['before']:.1f} before, {load['after']:.1f} after, on "
                  f"{report['cpu_count']} CPUs: " + ("other work held half the CPUs or more before the run, so every "
                                                     "phase may be slower than on an idle host." if busy else
                                                     "under half the CPUs busy before the run."),
              "", "python: interpreter start; import: speckernel and its dependencies; load: model checked, "
                  "tokenizer, engine core started with its weights; first token: prefill and first sample; "
                  "CPU s: user + system seconds of the process and its engine core, start to exit."]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3))
    modes = list(report["modes"])
    left = [0.0] * len(modes)
    for phase in PHASES:
        values = [report["modes"][m]["median"][f"{phase}_s"] for m in modes]
        ax.barh(modes, values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("seconds to the first token (median)")
    ax.legend(fontsize="small")
    ax.set_title(f"Start-up, {report['model']}, {report['platform']} {report['dtype']}")
    return fig
