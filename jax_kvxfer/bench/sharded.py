"""The sharded section: the manager's offload / onboard of pools sharded by KV heads.

Over 1, 2 and all devices, every device holding the same shard (256 blocks of 1 MiB; 16 of 16
KiB with --quick), so N devices move N times the bytes of one: the aggregate GB/s through
`offload_blocks` / `onboard_blocks` + `sync_transfers()`, against N times the one-device figure
and against one contiguous copy of the same bytes on every device at once (same run: cupy's
memcpy on each GPU's own stream, else `jax.device_put` of one array sharded alike).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import KVCacheBlockPool, KVCacheTransferManager, to_numpy
from .config import DTYPE, fmt_size, geometry_for
from .helpers import err_text
from .manager import pairs


class ShardedMixin:
    def run_sharded(self, sec: dict[str, Any]) -> None:
        devices = jax.devices()
        g = geometry_for(16 * 1024 if self.cfg.quick else 1024 * 1024)
        nb = 16 if self.cfg.quick else 256
        sec.update({"block_bytes_per_device": g.block_bytes, "blocks": nb, "cases": []})
        self.log(f"== sharded: {nb} blocks of {fmt_size(g.block_bytes)} a device ==")
        for n in sorted({1, min(len(devices), 2), len(devices)}):
            if self.past_deadline():
                sec["cases"].append({"devices": n, "skipped": "past the deadline"})
                continue
            try:
                res = self._sharded_case(devices[:n], g, nb)
                one = sec["cases"][0] if sec["cases"] else res
                for d in ("offload", "onboard"):
                    res[f"{d}_scaling"] = res[f"{d}_gbps"] / (n * one[f"{d}_gbps"])
                sec["cases"].append(res)
                self.log(sharded_line(res))
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
                sec["cases"].append({"devices": n, "error": err_text(e)})
                self.log(f"sharded x{n}: ERROR {err_text(e)[:300]}")
            self.save()

    def _sharded_case(self, devices: list[Any], g: Any, nb: int) -> dict[str, Any]:
        n = len(devices)
        mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
        pool = KVCacheBlockPool.create(
            num_layers=g.layers, num_kv_heads=g.heads * n, size_per_head=g.head_dim,
            tokens_per_block=g.tokens, dtype=DTYPE, num_primary_blocks=nb,
            num_secondary_blocks=nb, kv_factor=g.kv, mesh=mesh, kv_head_axis="tp")
        pool.primary = self.random_pool(pool.primary.shape, pool.sharding("device"))
        bits = to_numpy(pool.primary).view(np.uint16)
        mgr = KVCacheTransferManager([pool])
        si, di = self.perms(1, nb)[0], self.perms(1, nb)[0]
        batch, calls = n * nb * g.block_bytes, 2 if self.cfg.quick else 8

        def timed(verb: Any, pairs: list[Any]) -> float:  # `calls` back to back, then a sync
            run = lambda: ([verb(pairs) for _ in range(calls)], mgr.sync_transfers())
            return calls * batch / self.timed(run) / 1e9

        res = {"devices": n, "bytes_per_batch": batch,
               "offload_gbps": timed(mgr.offload_blocks, pairs(si, di, True))}
        ok = np.array_equal(to_numpy(pool.secondary)[di].view(np.uint16), bits[si])
        pool.primary = jax.device_put(np.zeros_like(bits).view(DTYPE), pool.sharding("device"))
        res["onboard_gbps"] = timed(mgr.onboard_blocks, pairs(di, si, False))
        res["verified"] = bool(ok and np.array_equal(to_numpy(pool.primary)[si].view(np.uint16),
                                                     bits[si]))
        for d, to_host in (("offload", True), ("onboard", False)):
            if self.cupy is not None:
                ids = [getattr(x, "local_hardware_id", None) or 0 for x in devices]
                s = self.cupy.concurrent(ids, nb * g.block_bytes, to_host, self.cfg)
            else:
                x = jax.device_put(bits.view(DTYPE), pool.sharding("device" if to_host
                                                                   else "pinned_host"))
                target = pool.sharding("pinned_host" if to_host else "device")
                s = self.per_call(lambda x=x, t=target: jax.device_put(x, t), 2)
            res[f"ceiling_{d}_gbps"] = batch / s / 1e9
            res[f"{d}_ratio"] = res[f"{d}_gbps"] / res[f"ceiling_{d}_gbps"]
        return res


def sharded_line(r: dict[str, Any]) -> str:
    return (f"sharded x{r['devices']}: offload / onboard {r['offload_gbps']:.1f} / "
            f"{r['onboard_gbps']:.1f} GB/s aggregate = {r['offload_scaling']:.2f} / "
            f"{r['onboard_scaling']:.2f} of {r['devices']} x one device, {r['offload_ratio']:.0%}"
            f" / {r['onboard_ratio']:.0%} of a contiguous copy on each at once "
            f"({r['ceiling_offload_gbps']:.1f} / {r['ceiling_onboard_gbps']:.1f} GB/s), "
            f"verified={r['verified']}")


def sharded_summary(sec: dict[str, Any]) -> list[str]:
    return [sharded_line(r) if "offload_ratio" in r else
            f"sharded x{r['devices']}: {r.get('error') or r.get('skipped')}"
            for r in sec.get("cases", [])]
