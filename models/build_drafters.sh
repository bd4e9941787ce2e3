#!/usr/bin/env bash
# Rebuild the three demo drafters, their STS calibration and the offline evaluation in ONE GPU call
# (about 7 minutes on one H200):
#   1. gen-responses: the target answers random prompts of the stdlib corpus (-> .data/responses);
#   2. train-drafter x 3 IN PARALLEL on the one GPU: DSpark (vanilla Markov head), DSpark with the RNN head,
#      the DFlash-style baseline (no sequential head); each fits STS on held-out traces when it is done;
#   3. dspark eval on the code prompt sets (humaneval, mbpp) at T = 1, block 7.
#
#   OUT=/some/dir PROMPTS=.data/prompts bash models/build_drafters.sh
#
# Needs .data/demo (the token corpus) and $PROMPTS/{humaneval,mbpp}.jsonl. Writes the drafters to
# $DRAFTERS_DIR/draft_{dspark,dspark_rnn,dflash} (default models/demo) and the report to $EVAL_DIR (default
# docs/eval), and packs them for the trip back, every file < 16 MiB:
#   $OUT/draft_dspark.tar, $OUT/draft_dspark_rnn.tar, $OUT/draft_dflash.tar   (tar -xf X.tar -C models/demo)
#   $OUT/eval.tar                                                              (tar -xf eval.tar -C docs)
#   $OUT/responses_meta.json, $OUT/logs.tar (training and evaluation logs), $OUT/bench_gen_responses.json
# The drafters are packed as soon as training ends, so they come back even if the evaluation runs out of time.
# The evaluation table is printed last.
#
# Settings through the environment: DEVICE (cuda), TRAIN_MINUTES (4.5), TRAIN_THREADS (4 CPU threads per
# training process), PYTHON (python), TARGET, DATA, RESPONSES, DRAFTERS_DIR, EVAL_DIR,
# GEN_ARGS / TRAIN_ARGS / EVAL_ARGS (extra flags), BENCH_GEN (1: time the two decoding engines first, ~10 s),
# TINY=1 (a CPU smoke of the same steps, about 2 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
OUT=${OUT:?set OUT to the folder that receives the archives}
PROMPTS=${PROMPTS:-.data/prompts}
DATA=${DATA:-.data/demo}
TARGET=${TARGET:-models/demo/target}
DEVICE=${DEVICE:-cuda}
TRAIN_MINUTES=${TRAIN_MINUTES:-4.5}
RESPONSES=${RESPONSES:-.data/responses}
DRAFTERS_DIR=${DRAFTERS_DIR:-models/demo}
EVAL_DIR=${EVAL_DIR:-docs/eval}
GEN_ARGS=${GEN_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}
if [ -n "${TINY:-}" ]; then
  GEN_ARGS="--num-train 16 --num-val 8 --batch-size 8 --val-batch-size 4 --min-prompt-tokens 16 \
    --max-prompt-tokens 48 --max-new-tokens 24 $GEN_ARGS"
  TRAIN_ARGS="--max-steps 6 --batch-size 4 --num-anchors 8 --draft-layers 1 --eval-every 3 --eval-sequences 8 \
    --warmup-steps 2 --sts-prompts 8 --sts-max-new-tokens 16 $TRAIN_ARGS"
  EVAL_ARGS="--max-prompts 3 --max-new-tokens 24 $EVAL_ARGS"
fi
HEADS=("vanilla:draft_dspark" "rnn:draft_dspark_rnn" "none:draft_dflash")
mkdir -p "$OUT" "$DRAFTERS_DIR"
phase() { echo "=== [$(date +%T), ${SECONDS}s] $*"; }
for file in humaneval mbpp; do
  [ -f "$PROMPTS/$file.jsonl" ] || { echo "missing $PROMPTS/$file.jsonl (copy shared/data/prompts there)" >&2; exit 2; }
done

LOGS=$(mktemp -d /tmp/dspark-build-logs.XXXXXX)
if [ "${BENCH_GEN:-1}" = 1 ]; then
  phase "bench: gen-responses decoding (transformers dynamic cache) vs TargetModel.generate"
  timeout 120 env PYTHONPATH=. $PY bench/bench_gen_responses.py --target "$TARGET" --device "$DEVICE" \
    ${TINY:+--small} --out "$OUT/bench_gen_responses.json" 2>&1 | grep -v '%|' || echo "(bench failed; continuing)"
fi
phase "gen-responses"
rm -rf "$RESPONSES"
$PY -m cluster.cli gen-responses --target "$TARGET" --data "$DATA" --out "$RESPONSES" --device "$DEVICE" \
  --val-batch-size 64 $GEN_ARGS 2>&1 | tr '\r' '\n' | grep -v '%|' || true
[ -f "$RESPONSES/meta.json" ] || { echo "gen-responses failed" >&2; exit 1; }
cp "$RESPONSES/meta.json" "$OUT/responses_meta.json"

phase "train-drafter x3 in parallel ($TRAIN_MINUTES min each)"
pids=()
for spec in "${HEADS[@]}"; do
  head=${spec%%:*}
  name=${spec##*:}
  rm -rf "${DRAFTERS_DIR:?}/$name"
  OMP_NUM_THREADS=${TRAIN_THREADS:-4} $PY -m cluster.cli train-drafter --target "$TARGET" --responses "$RESPONSES" \
    --out "$DRAFTERS_DIR/$name" --head "$head" --device "$DEVICE" --max-minutes "$TRAIN_MINUTES" $TRAIN_ARGS \
    > "$LOGS/train_$name.raw" 2>&1 &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for spec in "${HEADS[@]}"; do
  name=${spec##*:}
  tr '\r' '\n' < "$LOGS/train_$name.raw" | grep -v '%|' > "$LOGS/train_$name.log" || true
  rm "$LOGS/train_$name.raw"
  echo "--- $name"
  tail -n 14 "$LOGS/train_$name.log"
  if [ -d "$DRAFTERS_DIR/$name" ]; then tar -C "$DRAFTERS_DIR" -cf "$OUT/$name.tar" "$name"; fi
done
tar -C "$LOGS" -cf "$OUT/logs.tar" .
[ "$failed" = 0 ] || { echo "a training run failed (logs above)" >&2; exit 1; }

phase "dspark eval (T=1, block 7) on humaneval + mbpp"
rm -rf "$EVAL_DIR"
drafters=()
for spec in "${HEADS[@]}"; do
  name=${spec##*:}
  drafters+=("${name#draft_}=$DRAFTERS_DIR/$name")
done
$PY -m cluster.cli eval --target "$TARGET" --drafters "${drafters[@]}" --baseline dflash \
  --prompts "$PROMPTS/humaneval.jsonl" "$PROMPTS/mbpp.jsonl" --temperature 1 --block 7 --device "$DEVICE" \
  --out "$EVAL_DIR" $EVAL_ARGS > "$LOGS/eval.raw" 2>&1 || eval_failed=1
tr '\r' '\n' < "$LOGS/eval.raw" | grep -v '%|' > "$LOGS/eval.log" || true
rm "$LOGS/eval.raw"
tar -C "$LOGS" -cf "$OUT/logs.tar" .
[ -z "${eval_failed:-}" ] || { tail -n 30 "$LOGS/eval.log"; exit 1; }
tar -C "$(dirname "$EVAL_DIR")" -cf "$OUT/eval.tar" "$(basename "$EVAL_DIR")"
ls -l "$OUT"
phase "done"
cat "$EVAL_DIR/results.md"
