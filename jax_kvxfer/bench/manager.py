"""The manager section: the transfer manager's verbs at real models' block geometries.

Per geometry (GEOMETRIES: Llama-3.1-8B's blocks of 16 tokens, 32 layers x K/V x 8 heads x 128
in bf16 = 2 MiB, 256 a batch; one layer of it, 64 KiB, 1,024 a batch), a pool of as many primary
and secondary blocks and random slots:
  offload_blocks / onboard_blocks (block pairs) and offload_indices / onboard_indices (slot
  arrays), each then `sync_transfers()`: GB/s and % of one contiguous copy of the same bytes
  (same run); `returns_s`, when the call returned to Python;
  call_64_us: how long a 64-pair `offload_blocks` takes to return (a sync after each, untimed),
  over batches of 50 to 64 random pairs; `compiles`: XLA compilations while it was timed (0:
  no recompiles).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import KVCacheBlock, KVCacheBlockPool, KVCacheTransferManager
from .config import DTYPE, fmt_size
from .helpers import COMPILES, median

GEOMETRY = {"num_kv_heads": 8, "size_per_head": 128, "tokens_per_block": 16}
GEOMETRIES = (("Llama-3.1-8B", 32, 256), ("one layer of it", 1, 1024))  # name, layers, blocks


def pairs(src: Any, dst: Any, from_primary: bool) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
    return [(KVCacheBlock(i, int(s), from_primary), KVCacheBlock(i, int(d), not from_primary))
            for i, (s, d) in enumerate(zip(src, dst))]


class ManagerMixin:
    def run_manager(self, sec: dict[str, Any]) -> None:
        for name, layers, nb in GEOMETRIES:
            if self.cfg.quick:
                name, layers, nb = (name, layers, 64) if layers < 2 else (
                    f"{name} with 2 layers (--quick)", 2, 64)
            pool = KVCacheBlockPool.create(num_layers=layers, **GEOMETRY, dtype=DTYPE,
                                           num_primary_blocks=nb, num_secondary_blocks=nb,
                                           device=self.dev)
            rec = sec[f"{nb} x {fmt_size(pool.block_nbytes)}"] = {
                "model": name, "layers": layers, "blocks": nb, "block_bytes": pool.block_nbytes}
            if self.past_deadline():
                rec["skipped"] = "past the deadline"
                continue
            self._manager_case(pool, rec)
            self.save()

    def _manager_case(self, pool: KVCacheBlockPool, rec: dict[str, Any]) -> None:
        nb = pool.num_primary_blocks
        pool.primary = self.random_pool(pool.primary.shape, pool.sharding("device"))
        pool.secondary = self.random_pool(pool.secondary.shape, pool.sharding("pinned_host"))
        mgr = KVCacheTransferManager([pool])
        total = nb * pool.block_nbytes
        ceil = rec["ceiling"] = self.ceiling(total)
        a, b = self.perms(1, nb)[0], self.perms(1, nb)[0]
        ends = [0, nb - 1]
        onboards, offloads = pairs(b, a, False), pairs(a, b, True)  # made before the timing
        # onboard first: the host pool holds other data than the device pool's blocks
        for verb, call in (("onboard_blocks", lambda: mgr.onboard_blocks(onboards)),
                           ("onboard_indices", lambda: mgr.onboard_indices(b, a)),
                           ("offload_blocks", lambda: mgr.offload_blocks(offloads)),
                           ("offload_indices", lambda: mgr.offload_indices(a, b))):
            returns: list[float] = []

            def run(call: Any = call, returns: list[float] = returns) -> None:
                t = time.perf_counter()
                call()
                returns.append(time.perf_counter() - t)
                mgr.sync_transfers()

            gbps = total / self.timed(run) / 1e9
            on = verb.startswith("on")
            dst, src = (pool.primary, pool.secondary) if on else (pool.secondary, pool.primary)
            ok = np.array_equal(self.fetch(dst, (a if on else b)[ends]),
                                self.fetch(src, (b if on else a)[ends]))
            rec[verb] = {"gbps": gbps, "ratio": gbps / ceil["h2d" if on else "d2h"],
                         "returns_s": median(returns[-self.cfg.repeats:]), "verified": bool(ok)}
        # a 64-pair call's host time, over batches of 50..64 random pairs (several sizes)
        batches = [pairs(*self.perms(2, 48 + 2 * i if i % 2 else 64, nb), True) for i in range(8)]
        for i in range(2 * len(batches)):  # warm-up: every batch twice
            mgr.offload_blocks(batches[i % len(batches)])
        mgr.sync_transfers()
        compiles, times = COMPILES[0], []
        for i in range(48):
            t = time.perf_counter()
            mgr.offload_blocks(batches[i % len(batches)])
            times.append(time.perf_counter() - t)
            mgr.sync_transfers()  # the next call finds no copy queued
        rec["call_64_us"], rec["compiles"] = 1e6 * median(times), COMPILES[0] - compiles
        self.log("manager " + manager_line(rec))


def manager_line(r: dict[str, Any]) -> str:
    verbs = [v for v in ("offload_blocks", "onboard_blocks", "offload_indices", "onboard_indices")
             if v in r]
    return (f"{r['blocks']} x {fmt_size(r['block_bytes'])} ({r['model']}), + sync, % of a "
            f"contiguous copy ({r['ceiling']['d2h']:.1f} / {r['ceiling']['h2d']:.1f} GB/s): "
            + ", ".join(f"{v} {r[v]['gbps']:.1f} GB/s {r[v]['ratio']:.0%}"
                        + ("" if r[v]["verified"] else " VERIFY FAILED") for v in verbs)
            + "; returns after " + " / ".join(f"{r[v]['returns_s'] * 1e3:.2f}" for v in verbs)
            + f" ms; a 64-pair offload_blocks returns in {r['call_64_us']:.0f} us, "
            f"{r['compiles']} compiles")


def manager_summary(sec: dict[str, Any]) -> list[str]:
    return [f"manager {r.get('skipped') or manager_line(r)}" for r in sec.values()
            if isinstance(r, dict) and ("skipped" in r or "call_64_us" in r)]
