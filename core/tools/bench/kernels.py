"""kernels: each small-batch kernel (`speckernel.ops.small_batch`) against the launches of the fused
path it replaces, per model shape and row count, next to the time its bytes take at the nominal
bandwidth; with --sweep, every candidate tile of each kernel and shape, and the best ones as rows
for `small_batch.TILES`.

The fused path's launches for the same work (random weights of the model's shapes):

- qkv: add+RMSNorm, the QKV GEMM, rope, the KV-cache write; new: `norm_qkv_rope` (it writes the cache).
- o: the o GEMM (its residual add rides in the next add+RMSNorm); new: `linear_residual`.
- gate_up: add+RMSNorm, the gate_up GEMM, silu*up; new: `norm_gate_up`.
- down: the down GEMM; new: `linear_residual`.
- head: the LM head GEMM and its float32 copy; new: `linear` writing float32.

A layer without attention is the first four. On a GPU each variant runs as one device graph of
back-to-back calls over enough copies of its weight to pass the L2 cache (a step's weights never
sit in it), replayed --repeats times: time per call = the median replay over its calls. On the
CPU (Triton's interpreter) the calls are timed one by one: only the flow is checked there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...model_config import ModelConfig
from ...models.checkpoint import read_config, resolve
from ...ops import fused_ops, small_batch
from ...ops.small_batch import Tile
from ...ops.triton_attention import write_kv
from .command import MISSING, cell, device_name, header, preamble, ratio

KERNELS = {"qkv": "rope", "o": "residual", "gate_up": "silu", "down": "residual", "head": "plain"}
"""Kernel name -> its kind in small_batch.TILES."""
LAYER = ("qkv", "o", "gate_up", "down")
SHARED_BYTES = 200 << 10
"""Shared memory a sweep's tile may plan for (an H100 or H200 block has 227 KB)."""
PASS_L2_BYTES = 256 << 20
"""Weight copies per timed graph add up to at least this (the H200's L2 is 50 MB)."""


def weight_shape(cfg: ModelConfig, kernel: str) -> tuple[int, int]:
    """(N, K) of the kernel's weight."""
    h, hd = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), "o": (h, cfg.num_heads * hd),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size),
            "head": (cfg.vocab_size, h)}[kernel]


