"""The layers section: a pool over an engine's per-layer arrays (`KVCacheBlockPool.from_layers`).

32 NHD arrays `[blocks, 16 tokens, 16 heads, 128]` in bf16 (64 KiB per layer block, 2 MiB per
host row), batches of 64 and 1,024 random blocks (16 and 64 with --quick): the manager's
`offload_indices` / `onboard_indices` + `sync_transfers()`, all layers in one custom call per
batch, against one contiguous copy of the same bytes (the step section's ceiling) and against a
jitted loop of one `copy_blocks` per layer into per-layer host arrays of the same layout.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..manager import KVCacheTransferManager
from ..ops import copy_blocks
from ..pool import KVCacheBlockPool
from .config import DTYPE
from .helpers import _err_text

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
            sec["error"] = _err_text(e)
            self.log(traceback.format_exc())
        self.save()

    def _layers(self, sec: dict[str, Any]) -> None:
        batches = (16, 64) if self.cfg.quick else (64, 1024)
        layers, tokens = (4, 4) if self.cfg.quick else (_LAYERS, _TOKENS)
        nb = max(batches)
        shape = (nb, tokens, _HEADS, _DIM)
        arrays = [jnp.asarray(self.rng.standard_normal(shape), DTYPE) for _ in range(layers)]
        pool = KVCacheBlockPool.from_layers(arrays, token_axis=1, num_secondary_blocks=nb)
        mgr = KVCacheTransferManager(pool)
        host_layers = [jax.device_put(np.zeros(shape, DTYPE), self.hsh) for _ in range(layers)]
        rows = {}
        for batch in batches:
            src, dst = self.rng.permutation(nb)[:batch], self.rng.permutation(nb)[:batch]
            total = batch * pool.block_nbytes
            rec: dict[str, Any] = {"blocks": batch, "row_bytes": pool.block_nbytes,
                                   "layers": layers, "ceiling": self._contiguous_ceiling(total)}
            calls = (("offload_indices", lambda s=src, d=dst: mgr.offload_indices(s, d)),
                     ("onboard_indices", lambda s=src, d=dst: mgr.onboard_indices(d, s)))
            for name, call in calls:
                t = self._timed(lambda c=call: (c(), mgr.sync_transfers()))
                rec[name] = {"s": t, "gbps": total / t / 1e9}
            si, di = np.int32(src), np.int32(dst)

            def loop(si=si, di=di) -> None:
                nonlocal host_layers
                host_layers = _per_layer_loop(host_layers, pool.primary, si, di)
                jax.block_until_ready(host_layers)
            t = self._timed(loop)
            rec["per_layer_loop_offload"] = {"s": t, "gbps": total / t / 1e9}
            for name in ("offload_indices", "onboard_indices", "per_layer_loop_offload"):
                ceiling = rec["ceiling"].get("h2d" if name.startswith("onboard") else "d2h")
                if ceiling:
                    rec[name]["ratio"] = rec[name]["gbps"] / ceiling
            rows[str(batch)] = rec
            self.log(f"  layers: {batch} x {layers} x {pool.block_nbytes // layers >> 10} KiB: "
                     f"offload {rec['offload_indices'].get('ratio', 0):.0%}, onboard "
                     f"{rec['onboard_indices'].get('ratio', 0):.0%} of contiguous; a copy_blocks "
                     f"per layer {rec['per_layer_loop_offload'].get('ratio', 0):.0%}")
        sec["batches"] = rows
