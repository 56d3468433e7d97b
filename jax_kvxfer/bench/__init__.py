"""Transfer benchmark: `python -m jax_kvxfer bench [options]` (or `python -m jax_kvxfer.bench`).

Times, in one run and against ceilings measured in that same run:

Sweep over block sizes (bf16 blocks of 16 KiB..4 MiB, `--blocks` blocks per batch, random
permutations as indices so no two neighbours are contiguous), three directions: `d2h` (offload,
device -> pinned_host), `h2d` (onboard, pinned_host -> device), `d2d` (device -> device):

  memcpy       ceiling: one contiguous cudaMemcpyAsync of the batch's total bytes (cupy; GPU time
               between events, queued behind a spin kernel so host enqueue cost is not counted).
  jax_contig   ceiling fallback / second reference: `jax.device_put` of the whole pool to the other
               memory kind (d2d: a jitted copy). Used as the ceiling when cupy is missing.
  ours         `copy_blocks` inside `jax.jit`, destination pool donated, K chained calls per jit
               call (K large enough that dispatch is amortised), n in {T, T-1, T/2, 1} tokens.
               Also timed from a profiler trace of three more calls (GPU only): by the GPU
               time of jax_kvxfer's kernels (`gpu_gbps`, `gpu_ratio`: the wall time less the
               gaps), and by the span from their first kernel's start to their last's end
               (`span_gbps`, `span_ratio`: the gaps and XLA's own work in between included,
               listed in `span_other_gpu_us`; the host's dispatch before and wake-up after not).
  ours_unique  `ours` with `unique_dst_indices=True` (the destinations are permutations), n in
               {T, T/2}: with traced indices the GPU skips its duplicate-destination scan.
  ours_dma     `ours` with `dma=True` (the copy engines), host directions, n in {T, T/2, 1}: the
               index vectors and token counts are jit arguments in pinned_host memory.
  manager      `KVCacheTransferManager.offload_blocks` / `onboard_blocks` of the whole batch, one
               dispatch per call (plans through its pinned-host ring); manager_dma: the same
               manager made with `dma=True`. Host directions, whole blocks.
  eager        `copy_blocks` outside jit with NumPy indices, donated, one call per batch, with
               the default `dma="auto"` (the copy engines from DMA_AUTO_MIN_BLOCK_BYTES);
               eager_kernel: the same with `dma=False`. Host directions, whole blocks.
  xla          XLA-native: d2h = jit gather of the rows with `out_shardings` pinned_host (a new
               array); h2d = jit, per block `dynamic_slice` of the host pool -> `device_put(Device)`
               -> `dynamic_update_slice` into the donated device pool (unrolled); d2d = jit gather +
               scatter (`dst.at[di, ..., :n, :].set(src[si, ..., :n, :])`), donated. Host
               directions whole blocks only.
  naive        one `jax.device_put` per block from a Python loop (whole blocks, host directions);
               the blocks are separate arrays (sliced beforehand), results are separate arrays.
  trt_gpu      TensorRT-LLM's approach, re-implemented (cupy): per block one cudaMemcpyAsync for
               whole blocks, or one launch of a scalar kernel (one element per thread, 32-bit flat
               index) for partial blocks. GPU time only (queued behind a spin kernel): the best the
               per-block approach can do, whatever language issues it.
  trt_loop     the same ops issued from a Python loop and timed as issued (host enqueue included;
               cupy's per-call cost is higher than TensorRT-LLM's C++ loop).

Bandwidth counts the bytes actually moved: n * row_bytes * outer per block (whole: block bytes).
Each ratio divides by the same-direction, same-size ceiling of this run (`memcpy` when cupy ran,
else `jax_contig`). Partial copies are compared with the whole-batch contiguous ceiling; device to
device they also get `same_bytes_ratio`, against a `memcpy` of just the bytes they move (records
with path `memcpy` and their n_label).

Other sections:
  host_overhead  time for a jitted, donated `copy_blocks` of 64 blocks (manager-like) to return
                 to Python without blocking; jit cache growth across calls (recompiles).
  overlap        offload ~2 GiB while a compute-bound jitted matmul chain runs: step alone,
                 transfer alone, both (one jit for the JAX paths; a side cupy stream for memcpy),
                 and the no-overlap sum. `ours_stream`: our custom call annotated to a GPU
                 stream of its own (JAX's `compute_on2(compute_type="gpu_stream:1")`).
                 `ours_dma_stream_step_writes_src`: the step also writes a token row of every
                 block of the pool being offloaded, in place, as a decode step does.
  bidirectional  offload and onboard at the same time (one jit for the JAX paths, two streams for
                 memcpy) vs each direction alone. `ours_streams`: the offload and the onboard
                 annotated to two GPU streams of their own.
  sharded        pools sharded by KV heads over 1, 2 and all devices, the same shard per device:
                 aggregate manager offload/onboard bandwidth vs N x the one-device figure.
  step           the manager's offloads and onboards (512 MiB) beside a compute-bound jitted
                 step of 40 ms or more: the step's added time and the ratio to the serial bound;
                 then 1,024 x 64 KiB offload/onboard + sync against a contiguous copy, and the
                 return time of a 64-pair call (beside_step.py).
  stores         (only with --only stores) FileStore, the disk tier: put and get GB/s of 2 MiB
                 and 64 KiB rows, 1 and N threads, against a sequential write and read of the
                 same disk in the same run; restart time with 10^4 and 10^5 blocks; RedisStore
                 on a local Valkey server against the same client's raw pipelined SET / GET of
                 the same bytes (stores.py).
  layers         a pool over 32 per-layer NHD arrays (`KVCacheBlockPool.from_layers`, 64 KiB
                 per layer block, 2 MiB host rows): offload/onboard of 64 and 1,024 blocks
                 through the manager, one batch and four back to back, against a contiguous
                 copy, the manager over one pool per layer and a jitted loop of one
                 `copy_blocks` per layer (layers.py).

Results: JSON (written after every section, so a run that is cut short still leaves data) and a
PNG plot (when matplotlib imports) in `--out`; a ratio table on stdout; progress on stderr.
Every case is wrapped: a failing path records its error and the run goes on.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from .beside_step import BesideStepMixin
from .bidirectional import BidirectionalMixin
from .config import (
    SWEEP_PATHS,
    Config,
    Geometry,
    fmt_size,
    geometry_for,
    n_cases,
    parse_args,
    parse_size,
)
from .core import BenchCore
from .cupy_tools import CupyTools
from .helpers import CompileCounter, gpu_name
from .host_overhead import HostOverheadMixin
from .layers import LayersMixin
from .overlap import OverlapMixin
from .report import ReportMixin
from .sharded import ShardedMixin
from .stores import StoresMixin
from .sweep import SweepMixin

__all__ = [
    "SWEEP_PATHS",
    "Bench",
    "CompileCounter",
    "Config",
    "CupyTools",
    "Geometry",
    "fmt_size",
    "geometry_for",
    "main",
    "n_cases",
    "parse_args",
    "parse_size",
]


class Bench(SweepMixin, HostOverheadMixin, OverlapMixin, BidirectionalMixin, ShardedMixin,
            BesideStepMixin, LayersMixin, StoresMixin, ReportMixin, BenchCore):
    """The benchmark: `BenchCore`'s state plus one mixin per section and the report."""


