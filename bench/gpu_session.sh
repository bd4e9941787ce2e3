#!/usr/bin/env bash
# Every GPU measurement of the project in ONE device call, most important checks first, each stage with its own
# time limit so that a slow stage cannot starve the later ones. Run from the repository root on the GPU machine:
#   bash bench/gpu_session.sh OUT_DIR [POLICY_SWEEP_SECONDS]
#   STAGES="kernels verify grpc policies" bash bench/gpu_session.sh OUT_DIR 240   # a subset, in this order
# carrying the prompt sets in .data/prompts (humaneval.jsonl, mbpp.jsonl). Stages (default: tests kernels draft
# host engine policies) and what they write under OUT_DIR: tests and host -> logs.txt, kernels -> kernels.json,
# draft -> draft_profile.json, verify -> profile_verify.json, engine -> engine_gpu.json, grpc (issue 8's CPU
# benchmark on this machine's CPUs, a core per process) -> grpc_overhead.json, disagg (issue 12's single-GPU
# shape: drafter and verifier as separate server processes on this one GPU, against both in one process; needs
# the pydantic tree too) -> disagg.json, disagg_throughput.png, policies -> policies.json,
# policies.log, policies_*.png, attention (the slot attention's split keys vs one pass; not a default stage) ->
# slot_attention.json, round (device busy / idle per round by host phase at 1 and 8 requests, ROUND_C="..."
# picks levels; not a default stage) -> round_profile.json, gemm (issue 11's skinny weight GEMMs vs cuBLAS, with a launch sweep; not a default
# stage) -> gemm.json; SKINNY=1 adds TargetModel.skinny_gemm to the verify stage (exactness, numerics, step times).
# One device call brings back at most eight files: choose the stages accordingly.
# Prints each stage's table as it finishes.
set -uo pipefail
out=${1:?usage: bench/gpu_session.sh OUT_DIR [POLICY_SWEEP_SECONDS]}
sweep_s=${2:-200}  # 2026-12-01: the stages before the sweep took ~310 s (two of them at their limits)
stages=" ${STAGES:-tests kernels draft host engine policies} "
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, report its exit code, never abort the session
  local name=$1 limit=$2; shift 2
  [[ $stages == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The GPU tests, file by file (a summary line each, so a stage cut by its limit still says which files passed);
# TESTS="file ..." picks files.
gpu_tests=${TESTS:-"tests/scheduler/test_engine_graphs.py tests/scheduler/test_graph_capture_guard.py
  tests/verify_service/test_fused_layers.py tests/kernels/test_kernels_slot_attention.py
  tests/kernels/test_kernels_rejection.py tests/draft_service/test_draft_sampling.py
  tests/draft_service/test_draft_engine_sampling.py tests/draft_service/test_draft_slot_attention.py
  tests/draft_service/test_draft_fused.py tests/kernels/test_kernels_skinny_gemm.py tests/kernels/test_kernels_pdl.py"}
run_tests() {
  local f
  for f in $gpu_tests; do
    echo "$f: $(python3 -m pytest -q -x -p no:cacheprovider "$f" 2>&1 | tail -n 1)"
  done
}
stage tests ${TESTS_S:-120} bash -c "$(declare -f run_tests); gpu_tests='$gpu_tests'; run_tests" 2>&1 \
  | tee "$out/logs.txt"
stage kernels 200 python3 bench/bench_kernels.py --sweep cdf select --tune --profile --out "$out/kernels.json"
stage draft 120 python3 bench/profile_draft_gpu.py --out "$out/draft_profile.json"  # skinny GEMMs off and on
stage host 75 python3 -m bench.profile_engine_host --device cuda --requests 32 128 --rounds 200 --check 32 \
  --prompt-tokens 96 --max-seq-len 456 \
  2>&1 | tail -n 20 | tee -a "$out/logs.txt"
stage attention 90 python3 bench/bench_slot_attention.py --requests 1 2 4 8 32 --out "$out/slot_attention.json"
stage gemm 270 python3 bench/bench_skinny_gemm.py --sweep --sweep-time-s 150 --out "$out/gemm.json"
stage round 240 python3 bench/profile_round_gpu.py --prompts-dir .data/prompts --concurrency ${ROUND_C:-1 8} --draft-ahead on off \
  --out "$out/round_profile.json"  # device idle per round by host phase
stage verify $((150 + ${SKINNY:-0} * 60)) python3 bench/profile_verify_gpu.py --fused-only ${SKINNY:+--skinny-gemm} \
  --skinny-tuning "$out/gemm.json" --out-dir "$out"  # the gemm stage's swept launches, when it ran first
# The standalone servers validate their flags with pydantic, which the GPU image lacks: carry
# .gpu-ray/pydantic-py312.tar.xz (pydantic, pydantic_core, annotated_types, typing_inspection from the Ray Serve tree
# of ../shared/wheels; `bash bench/make_gpu_pydantic.sh` builds it) for this stage.
[[ -f .gpu-ray/pydantic-py312.tar.xz ]] && mkdir -p /tmp/pyd && tar xJf .gpu-ray/pydantic-py312.tar.xz -C /tmp/pyd
stage grpc 150 env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=.:/tmp/pyd python3 bench/bench_grpc_overhead.py --concurrency 8 \
  --max-tokens 64 --repeats "${GRPC_REPEATS:-21}" --sps docs/benchmarks/sps_cpu_demo.json --out "$out/grpc_overhead.json" \
  2>&1 | tail -n 40 | tee -a "$out/logs.txt"
stage disagg 540 env PYTHONPATH=.:/tmp/pyd python3 bench/bench_disagg.py --shape qwen3-4b --draft-device cuda:0 \
  --verify-device cuda:0 --prompts-dir .data/prompts --out-dir "$out" --concurrency 1 8 32 128 --graphs capture \
  --policies autoregressive fixed-1 full dspark --groups 1 2 --warmup-s 1 --measure-s 3 2>&1 | tail -n 70 \
  | tee -a "$out/logs.txt"
stage engine 90 python3 -m bench.bench_engine_gpu --requests 1 8 32 128 --rounds 15 --warmup 3 \
  --out "$out/engine_gpu.json"
stage policies $((sweep_s + 30)) python3 bench/bench_policies_gpu.py --prompts-dir .data/prompts \
  --out-dir "$out" --time-limit-s "$sweep_s" --repeats 2 --warmup-s 1 --measure-s 8
