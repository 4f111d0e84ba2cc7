#!/usr/bin/env bash
# One GPU lease: install, check the CUDA path, run the Triton kernels for real, measure.
# Expects the default model at $MODEL (a GGUF) and writes everything under $1 (default ./gpu-out).
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
export SPECKERNEL_CACHE=${SPECKERNEL_CACHE:-$HOME/skcache} PYTHONUNBUFFERED=1
mkdir -p "$SPECKERNEL_CACHE/models"
[ -n "${MODEL:-}" ] && cp "$MODEL" "$SPECKERNEL_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f .whl/HumanEval.jsonl.gz ] && cp .whl/HumanEval.jsonl.gz "$SPECKERNEL_CACHE/models/"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
prompt="The three primary colors are"
for spec in none ngram draft_model; do
  extra=(); [ "$spec" != none ] && extra=(--speculator "$spec" --num-speculative-tokens 4)
  python3 -m speckernel.cli generate --raw --prompt "$prompt" --max-tokens 48 --temperature 0 --json \
    --platform cuda "${extra[@]}" > "$out/generate_cuda_$spec.json" 2> "$out/generate_cuda_$spec.err"
  echo "generate cuda $spec rc=$?"
done
python3 -m pytest -q tests/test_verify.py tests/test_sampler.py -p no:cacheprovider 2>&1 | tail -3 | tee "$out/triton_tests.txt"
python3 -m speckernel.cli bench accept --platform cuda --max-tokens 256 --out "$out/accept" 2>&1 | tail -20
