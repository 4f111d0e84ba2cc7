#!/usr/bin/env bash
# One GPU run: check the CUDA path, run the GPU-side tests, then the benchmark scenarios (scale,
# decode with the HF transformers peers (its own limit: $DECODE_TIMEOUT, default 360 s), hostsync,
# prefill, accept in each of $DTYPES), and last
# a short summary table of all of them (summary.md).
# Optional: $MODEL (the default GGUF) and $HUMANEVAL (HumanEval.jsonl.gz) for machines without
# PyPI; $CHECK_TESTS (the GPU-side tests to run) and $DECODE_ARGS (decode's prompts, concurrency
# and speculators); $DTYPES (default "float32 bfloat16"; empty: no accept runs); $PART_TIMEOUT (seconds per
# scenario, default 240); $WORK (where the parts go, default $1/parts); PACK=1 also packs the parts
# into $1/results.tar.gz after each one (for runners that fetch few files: point WORK elsewhere);
# $PARTS (default: all) names the parts to run, e.g. "checks decode scale".
# Writes under $1 (default ./gpu-out): the parts (cuda_checks.txt, one folder and one log per scenario)
# and summary.md.
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
source "$(dirname "$0")/gpu-cache.sh"
dtypes=${DTYPES-float32 bfloat16}
# Each part runs under its own time limit and is packed as soon as it ends, so a run cut short
# still returns every part that finished (results.tar.gz, with at most 8 files under $out).
limit=${PART_TIMEOUT:-240}
work=${WORK:-$out/parts}
mkdir -p "$work"
timings=()
pack() {
  if [ -n "${PACK:-}" ]; then tar -czf "$out/results.tar.gz" -C "$work" . ; fi
}
bench() {  # bench NAME ARGS...: one scenario into $work/NAME, its table's tail on the console
  local name=$1 started=$SECONDS
  shift
  case " ${PARTS:-$name} " in *" $name "*) ;; *) return ;; esac
  echo "== bench $name $*"
  timeout "$limit" python3 -m speckernel.tools.cli bench "$@" --out "$work/$name" > "$work/$name.log" 2>&1
  tail -n 12 "$work/$name.log"
  timings+=("$name $(( SECONDS - started ))")
  pack
}
started=$SECONDS
case " ${PARTS:-checks} " in *" checks "*) {
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "== generate, cuda, no speculation"
  timeout 120 python3 -m speckernel.tools.cli generate --raw --prompt "The three primary colors are" --max-tokens 48 \
    --temperature 0 --json --platform cuda
  echo "== GPU-side tests (Triton kernels for real, graphs vs eager, no host sync, sampling, verification)"
  timeout "${CHECKS_TIMEOUT:-420}" python3 -m pytest -q ${CHECK_TESTS:-tests/runner/test_gpu_fast_path.py \
    tests/runner/test_step_graphs.py tests/runner/test_draft_copies.py tests/runner/test_step_plan.py \
    tests/engine/test_pipeline_gpu.py tests/transports/test_processes.py tests/transports/test_conformance.py \
    tests/engine/test_data_parallel.py tests/platforms/test_platform_contract.py tests/ops/test_triton_kernels.py \
    tests/runner/test_sampler.py tests/runner/test_verify.py} -p no:cacheprovider 2>&1 | tail -40
} > "$work/cuda_checks.txt" 2>&1
timings+=("cuda_checks $(( SECONDS - started ))")
tail -5 "$work/cuda_checks.txt"
pack ;;
esac
# shellcheck disable=SC2086  # $DECODE_ARGS is a list of flags
limit=${DECODE_TIMEOUT:-360} bench decode decode --platform cuda --dtype bfloat16 --max-tokens 256 \
  ${DECODE_ARGS:---num-prompts 10 --concurrency 1,4,16,64 --speculator ngram}
bench scale scale --platform cuda
bench decode_adaptive decode --platform cuda --dtype bfloat16 --max-tokens 256 --num-prompts 10 \
  --concurrency 16,64 --speculator ngram --no-hf --adaptive-speculation
bench hostsync hostsync --platform cuda --speculator ngram --max-tokens 256 --num-prompts 10 --concurrency 1,16
bench prefill prefill --platform cuda --speculator ngram --prompt-tokens 1200 --num-prompts 64 --concurrency 1,16
bench remote remote --platform cuda --dtype bfloat16 --method eagle3 --num-speculative-tokens 3 --max-tokens 128 \
  --num-prompts 4
