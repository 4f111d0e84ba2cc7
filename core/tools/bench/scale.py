"""scale: the time of one decode step at batch 1 against its floor, the time the device needs
to read every weight a step reads (and the request's KV) at the copy bandwidth measured in the
same run. The default target is a random-weight model of Llama-3-8B's shape (`random:llama3-8b`,
bf16, about 15 GB read per step), next to SmolLM2-135M timed the same way against its own floor.

The engine core is driven directly (no tokenizer, no frontend): --batch greedy requests of random
prompt tokens, then steady-state decode steps of that many rows, each timed between two device
synchronisations; the median over --steps after --warmup-steps. The bandwidth is that of a large
device-to-device copy (bytes read plus bytes written, over the median of several, timed with
device events). `--small-batch-kernels both` times each model and batch with the small-batch
kernels (`EngineConfig.small_batch_kernels`) and without, in one run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ... import registry
from ...config import EngineConfig
from ...engine.core import EngineCore
from ...model_config import ModelConfig
from ...models.presets import is_random
from ...sampling_params import SamplingParams
from ...wire.messages import AddRequest
from .command import cell, device_name, header, preamble, ratio

DEFAULT_MODELS = ["random:llama3-8b", "smollm2-135m"]


def step_bytes(cfg: ModelConfig, element_size: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of one token reads: every matrix and norm, the
    LM head in full, one row of the embedding table (all of it when the head is tied to it, as
    the head reads it), and the KV of `context` positions."""
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    bias = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd if cfg.attention_bias else 0
    per_layer = qkv + bias + cfg.num_heads * hd * h + 3 * h * cfg.intermediate_size + 2 * h
    per_layer += 2 * hd if cfg.qk_norm else 0
    weights = cfg.num_layers * per_layer + h + cfg.vocab_size * h + (0 if cfg.tie_word_embeddings else h)
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * hd * context
    return weights * element_size, kv * element_size


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of a device-to-device copy, counting what it reads and what it writes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times: list[float] = []
    if device.type == "cpu":
        for _ in range(repeats):
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
    else:
        module = torch.get_device_module(device.type)
        for _ in range(repeats):
            start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


SMALL_BATCH = {"on": (True,), "off": (False,), "both": (True, False)}
"""--small-batch-kernels: the settings each model and batch is timed with."""


