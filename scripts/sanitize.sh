#!/usr/bin/env bash
# compute-sanitizer over jax_kvxfer's CUDA kernels, on a GPU machine.
#
#   scripts/sanitize.sh [memcheck] [racecheck] [synccheck] [initcheck]   (default: all four)
#
# Each tool runs one Python process: scripts/sanitize_cases.py (every path of the CUDA handler
# once, checked bitwise, including out-of-range traced indices 10**6 and -5), then, in the same
# process, a focused selection of the test suite ($SANITIZE_PYTEST). Only our kernels are
# instrumented (--kernel-name kns=kvxfer: every kernel of ours is in namespace kvxfer), so XLA's
# own kernels neither slow the run down nor add noise. initcheck runs the cases alone and skips
# the ones whose inputs XLA's device code may write (the filter leaves those writes untracked, so
# they would read as uninitialized).
#
# Every tool's own summary line ("ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY: ...")
# is in the output; a line "sanitize <tool>: ..." per tool and "sanitize: ... OK|FAILED" come
# last. Exit 0 when every tool ran and reported nothing, 1 on any error, 2 when compute-sanitizer
# is missing or refuses this machine (e.g. a gVisor sandbox: "Device not supported").
#
# Environment:
#   SANITIZE_PYTEST         pytest arguments for the suite part (empty: the cases only)
#   SANITIZE_BUDGET         seconds for all tools together (default 540)
#   SANITIZE_INITCHECK_ARGS sanitize_cases.py options under initcheck (default "--initcheck";
#                           add --device-only should initcheck count pinned host memory that the
#                           CPU filled as uninitialized)
#   SANITIZE_DUMP_LAUNCHES  1: list every kernel launch and whether it was checked (long)
#   COMPUTE_SANITIZER       the binary (default: found on PATH or under /usr/local, /opt)
#   PYTHON                  the interpreter (default python3)
#   SANITIZE_ALLOW_CPU      1: a dry run of this script's logic on a machine without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."

tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
PY=${PYTHON:-python3}
BUDGET=${SANITIZE_BUDGET:-540}
DEFAULT_PYTEST="tests/ops/test_ops.py tests/ops/test_duplicates.py tests/manager/test_lanes.py -x -k 'test_lanes or memory_kinds or destinations_last_writer or traced_out_of_range or intra_pool_chain_jit_traced or negative_indices or gpu_uses or (many_duplicates and bfloat16) or within_one_pool or padding_and'"
PYTEST_ARGS=${SANITIZE_PYTEST-$DEFAULT_PYTEST}

# A pool per buffer (not XLA's one big arena), so memcheck sees the end of every pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
# No autotuning of XLA's own kernels: we check ours only, and under racecheck XLA's autotuner
# hit a hardware exception the sanitizer could not handle (H200, a 4096^2 float32 matmul
# in tests/manager/test_lanes.py), which made the whole context fail. Its default kernels
# need no tuning to be correct.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

find_sanitizer() {
  local c
  for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  c=$(find /usr/local /opt -maxdepth 6 -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -1)
  [ -n "$c" ] && { echo "$c"; return 0; }
  return 1
}

