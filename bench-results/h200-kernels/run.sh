#!/usr/bin/env bash
# The small-batch kernels (speckernel.ops.small_batch) on one GPU, random weights, no model file:
#   tests.log   their tests, natively on CUDA (no interpreter); with $MODEL (the default GGUF) also
#               the real model's greedy tokens with and without them
#   kernels/    `bench kernels --sweep`: each kernel against the fused path's launches at M = 1, 4, 16
#               for SmolLM2-135M's and Llama-3-8B's shapes in bf16, next to the bytes floor at
#               4.3 TB/s, and every candidate tile; kernels.md ends with the best tiles as
#               small_batch.TILES rows
#   scale/      `bench scale`: whole decode steps (engine, device graphs) of a random-weight
#               SmolLM2-135M at batch 1 and 4, with and without the kernels
#   summary.md  the short table printed last
# Usage, from anywhere: bench-results/h200-kernels/run.sh OUT_DIR. Needs speckernel importable
# by python3 (its wheels' dependencies installed). Each part has a time limit (tests 180 s,
# kernels 300 s, scale 180 s; $PART_TIMEOUT sets all three); about 4 minutes in all is expected.
# Overrides (a smoke run elsewhere, or more): $KERNEL_MODELS (comma-separated), $KERNEL_ROWS,
# $SCALE_MODELS (space-separated; e.g. add random:llama3-8b, about a minute more), $PLATFORM.
set -uo pipefail
out=$(mkdir -p "${1:?usage: run.sh OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/../.."
source bench-results/gpu-cache.sh
timings=()
started=$SECONDS
part() {  # part NAME LIMIT COMMAND...: one part, its output in $out/NAME.log, its time noted
  local name=$1 limit=${PART_TIMEOUT:-$2} t0=$SECONDS
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   exit $? after $(( SECONDS - t0 )) s"
  timings+=("$name $(( SECONDS - t0 ))")
}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

marks="not slow"
[ -n "${MODEL:-}" ] && marks=""
part tests 180 python3 -m pytest -q -p no:cacheprovider tests/ops/test_small_batch.py -m "$marks"
tail -3 "$out/tests.log"

part kernels 300 python3 -m speckernel.tools.cli bench kernels --sweep --rows "${KERNEL_ROWS:-1,4,16}" \
  --dtype bfloat16 --models "${KERNEL_MODELS:-random:smollm2-135m,random:llama3-8b}" --out "$out/kernels"

read -r -a scale_models <<< "${SCALE_MODELS:-random:smollm2-135m}"
compare=()
for m in "${scale_models[@]:1}"; do compare+=(--compare "$m"); done
part scale 180 python3 -m speckernel.tools.cli bench scale --platform "${PLATFORM:-cuda}" --dtype bfloat16 \
  --model "${scale_models[0]}" ${compare[@]+"${compare[@]}"} --batch 1,4 --small-batch-kernels both \
  --out "$out/scale"

python3 - "$out" "${timings[@]}" <<'PY' > "$out/summary.md"
"""The figures each part is for, from the JSON files just written."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    path = out / name / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


tests = [line for line in (out / "tests.log").read_text().splitlines() if " passed" in line or " failed" in line
         or " error" in line] if (out / "tests.log").exists() else []
print(f"Tests (tests/ops/test_small_batch.py): {tests[-1] if tests else 'no output'}\n")
if (k := load("kernels")):
    print(f"Kernels, {k['dtype']}, {k['device']}: us per call, old (fused path) / new / floor "
          f"(bytes at {k['bandwidth_gb_s']:.0f} GB/s)\n")
    rows = k["rows"]
    print("| model | kernel | " + " | ".join(f"M={m} old / new / floor" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    by = {(r["model"], r["kernel"], r["m"]): r for r in k["results"]}
    for model, kernel in dict.fromkeys((r["model"], r["kernel"]) for r in k["results"]):
        cells = [by.get((model, kernel, m)) for m in rows]
        print(f"| {model} | {kernel} | " + " | ".join(
            f"{c['old_us']:.1f} / {c['new_us']:.1f} / {c['floor_us']:.1f}" if c else "–" for c in cells) + " |")
    print("\nA layer's four projections (attention aside):\n")
    print("| model | M | old us | new us | floor us | old / new | new / floor |\n|---|---|---|---|---|---|---|")
    for r in k["layers"]:
        print(f"| {r['model']} | {r['m']} | {r['old_us']:.1f} | {r['new_us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['speedup']:.2f} | {r['new_over_floor']:.2f} |")
    if k["best"]:
        print("\nBest tiles (BLOCK_N, BLOCK_K, warps, stages), from the sweep: "
              + "; ".join(f"{b['kernel']} K={b['k']}: {tuple(b['tile'])}" for b in k["best"]))
if (s := load("scale")):
    print(f"\nDecode step (engine, graphs), {s['dtype']}, copy bandwidth {s['copy_bandwidth_gb_s']:.0f} GB/s\n")
    print("| model | batch | small-batch kernels | step p50 ms | tokens/s | step / floor | speedup |")
    print("|---|---|---|---|---|---|---|")
    for m in s["models"]:
        speedup = "–" if m["speedup_over_off"] is None else f"{m['speedup_over_off']:.2f}x"
        print(f"| {m['model']} | {m['batch']} | {'on' if m['small_batch_kernels'] else 'off'} | "
              f"{m['step_p50_ms']:.3f} | {m['tokens_per_s']:.0f} | {m['step_over_floor']:.2f} | {speedup} |")
print("\nSeconds per part: " + ", ".join(sys.argv[2:]))
PY
echo "== summary ($(( SECONDS - started )) s in all)"
cat "$out/summary.md"
