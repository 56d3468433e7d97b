#!/usr/bin/env bash
# One call on the GPU machine: build without network, run the whole test suite on the GPU,
# run the benchmark and the demo, and print a short summary last. Logs go to $OUT.
#   scripts/gpu-check.sh [tests] [bench] [concurrency] [probe] [demo] [demo-dma] [sharded]
#                        [demo-tp] [profile] [sanitize] [stress] [stress-dma] [partial-probe]
#                        [floor-probe] [pipeline] [trace] [large]
#   (default: tests bench demo). concurrency: the bench's overlap and bidirectional sections
#   only. large: the sweep's ours / ours_unique for batches of 4,096 blocks of 16 and 64 KiB.
#   probe: benchmarks/kernel_probe.cu (launch shapes of the copy kernel, no JAX);
#   partial-probe: benchmarks/partial_probe.cu (ways to copy partial blocks, no JAX);
#   floor-probe: benchmarks/floor_probe.cu (how fast any copy of a small d2d batch can be, no JAX);
#   pipeline: scripts/pipeline_probe.py (wall clock vs calls in flight, gaps between executions;
#   its options in $PIPELINE_ARGS).
#   profile: scripts/profile_manager.py (the manager's host time); trace: the same with --trace
#   (the verb's host events under the profiler). sharded: the bench's
#   sharded-pool section over all GPUs; demo-tp: the demo tensor-parallel over 2 GPUs (both need
#   a machine with 2 or more GPUs). stress-dma: 30,000 stress operations with a dma=True manager.
#   demo-dma: the demo again with every transfer on the copy engines, then on the copy kernel.
#   GPU_CHECK_PACK=1 packs everything under $OUT into $OUT/gpu-check.tgz at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvxfer-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests bench demo)
summary=()
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }

