"""Where the wall clock goes between back-to-back executions of a copy (issue 4, targets 1-3).

The bench's `ours` cases run at 91-95 % of the memcpy ceiling in the kernels' GPU time but
80-90 % through the wall clock. This probe times one jitted `copy_blocks` (256 whole blocks,
k chained copies per call, the destination donated) dispatched `pipe` times back to back, and
splits each sample into:
  - wall per copy (median of samples, one block_until_ready per sample);
  - host time to dispatch one call (median time for the call to return);
  - from a profiler trace of 8 calls: the kernels' own time, the span from the first kernel's
    start to the last one's end, and the idle gaps between consecutive copies, split into gaps
    inside one call and gaps between calls; and the GPU events other than ours in that span.

    python scripts/pipeline_probe.py [--sizes 256K,4M] [--directions d2h,h2d,d2d] [--host-events]

--host-events adds, from the same trace, the host's events (XLA's TraceMe scopes and the CUDA
API calls CUPTI records) per call by name: where the host's time per chained copy goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx
from jax_kvxfer.bench.config import geometry_for, parse_size
from jax_kvxfer.bench.core import gpu_stream_events, traced_profile

BLOCKS = 256


def traced(call, calls: int) -> tuple[list[tuple[int, int, str]], dict[str, list[int]]]:
    """The GPU stream events of `calls` calls (the results of all but the last are donated),
    and the host's events by name (metadata after '#' dropped): [count, total ns]."""
    profile = traced_profile(lambda: jax.block_until_ready([call() for _ in range(calls)][-1]))
    if profile is None:
        return [], {}
    host: dict[str, list[int]] = {}
    for plane in profile.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for e in line.events:
                    entry = host.setdefault(e.name.split("#")[0][:70], [0, 0])
                    entry[0] += 1
                    entry[1] += e.duration_ns
    return gpu_stream_events(profile), host


def probe(direction: str, size: int, k: int, rng: np.random.Generator,
          host_events: bool = False) -> None:
    geom = geometry_for(size)
    dev = jax.devices()[0]
    dsh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    hsh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    src_sh, dst_sh = {"d2h": (dsh, hsh), "h2d": (hsh, dsh), "d2d": (dsh, dsh)}[direction]
    shape = geom.pool_shape(BLOCKS)
    src = jax.device_put(jnp.asarray(rng.integers(0, 1 << 14, shape, np.uint16)), src_sh)
    dst = jax.device_put(jnp.zeros(shape, jnp.uint16), dst_sh)
    si = jnp.asarray(np.stack([rng.permutation(BLOCKS) for _ in range(k)]).astype(np.int32))
    di = jnp.asarray(np.stack([rng.permutation(BLOCKS) for _ in range(k)]).astype(np.int32))

    def chain(d, s, si, di):
        for j in range(k):
            d = kvx.copy_blocks(d, s, si[j], di[j])
        return d

    fn = jax.jit(chain, donate_argnums=0, out_shardings=dst_sh)
    st = {"dst": dst}
    host = []

    def call():
        t = time.perf_counter()
        st["dst"] = fn(st["dst"], src, si, di)
        host.append(time.perf_counter() - t)
        return st["dst"]

    jax.block_until_ready([call() for _ in range(4)][-1])
    nbytes = BLOCKS * geom.block_bytes
    cells = []
    for pipe in (1, 4, 16):
        samples = []
        for _ in range(7):
            t = time.perf_counter()
            jax.block_until_ready([call() for _ in range(pipe)][-1])
            samples.append((time.perf_counter() - t) / pipe / k)
        cells.append(f"pipe {pipe:2d}: {nbytes / statistics.median(samples) / 1e9:7.1f} GB/s")
    host_us = statistics.median(host[-64:]) * 1e6

    print(f"{direction} {size >> 10:5d}K k={k:2d}: " + ", ".join(cells)
          + f"; host dispatch {host_us:.0f} us/call")
    events, host_by_name = traced(call, 8)
    if host_events:
        print("    host events per call (count, us; nested scopes overlap):")
        for name, (count, ns) in sorted(host_by_name.items(), key=lambda x: -x[1][1])[:25]:
            print(f"      {count / 8:7.2f} x {ns / 8e3:9.1f} us  {name}")
    ours = [(a, b) for a, b, name in events if "kvxfer" in name]
    if not ours:
        print("    no kernels of ours in the trace")
        return
    busy = sum(b - a for a, b in ours)
    span = ours[-1][1] - ours[0][0]
    gaps = [ours[i + 1][0] - ours[i][1] for i in range(len(ours) - 1)]
    per_call = max(1, len(ours) // 8)  # kernels per call (scan + copy, k copies)
    inner = [g for i, g in enumerate(gaps) if (i + 1) % per_call]
    between = [g for i, g in enumerate(gaps) if not (i + 1) % per_call]
    others = {}
    for a, b, name in events:
        if "kvxfer" not in name and a >= ours[0][0] and b <= ours[-1][1]:
            others[name[:60]] = others.get(name[:60], 0) + (b - a)

    def med(xs):
        return f"{statistics.median(xs) / 1e3:.1f}" if xs else "-"

    print(f"    trace of 8 calls: kernels {nbytes * k * 8 / busy:.1f} GB/s busy, "
          f"{nbytes * k * 8 / span:.1f} GB/s over the span ({busy / span:.1%} busy); "
          f"{len(ours)} kernels; gaps inside a call median {med(inner)} us, between calls "
          f"median {med(between)} us, max {max(gaps) / 1e3 if gaps else 0:.1f} us")
    if others:
        print("    other GPU work in the span: " + "; ".join(
            f"{n} {t / 1e3:.1f} us" for n, t in sorted(others.items(), key=lambda x: -x[1])[:5]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256K,4M")
    ap.add_argument("--directions", default="d2h,h2d,d2d")
    ap.add_argument("--chains", default="1,4", help="copies per jitted call")
    ap.add_argument("--host-events", action="store_true",
                    help="the host's traced events per call, by name")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"# pipeline probe on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{BLOCKS} whole blocks per copy")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for d in args.directions.split(","):
            for k in (int(c) for c in args.chains.split(",")):
                probe(d, size, k, rng, args.host_events)


if __name__ == "__main__":
    main()