CS=$(find_sanitizer) || { echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
echo "sanitize: $CS ($("$CS" --version 2>&1 | grep -i version | head -1))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/sanitize: GPU /'

ALLOW_CPU=${SANITIZE_ALLOW_CPU:-0}  # 1: a dry run of this script's logic without a GPU
if [ "$ALLOW_CPU" != 1 ] && ! "$PY" -c "import jax_kvxfer as k, jax; assert k.HAS_CUDA_HANDLERS and jax.default_backend() == 'gpu'" 2>/dev/null; then
  echo "sanitize: building jax_kvxfer with its CUDA handlers"
  "$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.KVXFER_CUDA=ON -e . \
    || { echo "sanitize: build FAILED"; exit 1; }
  "$PY" -c "import jax_kvxfer as k, jax; assert k.HAS_CUDA_HANDLERS, 'no CUDA handlers'; assert jax.default_backend() == 'gpu', 'JAX sees no GPU'" \
    || { echo "sanitize: FAILED (no CUDA handlers or no GPU)"; exit 1; }
fi
so=$("$PY" -c "import jax_kvxfer._kvxfer_cuda as m; print(m.__file__)" 2>/dev/null)
kernels=$(grep -aoE '_ZN6kvxfer[A-Za-z0-9_]*Kernel[A-Za-z0-9_]*' "$so" 2>/dev/null | sort -u | tr '\n' ' ')
echo "sanitize: kernels matched by kns=kvxfer in $so: ${kernels:-none found}"

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
start=$(date +%s)
results=()
status=0
for tool in "${tools[@]}"; do
  log="$workdir/$tool.log"
  left=$(( BUDGET - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then
    results+=("sanitize $tool: NOT RUN (budget of ${BUDGET} s spent)"); status=1; continue
  fi
  opts=(--tool "$tool" --target-processes all --require-cuda-init no --kernel-name kns=kvxfer
        --print-limit 50 --error-exitcode 86)
  prog=("$PY" scripts/sanitize_cases.py)
  [ "$ALLOW_CPU" = 1 ] && prog+=(--allow-cpu)
  # SANITIZE_DUMP_LAUNCHES=1: list every launch with its filter status (proof that ours were
  # checked; long, as it lists XLA's launches too).
  [ "${SANITIZE_DUMP_LAUNCHES:-0}" = 1 ] && opts+=(--dump-kernel-launches)
  case "$tool" in
    initcheck) read -r -a extra <<< "${SANITIZE_INITCHECK_ARGS:---initcheck}"; prog+=("${extra[@]}") ;;
    racecheck) opts+=(--racecheck-report analysis) ;;
  esac
  [ "$tool" != initcheck ] && [ -n "$PYTEST_ARGS" ] && prog+=(--pytest "$PYTEST_ARGS")
  echo
  echo "===== sanitize: $tool (time left ${left} s) ====="
  echo "+ $CS ${opts[*]} ${prog[*]}"
  t0=$(date +%s)
  timeout -k 15 "$left" "$CS" "${opts[@]}" "${prog[@]}" > "$log" 2>&1
  rc=$?
  cat "$log"
  crashed=""
  # A crash of the process under the tool (a signal, no report at all: synccheck once ended so
  # on the H200, then ran clean three times) is run once more; an error report never is.
  left=$(( BUDGET - ($(date +%s) - start) ))
  if [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ] && [ "$left" -ge 30 ] \
     && ! grep -aqE '(ERROR|RACECHECK) SUMMARY' "$log"; then
    crashed=" (after a crash without a report, exit $rc, and one rerun)"
    echo "===== sanitize: $tool crashed (exit $rc) without a report; running it once more ====="
    timeout -k 15 "$left" "$CS" "${opts[@]}" "${prog[@]}" > "$log" 2>&1
    rc=$?
    cat "$log"
  fi
  secs=$(( $(date +%s) - t0 ))
  # One summary per tracked process (XLA may start helper processes; they report 0 errors).
  summary=$(grep -aE '(ERROR|RACECHECK) SUMMARY' "$log" | sed 's/^=* *//' | sort | uniq -c \
            | sed 's/^ *1 //; s/^ *\([0-9][0-9]*\) \(.*\)/\2 (x\1)/' | paste -sd';' - | sed 's/;/; /g')
  cases=$(grep -a '^sanitize_cases: [0-9]* cases' "$log" | tail -1)
  pyt=$(grep -a '^sanitize_cases: pytest exit' "$log" | tail -1 | cut -d' ' -f2-4)
  counts=$(grep -aE '^[0-9]+ (passed|failed).* in [0-9.]+s' "$log" | tail -1)
  verdict=ok
  if grep -aqE '^=+ .*(Device not supported|not supported on this)' "$log"; then
    verdict="UNSUPPORTED on this machine"; [ $status -eq 0 ] && status=2
    results+=("sanitize $tool: $(grep -aE '^=+ .*not supported' "$log" | head -1 | sed 's/^=* *//'): $verdict")
    break
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMED OUT"; status=1
  elif [ -z "$summary" ]; then
    verdict="FAILED (no summary line)"; status=1
  elif echo "$summary" | grep -qE 'SUMMARY: [1-9]|\([1-9][0-9]* errors|, [1-9][0-9]* warnings'; then
    verdict="ERRORS"; status=1
  elif [ "$rc" -ne 0 ] || ! echo "$cases" | grep -q ' 0 failed' \
       || { [ -n "$pyt" ] && [ "$pyt" != "pytest exit 0" ]; }; then
    verdict="FAILED (exit $rc)"; status=1
  fi
  results+=("sanitize $tool: ${summary:-no summary}; ${cases#sanitize_cases: }${pyt:+; $pyt (${counts%% in *})}; exit $rc, ${secs} s: $verdict$crashed")
done

echo
for line in "${results[@]}"; do echo "$line"; done
case $status in
  0) echo "sanitize: ${#tools[@]} tools, no errors ($(( $(date +%s) - start )) s): OK" ;;
  2) echo "sanitize: compute-sanitizer cannot run here ($(( $(date +%s) - start )) s): UNSUPPORTED" ;;
  *) echo "sanitize: ${#tools[@]} tools ($(( $(date +%s) - start )) s): FAILED" ;;
esac
exit $status
