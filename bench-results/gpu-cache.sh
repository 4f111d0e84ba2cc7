# Sourced by the GPU run scripts: the model cache they use, filled from $MODEL (the default
# GGUF) and $HUMANEVAL (HumanEval.jsonl.gz) on machines without PyPI.
export SPECKERNEL_CACHE=${SPECKERNEL_CACHE:-$HOME/skcache} PYTHONUNBUFFERED=1
mkdir -p "$SPECKERNEL_CACHE/models"
[ -n "${MODEL:-}" ] && cp "$MODEL" "$SPECKERNEL_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -n "${HUMANEVAL:-}" ] && cp "$HUMANEVAL" "$SPECKERNEL_CACHE/models/HumanEval.jsonl.gz"
true
