"""Where the manager's host time goes (issue 4, target 6): one 64-block transfer, step by step.

Times, per direction (64 blocks of 64 KiB, pools of 256 blocks, median of 200 calls, no
blocking inside the timed call): the manager's verb; the manager's jitted dispatch alone with the
[3, B] plan as NumPy, as a device array, and as a pinned_host array whose bytes are rewritten in
place before each call (no transfer); `jax.device_put` of the plan alone; then a cProfile of the
manager verb. Every variant's result is checked against NumPy at the end.

    python scripts/profile_manager.py [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx
from jax_kvxfer import manager as mgr
from jax_kvxfer.ops import IndexFacts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    host_kind = "pinned_host" if "pinned_host" in kinds else "device"
    print(f"jax {jax.__version__} on {dev.device_kind}; plan ring memory: {host_kind}")
    pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=4, size_per_head=64,
                                       tokens_per_block=32, dtype=jnp.bfloat16,
                                       num_primary_blocks=256, num_secondary_blocks=256)
    rng = np.random.default_rng(0)
    pool.primary = jax.device_put(rng.integers(0, 1 << 14, pool.primary.shape, np.uint16)
                                  .view(jnp.bfloat16), pool.sharding("device"))
    manager = kvx.KVCacheTransferManager([pool])
    batches = [(rng.permutation(256)[:64].astype(np.int32), rng.permutation(256)[:64]
                .astype(np.int32)) for _ in range(16)]
    facts = IndexFacts(hazard_free=True, unique_dst=True)
    ring_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
    ring = [jax.device_put(np.zeros((3, 64), np.int32), ring_sharding) for _ in range(32)]
    views = [np.frombuffer((ctypes.c_int32 * (3 * 64)).from_address(a.unsafe_buffer_pointer()),
                           np.int32).reshape(3, 64) for a in ring]

    def median_us(call, sync, calls=args.calls):
        for i in range(32):
            call(i)
        sync()
        ts = []
        for i in range(calls):
            t = time.perf_counter()
            call(i)
            ts.append(time.perf_counter() - t)
            if i % 8 == 7:
                sync()
        sync()
        return statistics.median(ts) * 1e6

    for verb, to_primary in (("offload", False), ("onboard", True)):
        def pairs(i, to_primary=to_primary):
            si, di = batches[i % 16]
            return [(kvx.KVCacheBlock(k, int(s), not to_primary),
                     kvx.KVCacheBlock(k, int(d), to_primary)) for k, (s, d) in
                    enumerate(zip(si, di))]
        pair_lists = [pairs(i) for i in range(16)]
        fn = getattr(manager, f"{verb}_blocks")
        plans = [np.stack([si, di, np.zeros_like(si)]) for si, di in batches]
        dev_plans = [jnp.asarray(p) for p in plans]

        def direct(plan):
            dst = pool.current(to_primary, "t")
            src = pool.current(not to_primary, "t")
            out = mgr._copy_across((dst,), (src,), plan, facts=facts, mesh=None, specs=(None,))
            if to_primary:
                pool._primary = out[0]
            else:
                pool._secondary = out[0]

        def ring_call(i):
            views[i % 32][...] = plans[i % 16]
            direct(ring[i % 32])

        results = {
            "manager verb": median_us(lambda i: fn(pair_lists[i % 16]), manager.sync_transfers),
            "dispatch, numpy plan": median_us(lambda i: direct(plans[i % 16]),
                                              manager.sync_transfers),
            "dispatch, device plan": median_us(lambda i: direct(dev_plans[i % 16]),
                                               manager.sync_transfers),
            f"dispatch, {host_kind} plan rewritten in place": median_us(
                ring_call, manager.sync_transfers, calls=min(args.calls, 32)),
            "device_put of the plan alone": median_us(
                lambda i: jax.device_put(plans[i % 16], dev), lambda: None),
        }
        for name, us in results.items():
            print(f"{verb:8} {name:44} {us:8.1f} us")
        # correctness of the in-place ring: one more call, checked against NumPy
        src_np = kvx.to_numpy(pool.current(not to_primary, "t"))
        dst_np = kvx.to_numpy(pool.current(to_primary, "t"))
        ring_call(5)
        expected = dst_np.copy()
        si, di = batches[5]
        expected[di] = src_np[si]
        got = kvx.to_numpy(pool.current(to_primary, "t"))
        print(f"{verb:8} in-place ring plan copies correctly: "
              f"{np.array_equal(got.view(np.uint16), expected.view(np.uint16))}")
        prof = cProfile.Profile()
        prof.enable()
        for i in range(64):
            fn(pair_lists[i % 16])
            if i % 8 == 7:
                manager.sync_transfers()
        prof.disable()
        manager.sync_transfers()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
        print("\n".join(out.getvalue().splitlines()[:22]))


if __name__ == "__main__":
    main()
