#!/usr/bin/env bash
# Issue 29's service-level goal (bench/bench_service_levels.py) in ONE device call of under 5 minutes: inflate the
# demo pair to the Qwen3-4B shape, start `dspark serve --no-ray` on the GPU with 32 slots, calibrate the saturating
# rate and the target, then the two client populations at 1.5x that rate without and with tiers. Run from the
# repository root carrying .gpu-ray (the Ray Serve tree of ../shared/wheels: the client's pydantic comes from it),
# .whl (openai<2, distro, jiter, sniffio for Python 3.12: the benchmark client) and .data/prompts (humaneval.jsonl,
# mbpp.jsonl):
#   bash bench/gpu_service_levels.sh $OUT
# Writes service_levels.json / .md / .log and server.log under OUT and prints the result table last. Without
# CUDA it runs the same steps on the demo pair as it is (shorter runs): its CPU path,
#   PYTHON=.venv/bin/python bash bench/gpu_service_levels.sh /tmp/slo-cpu
# SLO_ADMISSION=refuse measures the refusing server; EXTRA="..." passes more bench options.
set -uo pipefail
out=${1:?usage: bench/gpu_service_levels.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
prompts=.data/prompts
[[ -d $prompts ]] || prompts=../shared/data/prompts
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # The GPU image's Python 3.12 lacks the client's packages: the carried trees (a CPU run has them installed).
  PYTHON=$py source bench/gpu_site.sh
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  args=(--inflate qwen3-4b --max-requests 32 --output-len 64 --duration 15 --calibration-s 8)
else
  args=(--max-requests 8 --output-len 24 --duration 10 --calibration-s 5)
fi
# shellcheck disable=SC2086  # EXTRA is a word list on purpose
timeout "${LIMIT_S:-285}" "$py" bench/bench_service_levels.py --prompts-dir "$prompts" --scratch /tmp/dspark-slo \
  --slo-admission "${SLO_ADMISSION:-queue}" --out-dir "$out" "${args[@]}" ${EXTRA:-} 2>&1 | tee "$out/service_levels.log"
rc=${PIPESTATUS[0]}
cp /tmp/dspark-slo/server.log "$out/server.log" 2>/dev/null || true
echo "=== exit $rc after $SECONDS s"
if [[ -f $out/service_levels.md ]]; then
  grep -E '^(goal|\|)' "$out/service_levels.md"
else
  grep -E '^\| (run|---|no tiers|tiers) ' "$out/service_levels.log"  # the runs finished before the limit
fi
exit "$rc"
