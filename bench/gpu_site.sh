# Sourced by the GPU call scripts (bench/gpu_serve_matrix.sh, gpu_service_levels.sh, gpu_reliability.sh) from the
# repository root: the GPU image's Python 3.12 lacks Ray Serve and the benchmark client, so the carried trees go to
# /tmp/site, first on PYTHONPATH: .gpu-ray/ray-serve-*.tar.xz (the Ray Serve tree of ../shared/wheels, with
# FastAPI, pydantic and uvicorn) and .whl/*.whl (openai<2, distro, jiter, sniffio), each where it was carried.
# $PYTHON picks the interpreter (default python3).
mkdir -p /tmp/site
if compgen -G ".gpu-ray/ray-serve-*.tar.xz" > /dev/null; then
  tar xJf .gpu-ray/ray-serve-*.tar.xz -C /tmp/site
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
