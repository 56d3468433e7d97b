"""Where a pinned host pool's resident memory goes: RSS after each step of making and using one.

    python3 scripts/rss_probe.py [GiB]    # the host pool's size (default 8), on a GPU machine

Prints, after each step (the pool made, an offload, an onboard, several of both, the demo's
transfer warm-up, a read of the host pool, the pool deleted), this process's RSS and its peak,
so that a copy of the host pool (an update XLA did not do in place) shows as a jump of its size.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from jax_kvxfer import KVCacheBlockPool, KVCacheTransferManager
from jax_kvxfer.demo.serving import _host_memory, _warm_up_transfers

T0 = time.perf_counter()


def say(what: str) -> None:
    jax.effects_barrier()
    print(f"{time.perf_counter() - T0:6.1f} s  {what:40s} {_host_memory()}", flush=True)


def main(gib: int) -> None:
    say("start")
    # 2 MiB blocks: 32 layers x K and V x 8 heads x 16 tokens x 128 x bf16
    pool = KVCacheBlockPool.create(num_layers=32, num_kv_heads=8, size_per_head=128,
                                   tokens_per_block=16, dtype="bfloat16",
                                   num_primary_blocks=1024, num_secondary_blocks=gib * 512)
    say(f"pool made ({gib} GiB host)")
    tm = KVCacheTransferManager([pool])
    rng = np.random.default_rng(0)
    src = rng.choice(1024, 256, replace=False).astype(np.int32)
    dst = rng.choice(gib * 512, 256, replace=False).astype(np.int32)
    tm.offload_indices(src, dst)
    tm.sync_transfers()
    say("offload 256 + sync")
    tm.onboard_indices(dst, src)
    tm.sync_transfers()
    say("onboard 256 + sync")
    for _ in range(5):
        tm.offload_indices(src, dst)
        tm.onboard_indices(dst[::-1].copy(), src)
        tm.sync_transfers()
    say("5 x both + sync")
    _warm_up_transfers(tm, pool, 1024)
    say("the demo's transfer warm-up")
    np.asarray(pool.secondary[:1])
    say("one host block read")
    pool.secondary.delete()
    pool.primary.delete()
    say("pool deleted")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
