#!/usr/bin/env bash
# The serving matrix (bench/serve_matrix.py) in ONE device call on the lent GPU machine: unpack the Ray Serve tree
# and the benchmark client's wheels, inflate the demo pair to the Qwen3-4B shape, then serve and measure every
# layout and policy through HTTP. Run from the repository root, carrying .gpu-ray (the tree of ../shared/wheels),
# .whl (openai<2, distro, jiter, sniffio for Python 3.12) and .data/prompts (humaneval.jsonl, mbpp.jsonl):
#   LAYOUTS="no-ray" POLICIES="autoregressive dspark full" bash bench/gpu_serve_matrix.sh $OUT 540
# REPEAT_START=1 starts every cell a second time on its filled cache folder (SPS tables, Triton kernels): the
# start-up times then come cold and warm.
set -uo pipefail
out=${1:?usage: bench/gpu_serve_matrix.sh OUT_DIR [TIME_LIMIT_S]}
limit=${2:-540}
mkdir -p "$out"
source bench/gpu_site.sh
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# TIME_LIMIT_S stops starting cells; a cell started before it still runs to its end, so the run is cut at
# HARD_LIMIT_S (default: TIME_LIMIT_S + 60) to leave the call time to pack the server logs: the results file is
# written after every cell, so the finished cells come back either way.
# shellcheck disable=SC2086  # word lists on purpose
timeout --signal=INT "${HARD_LIMIT_S:-$((limit + 60))}" \
python3 bench/serve_matrix.py --inflate qwen3-4b --prompts-dir .data/prompts --layouts ${LAYOUTS:-no-ray ray ray-colocated} \
  --policies ${POLICIES:-autoregressive dspark full fixed-1 dspark-async} --concurrency ${LEVELS:-1 8 32 128} \
  --duration "${DURATION:-6}" --time-limit-s "$limit" --out-dir "$out" ${REPEAT_START:+--repeat-start} ${EXTRA:-}
(cd /tmp/dspark-matrix && tar czf "$out/server_logs.tgz" server-*.log) || true