bench pp pp --platform cuda --dtype bfloat16 --max-tokens 128 --num-prompts 64 --speculator mtp --pipeline-sizes 1,2 \
  --dp-ranks process
bench grammar grammar --platform cuda --dtype bfloat16 --late-masks on,off
for dtype in $dtypes; do
  bench "accept_$dtype" accept --platform cuda --dtype "$dtype" --max-tokens 256
done
python3 - "$work" "${timings[@]}" <<'EOF' > "$out/summary.md"
"""The few figures each scenario is for, from the JSON files just written."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    path = out / name / f"{name.split('_')[0]}.json"
    return json.loads(path.read_text()) if path.exists() else None


def f(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


rows = []
if (r := load("scale")):
    for m in r["models"]:
        rows.append(("scale", m["model"], f"step {m['step_p50_ms']:.2f} ms, floor {m['floor_ms']:.2f} ms "
                     f"({m['step_over_floor']:.1f}x) at {r['copy_bandwidth_gb_s']:.0f} GB/s"))
for r in (load("decode"), load("decode_adaptive")):
    if not r:
        continue
    for run in r["runs"]:
        vs = ", ".join(f"{f(v)}x {p}" for p, v in run["ratio_to_peers"].items())
        rows.append(("decode", f"{run['speculator']} c={run['concurrency']}",
                     f"{run['tokens_per_s']:.0f} tok/s, TPOT p50 {f(run['tpot_p50_ms'])} ms, "
                     f"{f(run['ratio_to_none'])}x none" + (f"; {vs}" if vs else "")))
    for name, p in r["peers"].items():
        rows.append(("decode", name, f"{p['tokens_per_s']:.0f} tok/s, setup {p['setup_s']:.0f} s, "
                     f"identical {p['identical_to_engine']}/{p['num_requests']}"))
if (r := load("hostsync")):
    for run in r["runs"]:
        rows.append(("hostsync", f"force_host_drafts={run['force_host_drafts']} c={run['concurrency']}",
                     f"{run['steps_per_s']:.0f} steps/s, {run['spec']['num_host_draft_copies']} copies, "
                     f"{f(run['ratio_to_host_copies'])}x"))
if (r := load("prefill")):
    for run in r["runs"]:
        rows.append(("prefill", f"{run['speculator']} skip={run['skip_drafts']} c={run['concurrency']}",
                     f"{run['prefill_tokens_per_s']:.0f} tok/s, K=0 steps {run['spec']['num_k0_steps']}, "
                     f"{f(run['ratio_to_no_skip'])}x no skip"))
if (r := load("pp")):
    for run in r["runs"]:
        rows.append(("pp", f"{run['speculator']} PP={run['pipeline_parallel_size']} DP={run['data_parallel_size']} "
                     f"c={run['concurrency']}", f"{run['tokens_per_s']:.0f} tok/s, {f(run['ratio_to_pp1'])}x PP=1, "
                     f"step {f(run['step_period_ms'])} ms, bubbles {f(run.get('bubble_mean'), '.0%')}"))
if (r := load("grammar")):
    for run in r["runs"]:
        rows.append(("grammar", f"{run['speculator']} {run['mode']} c={run['concurrency']}",
                     f"{run['tokens_per_s']:.0f} tok/s, {f(run['ratio_to_free'])}x free, graph steps "
                     f"{run['num_graph_steps']}/{run['num_steps']}, device gap {f(run.get('device_gap_ms'))} ms"))
for d in sorted(out.glob("accept_*")):
    r = json.loads((d / "accept.json").read_text())
    for name, run in r["runs"].items():
        rows.append((d.name, name, f"mean acceptance length {run['spec']['mean_acceptance_length']:.2f}, "
                     f"{run['tokens_per_s']:.0f} tok/s, identical {f(run['identical_to_no_speculation'], 'd')}"))
print("| scenario | run | figures |\n|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
print("\nSeconds per part: " + ", ".join(sys.argv[2:]))
EOF
echo "== summary ($(( SECONDS - started )) s in all)"
cat "$out/summary.md"
pack