def main(argv: list[str] | None = None, *, _cupy_module: Any = None) -> int:
    """Runs the benchmark (`python -m jax_kvxfer bench ARGS`); returns the exit status.

    _cupy_module: a stand-in for cupy, for tests only."""
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    bench = Bench(cfg, _cupy_module)
    try:
        return _run(bench)
    finally:
        bench.compiles.close()


def _run(bench: Bench) -> int:
    cfg = bench.cfg
    bench.log(f"jax {jax.__version__} on {gpu_name(bench.dev)} ({bench.backend}); "
              f"sizes {','.join(fmt_size(s) for s in cfg.sizes)}, {cfg.blocks} blocks, "
              f"{cfg.repeats} repeats; results -> {bench.json_path}")
    for note in bench.notes:
        bench.log("note: " + note)
    if bench.cupy is not None:
        need = [cfg.blocks * max(cfg.sizes)] if {"ceiling", "trtllm"} & cfg.only else []
        if "overlap" in cfg.only:
            need.append(cfg.overlap_bytes)
        if "bidir" in cfg.only:
            need.append(cfg.bidir_blocks * cfg.bidir_block)
        if "step" in cfg.only:
            need.append(cfg.step_overhead_blocks * 64 * 1024)
        if "layers" in cfg.only:
            need.append((64 if cfg.quick else 1024) * 2 * 1024 * 1024)
        bench.cupy.arena_hint = max(need, default=0)
    if "host" in cfg.only:
        bench.run_host_overhead()
    if "bidir" in cfg.only:
        bench.run_bidir()
    if "overlap" in cfg.only:
        bench.run_overlap()
    if "sharded" in cfg.only:
        bench.run_sharded()
    if "step" in cfg.only:
        bench.run_beside_step()
    if "layers" in cfg.only:
        bench.run_layers()
    if "stores" in cfg.only:
        bench.run_stores()
    if cfg.only & set(SWEEP_PATHS):
        bench.run_sweep()
    bench.save()
    png = bench.plot() if cfg.plot else None
    if cfg.plot and png is None:
        bench.notes.append("no PNG: matplotlib not importable")
        bench.save()
    if any(r.get("gbps") for r in bench.results):
        print(bench.table())
    s = bench.summary()
    if s:
        print(s)
    print(f"results: {bench.json_path}" + (f"\nplot: {png}" if png else ""))
    bench.log(f"done in {bench.elapsed():.1f} s")
    return 0