def time_steps(name: str, args: argparse.Namespace, batch: int = 1, small_batch: bool = True) -> dict[str, Any]:
    """Loads `name` into a fresh engine core, then times its decode steps of `batch` rows."""
    block_size = EngineConfig().block_size
    blocks = -(-(args.prompt_len + args.warmup_steps + args.steps + 2) // block_size) + 1  # KV for these requests only
    config = EngineConfig(model=name, platform=args.platform, dtype=args.dtype,
                          max_num_seqs=max(args.max_num_seqs, batch),
                          max_model_len=args.max_model_len or blocks * block_size, num_kv_blocks=blocks * batch,
                          enforce_eager=args.enforce_eager, small_batch_kernels=small_batch, in_process=True)
    print(f"bench scale: loading {name} (batch {batch}, small-batch kernels {'on' if small_batch else 'off'})",
          file=sys.stderr)
    started = time.monotonic()
    core = EngineCore(config)
    load_s = time.monotonic() - started
    cfg = core.model_cfg
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.warmup_steps + args.steps + 2, temperature=0.0, ignore_eos=True)
    for key in range(batch):
        delta = core.add_request(AddRequest(key, rng.integers(0, cfg.vocab_size, args.prompt_len), params))
        assert delta is None, delta
    started_rows: set[int] = set()
    while len(started_rows) < batch:  # prefill (possibly several chunks) until every request has its first token
        started_rows.update(d.key for d in core.step() if d.new_token_ids)
    for _ in range(args.warmup_steps):
        core.step()
    times: list[float] = []
    for _ in range(args.steps):
        core.platform.synchronize()
        started = time.perf_counter()
        core.step()
        core.platform.synchronize()
        times.append(time.perf_counter() - started)
    weights, kv = step_bytes(cfg, torch.empty((), dtype=core.dtype).element_size(),
                             args.prompt_len + args.warmup_steps + args.steps // 2)
    stats = core.stats()
    result = {
        "model": name,
        "batch": batch,
        "small_batch_kernels": small_batch,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "load_s": load_s,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": kv * batch,
        "step_p50_ms": statistics.median(times) * 1e3,
        "step_p10_ms": float(np.percentile(times, 10)) * 1e3,
        "step_p90_ms": float(np.percentile(times, 90)) * 1e3,
        "num_steps_timed": len(times),
        "num_graph_steps": stats.get("num_graph_steps", 0),
        "platform": core.platform.name,
        "dtype": str(core.dtype).removeprefix("torch."),
    }
    del core
    gc.collect()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    platform = registry.pick_platform(args.platform)
    device = platform.device
    models = [args.model] if args.model else DEFAULT_MODELS[:1]
    models += args.compare if args.compare is not None else ([] if args.model else DEFAULT_MODELS[1:])
    if args.layers is not None:
        models = [f"{m},num_layers={args.layers}" if is_random(m) else m for m in models]
    results = [time_steps(m, args, batch, small) for m in models for batch in args.batch
               for small in SMALL_BATCH[args.small_batch_kernels]]
    if device.type != "cpu":
        torch.get_device_module(device.type).empty_cache()  # the models' memory, for the copy
    mib = args.copy_mib or (256 if device.type == "cpu" else 4096)
    bandwidth = copy_bandwidth(device, mib << 20, args.copy_repeats)
    for r in results:
        floor_ms = (r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / bandwidth * 1e3
        r["floor_ms"] = floor_ms
        r["step_over_floor"] = ratio(r["step_p50_ms"], floor_ms)
        r["tokens_per_s"] = r["batch"] * 1e3 / r["step_p50_ms"]
        off = next((o for o in results if not o["small_batch_kernels"] and o["model"] == r["model"]
                    and o["batch"] == r["batch"]), None)
        on = r["small_batch_kernels"] and off is not None
        r["speedup_over_off"] = ratio(off["step_p50_ms"], r["step_p50_ms"]) if on and off else None
    return header("scale") | {
        "platform": results[0]["platform"],
        "dtype": results[0]["dtype"],
        "device": device_name(device),
        "prompt_len": args.prompt_len,
        "copy_bytes": mib << 20,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "models": results,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Decode step against the weight-read floor, prompt {report['prompt_len']} tokens")
    lines += [
        f"Floor: (weights + KV read per step) / {report['copy_bandwidth_gb_s']:.0f} GB/s, the bandwidth of a "
        f"{report['copy_bytes'] >> 20} MiB device copy measured in this run (read + written bytes).",
        "",
        "Small-batch kernels: `EngineConfig.small_batch_kernels`; speedup: the step without them over the step "
        "with them, same model and batch.",
        "",
        "| model | layers | batch | small-batch kernels | weights read GB | KV read MB | step p50 ms | p10 ms "
        "| p90 ms | tokens/s | floor ms | step / floor | speedup | graph steps | load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["models"]:
        lines.append(
            f"| {r['model']} | {r['num_layers']} | {r['batch']} | {'on' if r['small_batch_kernels'] else 'off'} | "
            f"{r['weight_bytes_per_step'] / 1e9:.3f} | {r['kv_bytes_per_step'] / 1e6:.1f} | {r['step_p50_ms']:.3f} | "
            f"{r['step_p10_ms']:.3f} | {r['step_p90_ms']:.3f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.3f} | "
            f"{r['step_over_floor']:.2f} | {cell(r['speedup_over_off'])} | {r['num_graph_steps']} | "
            f"{r['load_s']:.1f} |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    models = report["models"]
    xs = range(len(models))
    ax.bar([x - 0.2 for x in xs], [r["step_p50_ms"] for r in models], 0.4, label="decode step (p50)")
    ax.bar([x + 0.2 for x in xs], [r["floor_ms"] for r in models], 0.4, label="weight-read floor")
    labels = [f"{r['model']}\nbatch {r['batch']}, small-batch {'on' if r['small_batch_kernels'] else 'off'}"
              for r in models]
    ax.set_xticks(list(xs), labels, fontsize="x-small", rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step vs floor, {report['platform']} {report['dtype']}")
    ax.legend()
    return fig