def candidates(cfg: ModelConfig, kernel: str, k: int) -> list[Tile]:
    """The tiles a sweep tries: column blocks of 16 to 64 rows (128 for the head; rope's at most half
    a head, as the kernel clips them) by the three longest K steps that divide K (no masked tail;
    128 and 256 where fewer do), four warps, and a few with more warps or stages; none past the
    shared memory of a block."""
    steps = [s for s in (64, 128, 256, 512) if k % s == 0][-3:]
    steps = sorted(set(steps if len(steps) >= 2 else [*steps, 128, 256]))
    widths = [16, 32, 64, 128] if kernel == "head" else [16, 32, 64]
    if kernel == "qkv":
        widths = [w for w in widths if w <= max(16, 1 << (cfg.head_dim // 2 - 1).bit_length())]
    tiles = [Tile(n, s, 4, 3) for n in widths for s in steps]
    tiles += [Tile(widths[-1], steps[-1], 8, 3), Tile(16, steps[0], 4, 5), Tile(widths[-1], steps[-1], 8, 2)]
    rows = 2 if kernel in ("qkv", "gate_up") else 1  # a paired epilogue's tile holds both halves
    # Shared memory: each stage holds the weight tile and the x tile (16 rows), 2 bytes an element.
    fits = [t for t in tiles if t.num_stages * (rows * t.block_n + 16) * t.block_k * 2 <= SHARED_BYTES]
    return list(dict.fromkeys(fits))


def weight_copies(n: int, k: int, copies: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(n, k, generator=gen, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]


class Case:
    """One kernel of one shape at M rows: its weights (copies), inputs, and the old and new calls."""

    def __init__(self, cfg: ModelConfig, kernel: str, m: int, weights: list[torch.Tensor]) -> None:
        self.cfg, self.kernel, self.m, self.weights = cfg, kernel, m, weights
        n, k = weights[0].shape
        dtype, device = weights[0].dtype, weights[0].device
        gen = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
        self.residual = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
        self.stream = torch.randn(m, n, generator=gen, device=device, dtype=dtype)
        self.norm = torch.ones(k, device=device, dtype=dtype)
        hd, nkv = cfg.head_dim, cfg.num_kv_heads
        self.positions = torch.arange(m, device=device) + 100
        self.cos = torch.randn(256, hd, generator=gen, device=device)
        self.sin = torch.randn(256, hd, generator=gen, device=device)
        self.cos_t, self.sin_t = self.cos[self.positions], self.sin[self.positions]
        self.kv = torch.zeros(2, 1024, nkv, hd, device=device, dtype=dtype)
        self.slots = torch.arange(m, device=device) + 200

    def bytes_read(self) -> int:
        """The weight, the inputs and what is written (the floor's bytes)."""
        w = self.weights[0]
        n, k = w.shape
        out = n * (4 if self.kernel == "head" else w.element_size())
        return (n * k + self.m * (k + 2 * n)) * w.element_size() + self.m * out

    def old(self, i: int) -> Any:
        w, cfg = self.weights[i], self.cfg
        if self.kernel == "qkv":
            h, _ = fused_ops.rms_norm(self.x, self.norm, 1e-5, self.residual)
            nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            q, k, v = F.linear(h, w).split([nh * hd, nkv * hd, nkv * hd], -1)
            q, k = fused_ops.rope(q.view(self.m, nh, hd), k.view(self.m, nkv, hd), self.cos_t, self.sin_t)
            write_kv(k, v.view(self.m, nkv, hd), self.kv, self.slots)
            return q
        if self.kernel == "gate_up":
            h, _ = fused_ops.rms_norm(self.x, self.norm, 1e-5, self.residual)
            return fused_ops.silu_mul(F.linear(h, w))
        if self.kernel == "head":
            return F.linear(self.x, w).float()
        return F.linear(self.x, w)

    def new(self, i: int, tile: Tile | None = None) -> Any:
        w, cfg = self.weights[i], self.cfg
        if self.kernel == "qkv":
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            return small_batch.norm_qkv_rope(self.x, self.norm, 1e-5, w, None, self.positions, self.cos, self.sin,
                                             heads, cache=(self.kv, self.slots), tile=tile)
        if self.kernel == "gate_up":
            return small_batch.norm_gate_up(self.x, self.norm, 1e-5, w, tile=tile)
        if self.kernel == "head":
            return small_batch.linear(self.x, w, torch.float32, tile=tile)
        return small_batch.linear_residual(self.x, w, self.stream, tile=tile)


def time_call(call: Callable[[int], Any], copies: int, device: torch.device, repeats: int) -> float:
    """Seconds per call: on a GPU the median replay of a graph of calls over every weight copy
    (at least 20 calls), divided by its calls; on the CPU the median of single calls."""
    if device.type != "cuda":
        call(0)
        times = []
        for i in range(max(2, repeats // 4)):
            started = time.perf_counter()
            call(i % copies)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    calls = max(copies, 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # builds the kernels and settles the allocator outside the capture
        for i in range(copies):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    if not small_batch.runs_on(torch.zeros(1, 1, dtype=dtype, device=device)):
        raise SystemExit("bench kernels: the small-batch kernels need Triton on this device "
                         "(a GPU, or TRITON_INTERPRET=1 on the CPU)")
    bandwidth = args.bandwidth_gbs * 1e9
    results: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    shapes = []
    for name in args.models:
        cfg = read_config(resolve(name))
        shapes.append({"model": name, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                       "heads": [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim], "vocab_size": cfg.vocab_size})
        for kernel in args.kernels:
            n, k = weight_shape(cfg, kernel)
            nbytes = n * k * dtype.itemsize
            copies = max(2, -(-PASS_L2_BYTES // nbytes)) if device.type == "cuda" else 1
            tiles = candidates(cfg, kernel, k) if args.sweep else []
            table_tile = small_batch.tile_for(KERNELS[kernel], k, n)
            weights = weight_copies(n, k, copies, dtype, device)
            for m in args.rows:
                print(f"bench kernels: {name} {kernel} M={m}", file=sys.stderr)
                case = Case(cfg, kernel, m, weights)
                old_s = time_call(case.old, copies, device, args.repeats)
                new_s = time_call(case.new, copies, device, args.repeats)
                floor_s = case.bytes_read() / bandwidth
                results.append({"model": name, "kernel": kernel, "m": m, "n": n, "k": k, "old_us": old_s * 1e6,
                                "new_us": new_s * 1e6, "floor_us": floor_s * 1e6, "tile": list(table_tile),
                                "speedup": ratio(old_s, new_s), "new_over_floor": ratio(new_s, floor_s)})
                for tile in tiles:
                    entry = {"model": name, "kernel": kernel, "m": m, "n": n, "k": k, "tile": list(tile)}
                    try:
                        t = time_call(lambda i, _c=case, _t=tile: _c.new(i, _t), copies, device,  # type: ignore[misc]
                                      args.repeats)
                    except Exception as e:  # a tile past the device's shared memory, say: noted, not fatal
                        error = f"{type(e).__name__}: {e}"[:200]
                        sweep.append(entry | {"us": None, "over_floor": None, "error": error})
                        continue
                    sweep.append(entry | {"us": t * 1e6, "over_floor": ratio(t, floor_s)})
                del case
            del weights
    layers = layer_rows(results)
    return header("kernels") | {
        "device": device_name(device), "platform": device.type, "dtype": args.dtype,
        "bandwidth_gb_s": args.bandwidth_gbs, "shapes": shapes, "rows": args.rows, "results": results,
        "layers": layers, "sweep": sweep, "best": best_tiles(sweep)}


def layer_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and M, the four projections of a layer summed (attention aside)."""
    rows = []
    for model, m in dict.fromkeys((r["model"], r["m"]) for r in results):
        parts = [r for r in results if r["model"] == model and r["m"] == m and r["kernel"] in LAYER]
        if len(parts) == len(LAYER):
            old, new, floor = (sum(r[key] for r in parts) for key in ("old_us", "new_us", "floor_us"))
            rows.append({"model": model, "m": m, "old_us": old, "new_us": new, "floor_us": floor,
                         "speedup": ratio(old, new), "new_over_floor": ratio(new, floor)})
    return rows


def best_tiles(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kernel and shape (K, N), the tile with the least time summed over the rows measured (of
    the tiles that ran at every row count)."""
    best = []
    for kernel, k, n in dict.fromkeys((s["kernel"], s["k"], s["n"]) for s in sweep):
        runs = [s for s in sweep if (s["kernel"], s["k"], s["n"]) == (kernel, k, n)]
        failed = {tuple(s["tile"]) for s in runs if s["us"] is None}
        totals: dict[tuple[int, ...], float] = {}
        for s in runs:
            if tuple(s["tile"]) not in failed:
                totals[tuple(s["tile"])] = totals.get(tuple(s["tile"]), 0.0) + s["us"]
        if not totals:
            continue
        tile = min(totals, key=totals.__getitem__)
        best.append({"kernel": kernel, "kind": KERNELS[kernel], "k": k, "n": n, "tile": list(tile),
                     "us_by_m": {str(s["m"]): s["us"] for s in runs if tuple(s["tile"]) == tile}})
    return best


def table_rows(best: list[dict[str, Any]]) -> list[str]:
    """`small_batch.TILES` rows from the sweep's best tiles: per kind, by K (the largest K of a kind
    covers everything above it)."""
    lines = []
    for kind in dict.fromkeys(small_batch.KINDS):
        rows = sorted((b for b in best if b["kind"] == kind), key=lambda b: b["k"])
        for i, b in enumerate(rows):
            k_max = "ANY" if i == len(rows) - 1 else str(b["k"])
            lines.append(f'    ("{kind}", {k_max}, ANY, Tile({", ".join(map(str, b["tile"]))})),  # {b["kernel"]} '
                         f'K={b["k"]} N={b["n"]}')
    return lines


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, "Small-batch kernels against the fused path's launches")
    lines += [
        f"Floor: bytes read and written at {report['bandwidth_gb_s']:.0f} GB/s. Old: the fused path's launches "
        "for the same work (see `speckernel.tools.bench.kernels`); new: the small-batch kernel with its table tile.",
        "",
        "| model | kernel | M | N | K | old us | new us | floor us | old / new | new / floor | tile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['kernel']} | {r['m']} | {r['n']} | {r['k']} | {r['old_us']:.1f} | "
                     f"{r['new_us']:.1f} | {r['floor_us']:.1f} | {cell(r['speedup'])} | "
                     f"{cell(r['new_over_floor'])} | {tuple(r['tile'])} |")
    lines += ["", "A layer's four projections (attention aside):", "",
              "| model | M | old us | new us | floor us | old / new | new / floor |", "|---|---|---|---|---|---|---|"]
    for r in report["layers"]:
        lines.append(f"| {r['model']} | {r['m']} | {r['old_us']:.1f} | {r['new_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{cell(r['speedup'])} | {cell(r['new_over_floor'])} |")
    if report["best"]:
        rows = report["rows"]
        lines += ["", "Sweep: the best tile per kernel and shape (least time summed over M), "
                  "(BLOCK_N, BLOCK_K, num_warps, num_stages):", "",
                  "| kernel | K | N | best tile | " + " | ".join(f"us M={m}" for m in rows) + " |",
                  "|---|---|---|---|" + "---|" * len(rows)]
        for b in report["best"]:
            times = " | ".join(cell(b["us_by_m"].get(str(m)), ".1f") for m in rows)
            lines.append(f"| {b['kernel']} | {b['k']} | {b['n']} | {tuple(b['tile'])} | {times} |")
        lines += ["", "As `small_batch.TILES` rows:", "", "```python", *table_rows(report["best"]), "```"]
    elif report["sweep"] == []:
        lines += ["", f"Sweep: {MISSING} (run with --sweep)."]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    models = list(dict.fromkeys(r["model"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in report["results"] if r["model"] == model]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["old_us"] for r in rows], 0.4, label="fused path")
        ax.bar([x + 0.2 for x in xs], [r["new_us"] for r in rows], 0.4, label="small-batch kernel")
        ax.scatter(list(xs), [r["floor_us"] for r in rows], color="black", marker="_", s=200, label="bytes floor",
                   zorder=3)
        ax.set_xticks(list(xs), [f"{r['kernel']}\nM={r['m']}" for r in rows], fontsize="x-small")
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(f"{model}, {report['dtype']}", fontsize="small")
        ax.legend(fontsize="x-small")
    return fig
