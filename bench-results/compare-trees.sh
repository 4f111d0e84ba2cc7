#!/usr/bin/env bash
# Two trees of the project on one machine, measured in alternating order, then compared row by row.
# Usage: compare-trees.sh OUT BASELINE_SRC CANDIDATE_SRC
#   *_SRC: a source folder of the project each (a checkout, `git worktree add ../base 3b30005`, or an
#   unpacked `git archive`), with its drafter weights. Each is installed on its own under
#   OUT/site-baseline and OUT/site-candidate (pip --target, no dependencies: the environment has them,
#   setuptools included), and every run imports only its own tree.
# Optional: $DECODE_ARGS (bench decode's flags; default: the runner issue's grid, none / mtp:3 / dflash:7 at
# 1 / 16 / 64 in flight, bf16 on CUDA, no peers), $ROUNDS (default 2; round i runs baseline then candidate
# when i is odd, the other way round when even, so the host's drift falls on both), $TREE_TIMEOUT (seconds
# one tree's bench may take, default 300), $TOLERANCE (default 0.05).
# Writes OUT/rN-baseline, OUT/rN-candidate (bench decode's folders and logs) and OUT/compare (the verdicts).
set -uo pipefail
out=${1:?usage: compare-trees.sh OUT BASELINE_SRC CANDIDATE_SRC}
src_baseline=${2:?baseline source folder}
src_candidate=${3:?candidate source folder}
args=${DECODE_ARGS:---platform cuda --dtype bfloat16 --max-tokens 256 --num-prompts 10 --concurrency 1,16,64 \
--speculator mtp:3 --speculator dflash:7 --no-hf --no-vllm}
rounds=${ROUNDS:-2}
mkdir -p "$out"
for side in baseline candidate; do
  src_var="src_$side"
  rm -rf "$out/site-$side"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$out/site-$side" \
    "${!src_var}" > "$out/install-$side.log" 2>&1 || { tail -20 "$out/install-$side.log"; exit 1; }
done
export PYTHONUNBUFFERED=1
base_dirs=() cand_dirs=()
for ((i = 1; i <= rounds; i++)); do
  if ((i % 2)); then order="baseline candidate"; else order="candidate baseline"; fi
  for side in $order; do
    dir="$out/r$i-$side"
    echo "== round $i: $side"
    # shellcheck disable=SC2086  # $args is a list of flags
    PYTHONPATH="$out/site-$side${PYTHONPATH:+:$PYTHONPATH}" timeout "${TREE_TIMEOUT:-300}" \
      python3 -m speckernel.tools.cli bench decode $args --out "$dir" > "$dir.log" 2>&1
    echo "   exit $?"
    if [ "$side" = baseline ]; then base_dirs+=(--baseline "$dir"); else cand_dirs+=(--candidate "$dir"); fi
  done
done
PYTHONPATH="$out/site-candidate${PYTHONPATH:+:$PYTHONPATH}" python3 -m speckernel.tools.cli bench compare \
  "${base_dirs[@]}" "${cand_dirs[@]}" --tolerance "${TOLERANCE:-0.05}" --out "$out/compare"
