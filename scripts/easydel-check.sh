#!/usr/bin/env bash
# Runs examples/easydel_offload.py (EasyDeL's eSurge engine serving a tiny random-weight Llama on
# CPU) in a virtualenv of its own, built once and cached:
#   scripts/easydel-check.sh [example options...]
#   (e.g. --reference: also a run whose pool never evicts, the most prefix caching can save)
#   scripts/easydel-check.sh --random [TRIALS] [--seed S]: scripts/easydel_random.py, random
#   workloads with the connector against eSurge alone
#   KVXFER_EASYDEL_ENV  where the virtualenv lives (default ~/.cache/jax_kvxfer/easydel-venv)
#   PYTHON  the Python 3.11 that makes it (default python3.11)
# The environment (found by trying, Python 3.11; 2.8 GB; here 2.5 minutes, then 1.5 for this
# repository's native build):
#   - jax/jaxlib 0.10.2 with easydel 0.3.0 and ejkernel 0.0.78 installed with --no-deps:
#     ejkernel 0.0.78 pins jax~=0.9.0, which pip cannot satisfy together with jax 0.10
#     (0.0.80.x is refused by easydel 0.3.0 at import);
#   - easydel's, eformer's and ejkernel's declared requirements, except ray[default]: easydel and
#     eformer import ray at import time (`from ray import is_initialized`, eformer.executor), so
#     the core `ray` wheel is installed, without the dashboard extras of [default];
#   - pillow (imported by esurge/multimodal/manager.py, not declared) and torch: importing any
#     easydel model imports all of easydel.modules, whose glm4v_moe patches a transformers
#     class that needs torch. The CPU build when pip can find it (this machine's find-links
#     hold torch 2.13.0+cpu); otherwise PyPI's torch, which pulls the CUDA libraries (GBs);
#   - this repository, built with its own build folder inside the virtualenv (the work tree's
#     build/ belongs to `make setup`), reinstalled when its sources change.
# The example is run with EASYDEL_AUTO=0: easydel's automatic XLA_FLAGS abort jaxlib 0.10.2.
# Its last line is a one-line summary.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${KVXFER_EASYDEL_ENV:-$HOME/.cache/jax_kvxfer/easydel-venv}
PY=$ENV/bin/python
PYTHON=${PYTHON:-python3.11}
STAMP=$ENV/.easydel-stamp
DEPS_VERSION=2  # bump when the lists below change
TORCH_CPU="torch==2.13.0+cpu"

# easydel 0.3.0's Requires-Dist (ray[default] -> ray, and without ejkernel/eformer, which are
# installed with --no-deps), then eformer 0.0.99.12's and ejkernel 0.0.78's.
REQS=(
  "jax==0.10.2" "jaxlib==0.10.2"
  "ray==2.54.0" "einops~=0.8.0" "transformers~=5.5.0" "sentencepiece>=0.2.0" "flax==0.12.3"
  "fastapi>=0.115.2" "wandb>=0.22.2" "uvloop==0.21.0" "uvicorn[standard]>=0.32.0"
  "jinja2>=3.1.5" "grain~=0.2.11" "datasets>=3.6.0" "gcsfs>=2024.2,<2026" "zstandard>=0.23.0"
  "pyyaml>=6.0" "msgspec~=0.19.0" "partial-json-parser>=0.2.1.1.post6"
  "google-api-python-client>=2.179.0" "cryptography>=45.0.6" "pyzmq>=27.1.0" "grafanalib>=0.7.1"
  "optax>=0.2.2" "ml-collections==1.1.0" "plum-dispatch==2.3.2" "mergedeep~=1.3.4" "tblib~=3.0.0"
  "pyyaml~=6.0.2" "contextlib2~=21.6.0" "safetensors>=0.6.2" "tqdm>=4.67.1" "psutil>=7.0.0"
  "google-cloud-storage>=3.3.0" "tensorstore>=0.1.76" "braceexpand>=0.1.7" "chex>=0.1.91"
  "jaxtyping>=0.3.2" "fsspec[http]>=2024.2,<2026"
  "beartype>=0.22.2" "pydantic>=2.11.10"
  "pillow" "tokenizers"
)
# installed with --no-deps: ejkernel's jax~=0.9.0 pin, eformer's ray[default]
NOT_EASYDEL_DEPS=(easydel==0.3.0 ejkernel==0.0.78 eformer==0.0.99.12)
BUILD_DEPS=("scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja)

want="deps=$DEPS_VERSION"
# pip, quiet, without the warnings this machine's pip configuration prints for every package
pipq() {
  "$PY" -m pip "$1" -q "${@:2}" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

have=$(cat "$STAMP" 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  start=$SECONDS
  echo "easydel-check: building $ENV (a few minutes, once)" >&2
  [ -x "$PY" ] || "$PYTHON" -m venv "$ENV"
  pipq install --upgrade pip
  pipq install "${REQS[@]}" "${BUILD_DEPS[@]}"
  pipq install --no-deps "${NOT_EASYDEL_DEPS[@]}"
  torch_versions=$("$PY" -m pip index versions torch 2>/dev/null || true)
  case "$torch_versions" in
    *"${TORCH_CPU#torch==}"*) pipq install "$TORCH_CPU" ;;
    *) pipq install torch ;;
  esac
  rm -f "$ENV/.kvxfer-stamp"
  echo "$want" > "$STAMP"
  echo "easydel-check: environment built in $((SECONDS - start)) s, $(du -sh "$ENV" | cut -f1)" >&2
fi

# This repository: reinstalled (incrementally, in its own build folder) when its sources change.
src=$(find pyproject.toml CMakeLists.txt ffi jax_kvxfer -type f \
        -not -path '*/__pycache__/*' -not -name '*.so' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [ "$(cat "$ENV/.kvxfer-stamp" 2>/dev/null || true)" != "$src" ]; then
  start=$SECONDS
  pipq install --no-build-isolation --no-deps -C build-dir="$ENV/kvxfer-build" .
  echo "$src" > "$ENV/.kvxfer-stamp"
  echo "easydel-check: jax_kvxfer installed in $((SECONDS - start)) s" >&2
fi

export EASYDEL_AUTO=0 PYTHONUNBUFFERED=1
if [ "${1:-}" = --random ]; then  # random workloads against eSurge alone
  exec "$PY" scripts/easydel_random.py "${@:2}"
fi
exec "$PY" examples/easydel_offload.py "$@"
