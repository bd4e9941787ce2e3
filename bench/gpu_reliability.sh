#!/usr/bin/env bash
# Issue 31's recovery and SPS-stability measurements in ONE device call on the lent GPU machine, a host that runs
# nothing but this call (16 cores): SPS profiles of the demo verifier on its CPU, the fault injection of
# `dspark serve` on its CPU (one verifier replica, then two), and SPS profiles of the verifier on its GPU with the
# demo pair inflated to the Qwen3-4B shape. Run from the repository root, carrying .gpu-ray (the tree of
# ../shared/wheels) and .whl (openai<2, distro, jiter, sniffio for Python 3.12):
#   bash bench/gpu_reliability.sh OUT_DIR
#   STAGES="sps_gpu" bash bench/gpu_reliability.sh OUT_DIR     # a subset (sps_cpu fault fault2 sps_gpu)
# Each stage has its own time limit, so a slow stage cannot starve the later ones; a table of the results last.
set -uo pipefail
out=${1:?usage: bench/gpu_reliability.sh OUT_DIR}
stages=" ${STAGES:-sps_cpu fault fault2 sps_gpu} "
mkdir -p "$out"
source bench/gpu_site.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, report its exit code, never abort the call
  local name=$1 limit=$2; shift 2
  [[ $stages == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
}
# The CPU stages hide the GPU: dspark serve then serves on the CPU, as on a laptop.
stage sps_cpu 180 env CUDA_VISIBLE_DEVICES= python3 bench/sps_stability.py --profiles 8 \
  --out "$out/sps_stability_cpu.json"
stage fault 240 env CUDA_VISIBLE_DEVICES= python3 bench/fault_inject.py --out "$out/fault_inject_cpu.json"
stage fault2 240 env CUDA_VISIBLE_DEVICES= python3 bench/fault_inject.py --port 8126 --verifiers 2 \
  --out "$out/fault_inject_cpu_two_verifiers.json"
inflated=/tmp/dspark-inflated/qwen3-4b
stage sps_gpu 420 bash -c "
  python3 -m cluster.cli inflate --target models/demo/target --draft models/demo/draft_dspark --shape qwen3-4b \
    --out $inflated --dtype bfloat16 --device cuda &&
  python3 bench/sps_stability.py --device cuda --dtype bfloat16 --target $inflated/target \
    --draft $inflated/draft --profiles 8 --out $out/sps_stability_gpu.json"
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def s(value): return "-" if value is None else f"{value:.2f} s"
print("| run | result |\n|---|---|")
for name in ("sps_stability_cpu", "sps_stability_gpu"):
    path = out / f"{name}.json"
    if path.exists():
        r = json.loads(path.read_text())
        print(f"| {name} | steps/s spread max {100 * r['max_spread']:.1f} % / median {100 * r['median_spread']:.1f} %;"
              f" shape max {100 * r['max_shape_spread']:.1f} %; profile {min(r['profile_seconds']):.1f}-"
              f"{max(r['profile_seconds']):.1f} s |")
for name in ("fault_inject_cpu", "fault_inject_cpu_two_verifiers"):
    path = out / f"{name}.json"
    if path.exists():
        r = json.loads(path.read_text())
        for f in r["faults"]:
            print(f"| {name} {f['role']} | first token {s(f.get('first_token_after_kill_s'))}, first success "
                  f"{s(f.get('first_success_after_kill_s'))}, stall {s(f.get('max_stall_of_surviving_streams_s'))},"
                  f" cut {f.get('streams_cut')}, other text {f.get('completed_with_other_text')} |")
        print(f"| {name} | completions {r.get('completions')}, failed {r.get('failed')} |")
EOF
