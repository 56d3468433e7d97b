"""The layers section: a pool over an engine's per-layer arrays (`KVCacheBlockPool.from_layers`).

32 NHD arrays `[blocks, 16 tokens, 16 heads, 128]` in bf16 (64 KiB per layer block, 2 MiB per
host row), batches of 64 and 1,024 random blocks (16 and 64 with --quick), through the manager's
`offload_indices` / `onboard_indices` (all layers in one custom call per batch):
  - one batch, then `sync_transfers()`; `returns_s`: when the call returned to Python;
  - four batches back to back, then one sync (per batch): a serving loop's steady state;
against one contiguous copy of the same bytes (same run), and two ways without contiguous host
rows: the manager over one pool per layer, and a jitted loop of one `copy_blocks` per layer
into per-layer host arrays (offload).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np

from .. import KVCacheBlockPool, KVCacheTransferManager, copy_blocks
from .config import DTYPE
from .helpers import median


@functools.partial(jax.jit, donate_argnums=0)
def _per_layer_loop(dsts, srcs, src_idx, dst_idx):
    return [copy_blocks(d, s, src_idx, dst_idx, token_axis=1, unique_dst_indices=True)
            for d, s in zip(dsts, srcs)]


class LayersMixin:
    def run_layers(self, sec: dict[str, Any]) -> None:
        batches, layers, tokens = ((16, 64), 4, 4) if self.cfg.quick else ((64, 1024), 32, 16)
        nb = max(batches)
        shape = (nb, tokens, 16, 128)
        arrays = lambda: [self.random_pool(shape, self.dsh) for _ in range(layers)]
        pool = KVCacheBlockPool.from_layers(arrays(), token_axis=1, num_secondary_blocks=nb)
        mgr = KVCacheTransferManager(pool)
        per_layer = KVCacheTransferManager([KVCacheBlockPool.from_layers(
            [a], token_axis=1, num_secondary_blocks=nb) for a in arrays()])
        host = [jax.device_put(np.zeros(shape, DTYPE), self.hsh) for _ in range(layers)]
        sec.update({"layers": layers, "row_bytes": pool.block_nbytes, "batches": {}})
        for batch in batches:
            src, dst = self.rng.permutation(nb)[:batch], self.rng.permutation(nb)[:batch]
            total = batch * pool.block_nbytes
            ceil = self.ceiling(total)
            rec = sec["batches"][str(batch)] = {"ceiling": ceil}
            for verb, args in (("offload_indices", (src, dst)), ("onboard_indices", (dst, src))):
                def one(m: Any = mgr, verb: str = verb, args: Any = args) -> float:
                    t = time.perf_counter()  # seconds until the call returns
                    getattr(m, verb)(*args)
                    return time.perf_counter() - t

                returns: list[float] = []
                rec[verb] = {"s": self.timed(lambda r=returns: (r.append(one()),
                                                                mgr.sync_transfers()))}
                rec[verb]["returns_s"] = median(returns[-self.cfg.repeats:])
                rec[verb + "_back_to_back"] = {"s": self.timed(
                    lambda: ([one() for _ in range(4)], mgr.sync_transfers())) / 4}
                rec[verb + "_pool_per_layer"] = {"s": self.timed(
                    lambda: (one(per_layer), per_layer.sync_transfers()))}

            si, di = src.astype(np.int32), dst.astype(np.int32)

            def loop(si: Any = si, di: Any = di) -> None:
                nonlocal host
                host = _per_layer_loop(host, pool.primary, si, di)
                jax.block_until_ready(host)

            rec["copy_blocks_per_layer_offload"] = {"s": self.timed(loop)}
            for name, r in rec.items():
                if "s" in r:
                    r["gbps"] = total / r["s"] / 1e9
                    r["ratio"] = r["gbps"] / ceil["h2d" if name.startswith("on") else "d2h"]
            self.log("layers: " + layers_line(batch, rec, layers, pool.block_nbytes))
            self.save()


def layers_line(batch: int, rec: dict[str, Any], layers: int, row_bytes: int) -> str:
    r = {k: f"{v['ratio']:.0%}" for k, v in rec.items() if "ratio" in v}
    off, on = rec["offload_indices"], rec["onboard_indices"]
    return (f"{batch} x {layers} x {row_bytes // layers >> 10} KiB, offload / onboard, % of a "
            f"contiguous copy: one batch {r['offload_indices']} / {r['onboard_indices']} "
            f"(returns after {off['returns_s'] * 1e3:.2f} / {on['returns_s'] * 1e3:.2f} ms), "
            f"back to back {r['offload_indices_back_to_back']} / "
            f"{r['onboard_indices_back_to_back']}; a pool per layer "
            f"{r['offload_indices_pool_per_layer']} / {r['onboard_indices_pool_per_layer']}; "
            f"a copy_blocks per layer {r['copy_blocks_per_layer_offload']}")


def layers_summary(sec: dict[str, Any]) -> list[str]:
    return [f"layers: {layers_line(int(b), rec, sec['layers'], sec['row_bytes'])}"
            for b, rec in sec.get("batches", {}).items()
            if "copy_blocks_per_layer_offload" in rec]
