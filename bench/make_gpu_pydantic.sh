#!/usr/bin/env bash
# Builds .gpu-ray/pydantic-py312.tar.xz (2 MB) for the GPU machine's gRPC stage (bench/gpu_session.sh): the
# standalone servers validate their flags with pydantic, which that image lacks, and the whole Ray Serve tree of
# ../shared/wheels (22 MB) does not fit in a device call's 64 MiB next to the working tree. Takes pydantic and
# its three small dependencies out of that tree, unchanged. Run from the repository root:
#   bash bench/make_gpu_pydantic.sh
set -euo pipefail
tree=${1:-../shared/wheels/ray-serve-2.60.0-py312-gpu-site.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xJf "$tree" -C "$work" --wildcards './pydantic*' './annotated_types*' './typing_inspection*'
mkdir -p .gpu-ray
tar cJf .gpu-ray/pydantic-py312.tar.xz -C "$work" .
ls -l .gpu-ray/pydantic-py312.tar.xz
