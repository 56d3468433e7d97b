#!/usr/bin/env bash
# Compiles the demo model's steps for an H200 on a machine without a GPU, as XLA's GPU
# compiler would on one (the same passes, scheduling, buffer assignment and ptxas), and reports
# what the optimized programs hold: scripts/layer_wait_probe.py --deviceless, at pools of 8 and
# 48 GiB of the h200 preset, decode steps and steps that also prefill, with and without layer
# groups (or, given options, one run of the probe with them). Nothing runs, so no times: it answers
# questions of a program's memory and order (XLA's memory estimate, copies of the pool, the
# waits' order) while no GPU is at hand.
#   scripts/gpu-compile-check.sh [probe options...]   (e.g. --groups 4 --hlo-dir /tmp/hlo)
#   KVXFER_GPU_COMPILE_ENV  where its virtualenv lives (default ~/.cache/jax_kvxfer/gpu-compile-venv)
#   PYTHON  the Python that makes it (default python3)
# The environment (about 260 MB downloaded, 1 GB on disk): jax and jaxlib with JAX's CUDA 13
# plugin and PJRT of the same version, without the NVIDIA libraries they declare (compiling
# loads none of them), and this repository built with its CUDA handlers (nvcc required).
# XLA takes ptxas from PATH or /usr/local/cuda. The GPU: scripts/h200-target.txtpb.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${KVXFER_GPU_COMPILE_ENV:-$HOME/.cache/jax_kvxfer/gpu-compile-venv}
PY=$ENV/bin/python
PYTHON=${PYTHON:-python3}
JAX_VERSION=0.10.2  # the plugin's version must be jaxlib's
want="jax=$JAX_VERSION"

command -v nvcc > /dev/null || { echo "gpu-compile-check: needs nvcc (the CUDA handlers)" >&2; exit 2; }
pipq() {  # pip, quiet, without the warnings this machine's pip configuration prints
  "$PY" -m pip "$1" -q "${@:2}" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
if [ "$(cat "$ENV/.stamp" 2>/dev/null || true)" != "$want" ]; then
  start=$SECONDS
  echo "gpu-compile-check: building $ENV (a minute or two, once)" >&2
  [ -x "$PY" ] || "$PYTHON" -m venv "$ENV"
  pipq install --upgrade pip
  pipq install "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "scikit-build-core>=0.10" \
    "nanobind>=2.0" cmake ninja
  pipq install --no-deps "jax-cuda13-plugin==$JAX_VERSION" "jax-cuda13-pjrt==$JAX_VERSION"
  rm -f "$ENV/.kvxfer-stamp"
  echo "$want" > "$ENV/.stamp"
  echo "gpu-compile-check: environment built in $((SECONDS - start)) s" >&2
fi
# This repository: reinstalled (in its own build folder) when its sources change.
src=$(find pyproject.toml CMakeLists.txt ffi jax_kvxfer -type f \
        -not -path '*/__pycache__/*' -not -name '*.so' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [ "$(cat "$ENV/.kvxfer-stamp" 2>/dev/null || true)" != "$src" ]; then
  pipq install --no-build-isolation --no-deps -C build-dir="$ENV/kvxfer-build" \
    -C cmake.define.KVXFER_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 .
  echo "$src" > "$ENV/.kvxfer-stamp"
fi
# JAX_PLATFORMS=cpu: no CUDA client is made (there is no driver); the plugin's topology still
# compiles for the GPU described.
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
probe=("$PY" scripts/layer_wait_probe.py --preset h200 --deviceless scripts/h200-target.txtpb
       --blocks 4096,24576)
if [ $# -gt 0 ]; then exec "${probe[@]}" "$@"; fi
echo "decode steps:"
"${probe[@]}" --groups 0,4,8 --wait-on layers,pool,nothing
echo "steps that also prefill 8 rows of 256 tokens (attending as decodes do: cuDNN needs a GPU):"
"${probe[@]}" --groups 0,4 --prefill-rows 8