t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
# The build folder outlives a call on a warm machine, and the tree's files may reach it older
# than the objects a previous call (scripts/ab-kernel.sh) built from other versions of them:
# touch the native sources so that this build compiles what the tree holds.
touch ffi/*
if python3 -m pip install --no-build-isolation --no-deps -C cmake.define.KVXFER_CUDA=ON -e . > "$OUT/build.log" 2>&1 \
   && python3 -c "import jax_kvxfer as k; assert k.HAS_CUDA_HANDLERS" >> "$OUT/build.log" 2>&1; then
  summary+=("build: ok ($(( $(date +%s) - t0 )) s)")
else
  tail -40 "$OUT/build.log"; echo "SUMMARY build: FAILED"; exit 1
fi

if has tests; then
  t=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
  summary+=("tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - t )) s)")
  grep -E "FAILED|ERROR" "$OUT/tests.log" | head -20
fi
if has bench; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --out "$OUT" > "$OUT/bench.txt" 2> "$OUT/bench.log"
  summary+=("bench: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/bench.txt"
fi
if has large; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only ceiling,ours,unique --sizes 16K,64K --blocks 4096 --no-plot \
    --out "$OUT/large" > "$OUT/bench-large.txt" 2> "$OUT/bench-large.log"
  summary+=("bench 4096-block batches: exit $? ($(( $(date +%s) - t )) s)")
  grep -E "^d2d" "$OUT/bench-large.txt"
fi
if has concurrency; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only overlap,bidir --out "$OUT" > "$OUT/bench-concurrency.txt" 2> "$OUT/bench-concurrency.log"
  summary+=("bench overlap,bidir: exit $? ($(( $(date +%s) - t )) s)")
  grep -E "overlap |bidirectional " "$OUT/bench-concurrency.log"
fi
if has probe; then
  t=$(date +%s)
  nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/kernel_probe.cu -o "$OUT/kernel_probe.bin" > "$OUT/probe.txt" 2>&1 \
    && "$OUT/kernel_probe.bin" >> "$OUT/probe.txt" 2>&1
  summary+=("kernel probe: exit $? ($(( $(date +%s) - t )) s)")
  rm -f "$OUT/kernel_probe.bin"
fi
if has partial-probe; then
  t=$(date +%s)
  nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/partial_probe.cu -o "$OUT/partial_probe.bin" > "$OUT/partial-probe.txt" 2>&1 \
    && "$OUT/partial_probe.bin" >> "$OUT/partial-probe.txt" 2>&1
  summary+=("partial probe: exit $? ($(( $(date +%s) - t )) s)")
  rm -f "$OUT/partial_probe.bin"
fi
if has floor-probe; then
  t=$(date +%s)
  nvcc -O3 -std=c++17 -arch=sm_90 -DKVXFER_PROBE_LIBRARY -I ffi -I "$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
    benchmarks/floor_probe.cu -o "$OUT/floor_probe.bin" > "$OUT/floor-probe-build.log" 2>&1 \
    && "$OUT/floor_probe.bin" > "$OUT/floor-probe.txt" 2>&1
  summary+=("floor probe: exit $? ($(( $(date +%s) - t )) s)")
  rm -f "$OUT/floor_probe.bin"
fi
if has pipeline; then
  t=$(date +%s)
  python3 scripts/pipeline_probe.py ${PIPELINE_ARGS:-} > "$OUT/pipeline-probe.txt" 2> "$OUT/pipeline-probe.log"
  summary+=("pipeline probe: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/pipeline-probe.txt"
fi
# The demos share JAX's compilation cache (outside $OUT: it is large), so that only the first
# pays the model step's compilation (XLA's GPU autotuning: 75-130 s on the H200).
demo_cache=${JAX_COMPILATION_CACHE_DIR:-/tmp/kvxfer-jax-cache}
if has demo; then
  t=$(date +%s)
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 > "$OUT/demo.txt" 2> "$OUT/demo.log"
  summary+=("demo: exit $? ($(( $(date +%s) - t )) s)")
  tail -25 "$OUT/demo.txt"
fi
if has demo-dma; then  # the demo with every transfer on the copy engines, then on the kernel
  for dma in true false; do
    t=$(date +%s)
    JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --dma $dma \
      > "$OUT/demo-dma-$dma.txt" 2> "$OUT/demo-dma-$dma.log"
    summary+=("demo --dma $dma: exit $? ($(( $(date +%s) - t )) s): $(grep -E 'time in transfers' "$OUT/demo-dma-$dma.txt" | tr -s ' ')")
  done
fi
if has sharded; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only sharded --out "$OUT" > "$OUT/bench-sharded.txt" 2> "$OUT/bench-sharded.log"
  summary+=("bench sharded: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/bench-sharded.txt"
fi
if has demo-tp; then
  t=$(date +%s)
  python3 -m jax_kvxfer demo --preset h200 --devices 2 > "$OUT/demo-tp2.txt" 2> "$OUT/demo-tp2.log"
  summary+=("demo --devices 2: exit $? ($(( $(date +%s) - t )) s)")
  tail -25 "$OUT/demo-tp2.txt"
fi
if has profile; then
  t=$(date +%s)
  python3 scripts/profile_manager.py > "$OUT/profile.txt" 2>&1
  summary+=("profile: exit $? ($(( $(date +%s) - t )) s)")
  grep -E "us$|stages|correctly" "$OUT/profile.txt"
fi
if has trace; then
  t=$(date +%s)
  python3 scripts/profile_manager.py --trace > "$OUT/profile-trace.txt" 2>&1
  summary+=("profile --trace: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/profile-trace.txt"
fi
if has sanitize && [ -x scripts/sanitize.sh ]; then
  t=$(date +%s)
  bash scripts/sanitize.sh > "$OUT/sanitize.log" 2>&1
  summary+=("sanitize: exit $? ($(( $(date +%s) - t )) s): $(grep -h 'ERROR SUMMARY' "$OUT/sanitize.log" | sort | uniq -c | tr '\n' ' ')")
fi
if has stress && [ -f scripts/stress.py ]; then
  t=$(date +%s)
  python3 scripts/stress.py > "$OUT/stress.log" 2>&1
  summary+=("stress: exit $? ($(( $(date +%s) - t )) s): $(tail -1 "$OUT/stress.log")")
fi
if has stress-dma; then
  t=$(date +%s)
  python3 scripts/stress.py --dma --ops 30000 > "$OUT/stress-dma.log" 2>&1
  summary+=("stress --dma: exit $? ($(( $(date +%s) - t )) s): $(tail -1 "$OUT/stress-dma.log")")
fi

echo; cat "$OUT/gpu.txt"
for line in "${summary[@]}"; do echo "SUMMARY $line"; done
# GPU_CHECK_PACK=1: everything under $OUT in one archive (the device tool returns few files)
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  printf 'SUMMARY %s\n' "${summary[@]}" > "$OUT/summary.txt"
  pack=$(mktemp)
  tar czf "$pack" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$pack" "$OUT/gpu-check.tgz"
fi
