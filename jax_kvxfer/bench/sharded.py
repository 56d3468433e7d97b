"""The sharded section: aggregate offload/onboard bandwidth of pools sharded by KV heads.

Weak scaling: every device holds the same shard (the `--sizes`-independent per-device block of
`sharded_block` bytes, `sharded_blocks` blocks per batch), so N devices move N times the bytes of
one. Each GPU has its own PCIe link, so the aggregate should be about N times the one-device
figure measured in the same run. The transfers go through the manager (`offload_blocks` /
`onboard_blocks`, then `sync_transfers`), the product's API. With cupy, the ceiling is measured in
the same run: one contiguous memcpy of the same bytes on every GPU at once.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any

import jax
import numpy as np

from ..manager import KVCacheTransferManager
from ..pool import KVCacheBlock, KVCacheBlockPool, to_numpy
from .config import DTYPE, fmt_size, geometry_for
from .helpers import err_text, median


class ShardedMixin:
    """`Bench`'s sharded-pool section (uses `BenchCore`'s state and helpers)."""

    def run_sharded(self) -> None:
        cfg = self.cfg
        devices = jax.devices()
        counts = sorted({1, min(len(devices), 2), len(devices)})
        geom = geometry_for(cfg.sharded_block)
        B = cfg.sharded_blocks
        sec: dict[str, Any] = {"block_bytes_per_device": geom.block_bytes, "blocks": B,
                               "devices_available": len(devices), "cases": []}
        self.sections["sharded"] = sec
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory"
            return
        if len(devices) < 2:
            sec["note"] = "one device: the aggregate is the one-device figure"
        self.log(f"== sharded pools: {B} blocks of {fmt_size(geom.block_bytes)} per device, "
                 f"devices {counts} ==")
        single: dict[str, float] = {}
        for n in counts:
            if self.past_deadline():
                sec["cases"].append({"devices": n, "skipped": "past the deadline"})
                continue
            try:
                res = self._sharded_case(devices[:n], geom, B)
                for d in ("offload", "onboard"):
                    if n == 1:
                        single[d] = res[f"{d}_gbps"]
                    if single.get(d):
                        res[f"{d}_scaling"] = res[f"{d}_gbps"] / (n * single[d])
                sec["cases"].append(res)
                ceil = (f" (concurrent memcpy {res['memcpy_offload_gbps']:.1f} / "
                        f"{res['memcpy_onboard_gbps']:.1f})" if "memcpy_offload_gbps" in res
                        else "")
                self.log(f"sharded x{n}: offload {res['offload_gbps']:.1f} GB/s, onboard "
                         f"{res['onboard_gbps']:.1f} GB/s aggregate{ceil}"
                         + (f" = {res['offload_scaling']:.2f} / {res['onboard_scaling']:.2f} "
                            f"of {n} x one device" if n > 1 and single else "")
                         + ("" if res["verified"] else "  VERIFY FAILED"))
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
                sec["cases"].append({"devices": n, "error": err_text(e),
                                     "traceback": traceback.format_exc(limit=6)})
                self.log(f"sharded x{n}: ERROR {err_text(e)[:300]}")
            gc.collect()
            self.save()

    def _sharded_case(self, devices: list[Any], geom: Any, B: int) -> dict[str, Any]:
        n = len(devices)
        mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
        pool = KVCacheBlockPool.create(
            num_layers=geom.layers, num_kv_heads=geom.heads * n, size_per_head=geom.head_dim,
            tokens_per_block=geom.tokens, dtype=DTYPE, num_primary_blocks=B,
            num_secondary_blocks=B, kv_factor=geom.kv, mesh=mesh, kv_head_axis="tp")
        bits = self.rng.integers(0, 0x3FFF, pool.primary.shape, dtype=np.uint16)
        pool.primary = jax.device_put(bits.view(DTYPE), pool.sharding("device"))
        manager = KVCacheTransferManager([pool])
        si, di = self.perms(1, B, B)[0], self.perms(1, B, B)[0]
        offload = [(KVCacheBlock(0, int(s), True), KVCacheBlock(0, int(d), False))
                   for s, d in zip(si, di)]
        onboard = [(KVCacheBlock(0, int(d), False), KVCacheBlock(0, int(s), True))
                   for s, d in zip(si, di)]
        reps = max(1, self.cfg.sharded_calls)
        batch_bytes = n * B * geom.block_bytes

        def timed(verb: Any, pairs: list[Any]) -> float:
            verb(pairs)  # compile + warm-up
            manager.sync_transfers()
            times = []
            for _ in range(self.cfg.repeats):
                t = time.perf_counter()
                for _ in range(reps):
                    verb(pairs)
                manager.sync_transfers()
                times.append((time.perf_counter() - t) / reps)
            return median(times)

        t_off = timed(manager.offload_blocks, offload)
        verified = bool(np.array_equal(to_numpy(pool.secondary)[di].view(np.uint16), bits[si]))
        pool.primary = jax.device_put(np.zeros_like(bits).view(DTYPE), pool.sharding("device"))
        t_on = timed(manager.onboard_blocks, onboard)
        verified &= bool(np.array_equal(to_numpy(pool.primary)[si].view(np.uint16), bits[si]))
        res = {"devices": n, "bytes_per_batch": batch_bytes, "offload_s": t_off,
               "onboard_s": t_on, "offload_gbps": batch_bytes / t_off / 1e9,
               "onboard_gbps": batch_bytes / t_on / 1e9, "verified": verified}
        if self.cupy is not None:  # the same bytes as one contiguous memcpy per GPU, all at once
            ids = [i if getattr(d, "local_hardware_id", None) is None else d.local_hardware_id
                   for i, d in enumerate(devices)]
            per_device = B * geom.block_bytes
            for d, to_host in (("offload", True), ("onboard", False)):
                t = median(self.cupy.concurrent_memcpy(ids, per_device, to_host,
                                                        self.cfg.repeats))
                res[f"memcpy_{d}_gbps"] = batch_bytes / t / 1e9
                res[f"{d}_of_memcpy"] = res[f"{d}_gbps"] / res[f"memcpy_{d}_gbps"]
        return res
