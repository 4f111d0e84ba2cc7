#!/usr/bin/env bash
# One GPU run: check the CUDA path, run the GPU-side tests, measure acceptance on HumanEval.
# Optional: $MODEL (the default GGUF) and $HUMANEVAL (HumanEval.jsonl.gz) for machines without
# PyPI; $DTYPES (default "float32 bfloat16"). Writes at most 8 files under $1 (default ./gpu-out).
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
export SPECKERNEL_CACHE=${SPECKERNEL_CACHE:-$HOME/skcache} PYTHONUNBUFFERED=1
mkdir -p "$SPECKERNEL_CACHE/models"
[ -n "${MODEL:-}" ] && cp "$MODEL" "$SPECKERNEL_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -n "${HUMANEVAL:-}" ] && cp "$HUMANEVAL" "$SPECKERNEL_CACHE/models/HumanEval.jsonl.gz"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  for spec in none ngram draft_model; do
    extra=(); [ "$spec" != none ] && extra=(--speculator "$spec" --num-speculative-tokens 4)
    echo "== generate, cuda, speculator=$spec"
    python3 -m speckernel.cli generate --raw --prompt "The three primary colors are" --max-tokens 48 \
      --temperature 0 --json --platform cuda "${extra[@]}"
  done
  echo "== GPU-side tests (Triton kernels for real, attention seam, graphs, host gate)"
  python3 -m pytest -q tests/test_verify.py tests/test_sampler.py tests/test_platform_contract.py \
    -p no:cacheprovider 2>&1 | tail -5
} > "$out/cuda_checks.txt" 2>&1
for dtype in ${DTYPES:-float32 bfloat16}; do
  python3 -m speckernel.cli bench accept --platform cuda --dtype "$dtype" --max-tokens 256 \
    --out "$out/accept_$dtype" 2>&1 | tail -8
done
