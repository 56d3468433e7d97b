#!/usr/bin/env bash
# A/B of two versions of the CUDA handlers on the GPU machine, in one session: builds the
# working tree's handlers ("new") and another version of them ("old"), alternately, and runs the
# same bench on each build, so that both versions see the same machine, clocks and neighbours.
#   scripts/ab-kernel.sh OLD [ROUNDS] [BENCH ARGS...]
# OLD: a version of ffi/block_copy_cuda.cu, or a folder holding versions of any files of ffi/
# (e.g. block_copy_cuda.cu and copy_units.cuh: `git show REV:ffi/F > old/F`); only those swap.
# (default: 2 rounds of `bench --only ours,ceiling --sizes 64K,256K,1M,4M --repeats 5`).
# Logs: $OUT/ab-{new,old}{1,2,..}.log (the bench's JSON and plots stay in a scratch folder, so
# few files come back; the summary reads the JSON there); the working tree's files are restored
# at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvxfer-ab}
old=${1:?usage: scripts/ab-kernel.sh OLD.cu|OLD_DIR [ROUNDS] [BENCH ARGS...]}
rounds=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--only ours,ceiling --sizes 64K,256K,1M,4M --repeats 5)
mkdir -p "$OUT"
scratch=$(mktemp -d)
mkdir -p "$scratch/old" "$scratch/new"
if [ -d "$old" ]; then cp "$old"/* "$scratch/old/"; else cp "$old" "$scratch/old/block_copy_cuda.cu"; fi
for f in "$scratch"/old/*; do cp "ffi/$(basename "$f")" "$scratch/new/"; done
trap 'cp "$scratch"/new/* ffi/' EXIT

build() {  # $1: the folder whose files go into ffi/
  cp "$1"/* ffi/
  python3 -m pip install --no-build-isolation --no-deps -C cmake.define.KVXFER_CUDA=ON -e . \
    >> "$scratch/build.log" 2>&1 || { echo "build of $1 failed"; tail -30 "$scratch/build.log"; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  for v in new old; do
    build "$scratch/$v"
    python3 -m jax_kvxfer bench "${args[@]}" --out "$scratch/$v$r" > /dev/null 2> "$OUT/ab-$v$r.log"
    echo "ab $v$r: exit $?"
  done
done
# One line per case (every ours* path) and version: the percent of the ceiling in each round,
# through the wall clock and (in brackets) in the kernels' GPU time, read from the bench's JSON.
python3 - "$rounds" "$scratch" <<'PY'
import glob, json, sys
from collections import defaultdict
rounds, scratch = int(sys.argv[1]), sys.argv[2]
rows = defaultdict(lambda: defaultdict(list))
for v in ("new", "old"):
    for r in range(1, rounds + 1):
        for path in glob.glob(f"{scratch}/{v}{r}/*.json"):
            for rec in json.load(open(path))["results"]:
                if not rec.get("path", "").startswith("ours") or not rec.get("ratio"):
                    continue
                case = (f"{rec['direction']} {rec['block_bytes'] >> 10}K {rec['path']} "
                        f"n={rec['n_label']}")
                gpu = f" ({rec['gpu_ratio']:.1%})" if rec.get("gpu_ratio") else ""
                rows[case][v].append(f"{rec['ratio']:.1%}{gpu}")
for case, by in rows.items():
    print(f"AB {case:28s} new {' / '.join(by['new'])}  old {' / '.join(by['old'])}")
PY
