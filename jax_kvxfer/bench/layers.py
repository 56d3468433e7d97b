"""The layers section: a pool over an engine's per-layer arrays (`KVCacheBlockPool.from_layers`).

32 NHD arrays `[blocks, 16 tokens, 16 heads, 128]` in bf16 (64 KiB per layer block, 2 MiB per
host row), batches of 64 and 1,024 random blocks (16 and 64 with --quick), through the manager's
`offload_indices` / `onboard_indices` (all layers in one custom call per batch):
  - one batch, then `sync_transfers()`: what one batch costs, the call's host time included
    (`returns_s`: when the call returned to Python);
  - four batches back to back, then one sync (per batch): a serving loop's steady state, where
    a call's host time overlaps the copy before it;
against one contiguous copy of the same bytes (the step section's ceiling), and two ways without
contiguous host rows: the manager over one pool per layer (a copy per layer and block, 64 KiB
host blocks) and a jitted loop of one `copy_blocks` per layer into per-layer host arrays.
"""

from __future__ import annotations

import functools
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..manager import KVCacheTransferManager
from ..ops import copy_blocks
from ..pool import KVCacheBlockPool
from .config import DTYPE
from .helpers import err_text, median

_LAYERS, _TOKENS, _HEADS, _DIM = 32, 16, 16, 128  # 64 KiB per layer block in bf16


@functools.partial(jax.jit, donate_argnums=0)
def _per_layer_loop(dsts, srcs, src_idx, dst_idx):
    return [copy_blocks(d, s, src_idx, dst_idx, token_axis=1, unique_dst_indices=True)
            for d, s in zip(dsts, srcs)]


class LayersMixin:
    """`Bench`'s layers section (uses `BenchCore`'s and the step section's helpers)."""

    def run_layers(self) -> None:
        sec: dict[str, Any] = {}
        self.sections["layers"] = sec
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory"
            return
        try:
            self._layers(sec)
        except Exception as e:  # noqa: BLE001
            sec["error"] = err_text(e)
            self.log(traceback.format_exc())
        self.save()

    def _layers(self, sec: dict[str, Any]) -> None:
        batches = (16, 64) if self.cfg.quick else (64, 1024)
        layers, tokens = (4, 4) if self.cfg.quick else (_LAYERS, _TOKENS)
        nb = max(batches)
        shape = (nb, tokens, _HEADS, _DIM)

        def fresh_arrays() -> list[jax.Array]:
            return [jnp.asarray(self.rng.standard_normal(shape), DTYPE) for _ in range(layers)]

        pool = KVCacheBlockPool.from_layers(fresh_arrays(), token_axis=1, num_secondary_blocks=nb)
        mgr = KVCacheTransferManager(pool)
        per_layer_mgr = KVCacheTransferManager(
            [KVCacheBlockPool.from_layers([a], token_axis=1, num_secondary_blocks=nb)
             for a in fresh_arrays()])
        host_layers = [jax.device_put(np.zeros(shape, DTYPE), self.hsh) for _ in range(layers)]
        rows = {}
        for batch in batches:
            src, dst = self.rng.permutation(nb)[:batch], self.rng.permutation(nb)[:batch]
            total = batch * pool.block_nbytes
            rec: dict[str, Any] = {"blocks": batch, "row_bytes": pool.block_nbytes,
                                   "layers": layers, "ceiling": self._contiguous_ceiling(total)}
            for name, args in (("offload_indices", (src, dst)), ("onboard_indices", (dst, src))):
                def one(m=mgr, name=name, args=args) -> float:  # seconds until the call returns
                    t = time.perf_counter()
                    getattr(m, name)(*args)
                    return time.perf_counter() - t

                returns = []
                t = self._timed(lambda r=returns: (r.append(one()), mgr.sync_transfers()))
                rec[name] = {"s": t, "returns_s": median(returns[-self.cfg.repeats:])}
                t = self._timed(lambda: ([one() for _ in range(4)], mgr.sync_transfers())) / 4
                rec[name + "_back_to_back"] = {"s": t}
                t = self._timed(lambda: (one(per_layer_mgr), per_layer_mgr.sync_transfers()))
                rec[name + "_pool_per_layer"] = {"s": t}
            si, di = np.int32(src), np.int32(dst)

            def loop(si=si, di=di) -> None:
                nonlocal host_layers
                host_layers = _per_layer_loop(host_layers, pool.primary, si, di)
                jax.block_until_ready(host_layers)
            rec["copy_blocks_per_layer_offload"] = {"s": self._timed(loop)}
            for name, r in rec.items():
                if isinstance(r, dict) and "s" in r:
                    r["gbps"] = total / r["s"] / 1e9
                    ceiling = rec["ceiling"].get("h2d" if name.startswith("onboard") else "d2h")
                    if ceiling:
                        r["ratio"] = r["gbps"] / ceiling
            rows[str(batch)] = rec
            ratio = {k: f"{v.get('ratio', 0):.0%}" for k, v in rec.items()
                     if isinstance(v, dict) and "s" in v}
            self.log(f"  layers: {batch} x {layers} x {pool.block_nbytes // layers >> 10} KiB, "
                     f"offload / onboard of contiguous: one batch {ratio['offload_indices']} / "
                     f"{ratio['onboard_indices']} (returns after "
                     f"{rec['offload_indices']['returns_s'] * 1e3:.2f} / "
                     f"{rec['onboard_indices']['returns_s'] * 1e3:.2f} ms), back to back "
                     f"{ratio['offload_indices_back_to_back']} / "
                     f"{ratio['onboard_indices_back_to_back']}; a pool per layer "
                     f"{ratio['offload_indices_pool_per_layer']} / "
                     f"{ratio['onboard_indices_pool_per_layer']}; a copy_blocks per layer "
                     f"{ratio['copy_blocks_per_layer_offload']}")
        sec["batches"] = rows
