#!/usr/bin/env bash
# The chained rounds on the GPU in one device call: their exactness tests, then sweeps with chain_verify on and
# off at 1 and 8 requests (paired, same machine), and on at 32 and 128 (CHAIN_SET=c1_8, the default), or DSpark's
# planned lengths at 1, 8 and 32 requests on / off and its draft skip at 1 request (CHAIN_SET=plan), or drafting
# behind the chained verify step on / off at 1, 8 and 32 requests (CHAIN_SET=behind). Run from the repository root
# there:
#   [CHAIN_SET=plan] bash bench/gpu_chain_session.sh OUT_DIR        (carry .data/prompts: humaneval.jsonl, mbpp.jsonl)
# Writes OUT_DIR/logs.txt and OUT_DIR/<sweep>/policies.{json,log} (plots dropped: a call returns 8 files).
set -uo pipefail
out=${1:?usage: bench/gpu_chain_session.sh OUT_DIR}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$SECONDS
if [[ ${CHAIN_TESTS:-1} == 1 ]]; then  # CHAIN_TESTS=0: the sweeps only
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/scheduler/test_engine_graphs.py \
    -k "cuda_graphs_equal_eager or chained or behind" 2>&1 | tail -n 5 | tee "$out/logs.txt"
  echo "=== tests after $((SECONDS - t0)) s"
fi
sweep() {  # sweep NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  mkdir -p "$out/$name"
  timeout $((limit + 40)) python3 bench/bench_policies_gpu.py --prompts-dir .data/prompts --out-dir "$out/$name" \
    --hf-repeats 0 --warmup-s 1 --time-limit-s "$limit" "$@" 2>&1 | tail -n 14
  rm -f "$out/$name"/*.png
  echo "=== $name after $((SECONDS - t0)) s"
}
case ${CHAIN_SET:-c1_8} in
  c1_8)  # the chained rounds' first paired run
    sweep chain_on_c1_8 130 --concurrency 1 8 --policies autoregressive full dspark --repeats 2 --measure-s 6 --chain-verify on
    sweep chain_off_c1_8 120 --concurrency 1 8 --policies autoregressive full dspark --repeats 2 --measure-s 6 --chain-verify off
    sweep chain_on_c32_128 110 --concurrency 32 128 --repeats 1 --measure-s 6 --chain-verify on ;;
  plan)  # DSpark's planned uniform lengths chained at 1, 8 and 32 requests (paired with chaining off),
    # and whether skipping the drafter pays at 1 request (--draft-skip off against the chained run's dspark)
    sweep plan_on 200 --concurrency 1 8 32 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify on
    sweep plan_off 140 --concurrency 1 8 32 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify off
    sweep skip_off_c1 70 --concurrency 1 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify on \
      --draft-skip off ;;
  plan32)  # the plan set's second call: the 32-request level its first sweep ran out of time for, and
    # the draft skip at 1 request (the first sweep compiles the Triton kernels: ~90 s of its limit)
    sweep plan_on_c32 180 --concurrency 32 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify on
    sweep plan_off_c32 90 --concurrency 32 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify off
    sweep skip_off_c1 110 --concurrency 1 --policies full dspark --repeats 2 --measure-s 8 --user-pass-s 0 --chain-verify on \
      --draft-skip off ;;
  behind)  # drafting behind the chained verify step (--chain-draft), paired on / off on one machine,
    # with the per-user pass at 1 request in both
    sweep behind_on 210 --concurrency 1 8 32 --policies autoregressive full dspark --repeats 1 --measure-s 6 \
      --user-pass-s 60 --chain-draft on
    sweep behind_off 170 --concurrency 1 8 32 --policies autoregressive full dspark --repeats 1 --measure-s 6 \
      --user-pass-s 60 --chain-draft off ;;
esac
