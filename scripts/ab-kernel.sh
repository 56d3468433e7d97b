#!/usr/bin/env bash
# A/B of versions of the CUDA handlers on the GPU machine, in one session: builds the working
# tree's handlers ("new") and other versions of them, in turn, and runs the same bench on each
# build, so that all versions see the same machine, clocks and neighbours.
#   scripts/ab-kernel.sh OLD[,OLD2...] [ROUNDS] [BENCH ARGS...]
# OLD: a version of ffi/block_copy_cuda.cu (named "old"), or a folder holding versions of any
# files of ffi/ (named after the folder; e.g. block_copy_cuda.cu and copy_units.cuh:
# `git show REV:ffi/F > v11/F`); only those files swap. Several, comma-separated, run in turn.
# (default: 2 rounds of `bench --only ours,ceiling --sizes 64K,256K,1M,4M --repeats 5`).
# BENCH ARGS may hold several benches separated by `--and`, run in turn on each build, e.g.
# `--only ours,ceiling --sizes 16K --blocks 4096 --and --only ours,ceiling --sizes 4M`.
# Logs: $OUT/ab-{new,NAME}{1,2,..}.log (the bench's JSON and plots stay in a scratch folder, so
# few files come back; the summary reads the JSON there, and goes to stdout and to
# $OUT/ab-summary.txt); the working tree's files are restored at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvxfer-ab}
olds=${1:?usage: scripts/ab-kernel.sh OLD.cu|OLD_DIR[,OLD_DIR2...] [ROUNDS] [BENCH ARGS...]}
rounds=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--only ours,ceiling --sizes 64K,256K,1M,4M --repeats 5)
mkdir -p "$OUT"
scratch=$(mktemp -d)
mkdir -p "$scratch/new"
versions=(new)
IFS=, read -ra old_list <<< "$olds"
for old in "${old_list[@]}"; do
  if [ -d "$old" ]; then v=$(basename "$old"); mkdir -p "$scratch/$v"; cp "$old"/* "$scratch/$v/"
  else v=old; mkdir -p "$scratch/$v"; cp "$old" "$scratch/$v/block_copy_cuda.cu"; fi
  [ "$v" = new ] && { echo "a version may not be named new"; exit 2; }
  versions+=("$v")
  for f in "$scratch/$v"/*; do cp "ffi/$(basename "$f")" "$scratch/new/"; done
done
trap 'cp "$scratch"/new/* ffi/' EXIT

build() {  # $1: the folder whose files go into ffi/ (over the working tree's)
  cp "$scratch"/new/* ffi/; cp "$1"/* ffi/
  python3 -m pip install --no-build-isolation --no-deps -C cmake.define.KVXFER_CUDA=ON -e . \
    >> "$scratch/build.log" 2>&1 || { echo "build of $1 failed"; tail -30 "$scratch/build.log"; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  for v in "${versions[@]}"; do
    build "$scratch/$v"
    bench=()
    for a in "${args[@]}" --and; do
      if [ "$a" != --and ]; then bench+=("$a"); continue; fi
      python3 -m jax_kvxfer bench "${bench[@]}" --no-plot --out "$scratch/$v$r" > /dev/null \
        2>> "$OUT/ab-$v$r.log"
      echo "ab $v$r (${bench[*]}): exit $?"
      bench=()
    done
  done
done
# One line per case (every ours* path) and version: the percent of the ceiling in each round,
# through the wall clock and (in brackets) in the kernels' GPU time, read from the bench's JSON.
python3 - "$rounds" "$scratch" "${versions[@]}" <<'PY' | tee "$OUT/ab-summary.txt"
import glob, json, sys
from collections import defaultdict
rounds, scratch, versions = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = defaultdict(lambda: defaultdict(list))
for v in versions:
    for r in range(1, rounds + 1):
        for path in glob.glob(f"{scratch}/{v}{r}/*.json"):
            for rec in json.load(open(path))["results"]:
                if not rec.get("path", "").startswith("ours") or not rec.get("ratio"):
                    continue
                case = (f"{rec['direction']} {rec['blocks']}x{rec['block_bytes'] >> 10}K "
                        f"{rec['path']} n={rec['n_label']}")
                gpu = f" ({rec['gpu_ratio']:.1%})" if rec.get("gpu_ratio") else ""
                rows[case][v].append(f"{rec['ratio']:.1%}{gpu}")
for case, by in rows.items():
    print(f"AB {case:34s} " + "  ".join(f"{v} {' / '.join(by[v])}" for v in versions))
PY
