"""Where a pinned host pool's resident memory goes: RSS after each step of making and using one.

    python3 scripts/rss_probe.py [GiB] [lanes|inline|noring]   # default: 8 lanes, on a GPU

GiB: the host pool's size. The engine: `lanes` (the manager's default on a GPU: the copy
engines beside compute), `inline` (dma=False: the copy kernel on XLA's stream), `noring`
(plan_ring=False, so no pinned_host plan arrays either). Run each in a fresh process: the host
allocator keeps what it once held.

Prints, after each step (the pool made, an offload, an onboard, several of both, the demo's
transfer warm-up, a read of the host pool, the pool deleted), this process's RSS and its peak,
and the host pool's buffer address (`moved` where a step handed the pool a new buffer) and
layout, so that a second host allocation of the pool's size shows as a jump, and whether the
pool now lives in it (a copy into the layout the transfers were compiled for would move it).
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from jax_kvxfer import KVCacheBlockPool, KVCacheTransferManager
from jax_kvxfer.demo.serving import _host_memory, _warm_up_transfers

T0 = time.perf_counter()


def buffer_address(array: jax.Array | None) -> int | None:
    if array is None or array.is_deleted():
        return None
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


LAST = [None]


def say(what: str, pool: KVCacheBlockPool | None = None) -> None:
    jax.effects_barrier()
    where = ""
    if pool is not None:
        address = buffer_address(pool.secondary)
        moved = LAST[0] is not None and address != LAST[0]
        layout = getattr(getattr(pool.secondary, "format", None), "layout", None)
        where = (f"  host pool at {address:#x}{' moved' if moved else ''}, "
                 f"{pool.secondary.sharding.memory_kind}, {layout}")
        LAST[0] = address
    print(f"{time.perf_counter() - T0:6.1f} s  {what:40s} {_host_memory()}{where}", flush=True)


ENGINES = {"lanes": {}, "inline": {"dma": False}, "noring": {"plan_ring": False, "dma": False}}


def main(gib: int, engine: str) -> None:
    print(f"rss_probe: {gib} GiB host pool, engine {engine} ({ENGINES[engine] or 'defaults'})")
    say("start")
    # 2 MiB blocks: 32 layers x K and V x 8 heads x 16 tokens x 128 x bf16
    pool = KVCacheBlockPool.create(num_layers=32, num_kv_heads=8, size_per_head=128,
                                   tokens_per_block=16, dtype="bfloat16",
                                   num_primary_blocks=1024, num_secondary_blocks=gib * 512)
    say(f"pool made ({gib} GiB host)", pool)
    # A small pinned_host array after the pool: should XLA's host allocator grow by regions
    # of its largest request so far (a BFC allocator's growth), this alone adds a pool's size.
    small = jax.device_put(np.zeros(1 << 20, np.uint8), jax.sharding.SingleDeviceSharding(
        pool.device, memory_kind="pinned_host"))
    say("a 1 MiB pinned_host array", pool)
    tm = KVCacheTransferManager([pool], **ENGINES[engine])
    rng = np.random.default_rng(0)
    src = rng.choice(1024, 256, replace=False).astype(np.int32)
    dst = rng.choice(gib * 512, 256, replace=False).astype(np.int32)
    tm.offload_indices(src, dst)
    tm.sync_transfers()
    say("offload 256 + sync", pool)
    tm.onboard_indices(dst, src)
    tm.sync_transfers()
    say("onboard 256 + sync", pool)
    for _ in range(5):
        tm.offload_indices(src, dst)
        tm.onboard_indices(dst[::-1].copy(), src)
        tm.sync_transfers()
    say("5 x both + sync", pool)
    _warm_up_transfers(tm, pool, 1024)
    say("the demo's transfer warm-up", pool)
    np.asarray(pool.secondary[:1])
    say("one host block read", pool)
    small.delete()
    pool.secondary.delete()
    pool.primary.delete()
    say("pool deleted")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] not in ENGINES:
        sys.exit(f"rss_probe: the engine must be one of {', '.join(ENGINES)}, got {sys.argv[2]!r}")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, sys.argv[2] if len(sys.argv) > 2 else "lanes")
