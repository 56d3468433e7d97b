"""The host-overhead section: time for a 64-block transfer call to return, and recompiles."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import copy_blocks
from .config import DTYPE, fmt_size, geometry_for
from .helpers import block_on, cache_size, err_text, median, time_calls

HOST_ROUNDS = 4  # rounds in which the variants take turns (see _time_interleaved)
# No JAX and no GPU: the manager's batch check alone, timed with the other variants, so that
# runs on hosts of different speeds can be compared (the H200 machines differ by up to 2.5x).
HOST_SPEED_VARIANT = "host speed: check_batch alone"


def host_speed_reference(batches: list[Any], pool_blocks: int) -> Callable[[int], None]:
    """call(i): `check_batch` of batch i's pairs (a native pass and a little NumPy; before
    2026-11-30 it was pure Python and NumPy, so its figures do not compare across that date)."""
    from ..pool import KVCacheBlock
    from ..testing import check_batch
    pair_lists = [[(KVCacheBlock(k, int(s), True), KVCacheBlock(k, int(t), False))
                   for k, (s, t) in enumerate(zip(si, di)) if s >= 0] for si, di in batches]

    def call(i: int) -> None:
        check_batch(pair_lists[i % len(pair_lists)], None, pool_blocks, pool_blocks, 16)
    return call


@dataclasses.dataclass
class _Timed:
    """One variant of the section, warmed up: its record, call(i), sync(), jitted function
    (or None) and jit cache size after the warm-ups; the times and compiles of its rounds."""

    rec: dict[str, Any]
    call: Callable[[int], None]
    sync: Callable[[], None]
    fn: Any
    cache0: Any = None
    times: list[float] = dataclasses.field(default_factory=list)
    compiles: int = 0


class HostOverheadMixin:
    """`Bench`'s host-overhead section (uses `BenchCore`'s state and helpers)."""

    def run_host_overhead(self) -> None:
        """Time for a 64-block transfer call to return to Python (no blocking), and whether any
        call of the timed loop compiled. Variants: the transfer manager's `offload_blocks` /
        `onboard_blocks` (target 6's API), with the section's blocks and with blocks of
        `host_block_dma` bytes (which dma="auto" copies with the copy engines), a jitted donated
        `copy_blocks` with numpy or device indices, and `copy_blocks` called outside jit."""
        cfg = self.cfg
        geom = geometry_for(cfg.host_block)
        P, Bt = cfg.host_pool_blocks, cfg.host_batch
        sec: dict[str, Any] = {"block_bytes": geom.block_bytes, "pool_blocks": P, "batch": Bt,
                               "calls": cfg.host_calls, "cases": []}
        self.sections["host_overhead"] = sec
        self.log(f"== host overhead: {Bt} blocks of {fmt_size(geom.block_bytes)} ==")
        dirs = [("offload", "d2h"), ("onboard", "h2d")] if self.hsh is not None else []

        for name, d in dirs:
            src_sh, dst_sh = (self.dsh, self.hsh) if d == "d2h" else (self.hsh, self.dsh)
            batches = []
            for j in range(16):  # different indices each call; some padded with -1 (buckets)
                si, di = self.perms(1, Bt, P)[0], self.perms(1, Bt, P)[0]
                if j % 2:
                    real = Bt - 1 - int(self.rng.integers(0, Bt // 4 + 1))
                    si[real:] = -1
                    di[real:] = -1
                batches.append((si, di))
            # one jitted function per direction, as a manager would hold (numpy and device
            # indices have the same avals, so they share its cache entry)
            jit_fn = jax.jit(lambda dst, src, si, di: copy_blocks(dst, src, si, di),
                             donate_argnums=0, out_shardings=dst_sh)

            # the manager twice: with blocks that it copies with the kernel, and with blocks
            # large enough that dma="auto" takes the copy engines, whose handler enqueues one
            # copy per block on the host when the program runs
            big = geometry_for(cfg.host_block_dma)
            big_label = f"manager {name}_blocks {fmt_size(big.block_bytes)}"
            setups = []
            for variant in (f"manager {name}_blocks", big_label, "jit, numpy indices",
                            "jit, pinned_host indices", "jit, device indices",
                            "eager copy_blocks", HOST_SPEED_VARIANT):
                def setup(variant: str = variant, src_sh: Any = src_sh, dst_sh: Any = dst_sh,
                          jit_fn: Any = jit_fn, batches: list[Any] = batches, d: str = d,
                          g: Any = big if variant == big_label else geom
                          ) -> tuple[Callable[[int], None], Callable[[], None], Any]:
                    """(call(i), sync(), jitted fn or None) for one variant."""
                    if variant == HOST_SPEED_VARIANT:
                        return host_speed_reference(batches, P), lambda: None, None
                    if variant.startswith("manager"):
                        from ..manager import KVCacheTransferManager
                        from ..pool import KVCacheBlock, KVCacheBlockPool
                        kvpool = KVCacheBlockPool.create(
                            num_layers=g.layers, num_kv_heads=g.heads,
                            size_per_head=g.head_dim, tokens_per_block=g.tokens,
                            dtype=DTYPE, num_primary_blocks=P, num_secondary_blocks=P,
                            kv_factor=g.kv)
                        tm = KVCacheTransferManager([kvpool])
                        on_primary = d == "d2h"  # the source side
                        pair_lists = []
                        for si, di in batches:
                            n = int(np.sum(si >= 0))
                            pair_lists.append([
                                (KVCacheBlock(k, int(si[k]), on_primary),
                                 KVCacheBlock(k, int(di[k]), not on_primary)) for k in range(n)])
                        verb = tm.offload_blocks if d == "d2h" else tm.onboard_blocks

                        def call(i: int) -> None:
                            verb(pair_lists[i % len(pair_lists)])

                        return call, tm.sync_transfers, None

                    src_pool = self.random_pool(geom, P, src_sh)
                    st = {"dst": self.zero_pool(geom, P, dst_sh)}
                    if variant == "jit, pinned_host indices":
                        # the indices copied into pinned host memory in the timed call (a host
                        # memcpy) and read by the kernel through unified addressing
                        idx_sh = jax.sharding.SingleDeviceSharding(
                            self.dev, memory_kind="pinned_host")

                        def call(i: int) -> None:
                            si, di = batches[i % len(batches)]
                            si, di = jax.device_put((si, di), idx_sh)
                            st["dst"] = jit_fn(st["dst"], src_pool, si, di)
                        fn = jit_fn
                    elif variant.startswith("jit"):
                        idx = batches if "numpy" in variant else [
                            (jnp.asarray(a), jnp.asarray(b)) for a, b in batches]

                        def call(i: int) -> None:
                            st["dst"] = jit_fn(st["dst"], src_pool, *idx[i % len(idx)])
                        fn = jit_fn
                    else:
                        def call(i: int) -> None:
                            st["dst"] = copy_blocks(st["dst"], src_pool,
                                                    *batches[i % len(batches)])
                        fn = None
                    return call, lambda: block_on(st["dst"]), fn

                setups.append((variant, setup))

            self._time_interleaved(name, setups, len(batches), sec["cases"])
            self.save()

    def _time_interleaved(self, name: str, setups: list[tuple[str, Callable[[], Any]]],
                          n_batches: int, cases: list[dict[str, Any]]) -> None:
        """Times every variant in HOST_ROUNDS rounds that take turns (each round a share of
        `host_calls` calls per variant), so that a drift of the host's speed during the section
        reaches every variant alike: on the H200 machines the same manager verb, timed twice in
        one process a minute apart, took 142 then 236 us in one run and 310 then 179 us in
        another. Appends one record per variant."""
        timed: list[_Timed] = []
        for variant, setup in setups:
            rec: dict[str, Any] = {"direction": name, "variant": variant}
            cases.append(rec)
            if self.past_deadline():
                rec["skipped"] = "past the deadline"
                continue
            try:
                call, sync, fn = setup()
                for i in range(2 * n_batches):  # warm-up: every batch, twice
                    call(i)
                sync()
                timed.append(_Timed(rec, call, sync, fn))
            except Exception as e:  # noqa: BLE001
                self._host_error(rec, name, e)
        for t in timed:  # after every warm-up: the jit variants share one jitted function
            t.cache0 = cache_size(t.fn)
        per_round = -(-self.cfg.host_calls // HOST_ROUNDS)
        for _ in range(HOST_ROUNDS):
            for t in timed:
                if "error" in t.rec:
                    continue
                compiles0 = self.compiles.count
                try:
                    t.times += time_calls(t.call, t.sync, per_round)
                except Exception as e:  # noqa: BLE001
                    self._host_error(t.rec, name, e)
                t.compiles += self.compiles.count - compiles0
        for t in timed:
            if "error" in t.rec:
                continue
            cache1 = cache_size(t.fn)
            us = sorted(x * 1e6 for x in t.times)
            recompiled = (t.compiles > 0 if self.compiles.registered
                          else None if t.cache0 is None else cache1 != t.cache0)
            t.rec.update({
                "median_us": median(us), "p10_us": us[len(us) // 10],
                "p90_us": us[(9 * len(us)) // 10], "min_us": us[0], "calls": len(us),
                "rounds": HOST_ROUNDS,
                "compiles_during_timing": t.compiles if self.compiles.registered else None,
                "jit_cache_before": t.cache0, "jit_cache_after": cache1,
                "recompiled": recompiled})
            self.log(f"host overhead {name} [{t.rec['variant']}]: median "
                     f"{t.rec['median_us']:.1f} us, p90 {t.rec['p90_us']:.1f} us, "
                     f"recompiled={recompiled}")

    def _host_error(self, rec: dict[str, Any], name: str, e: BaseException) -> None:
        rec["error"] = err_text(e)
        rec["traceback"] = traceback.format_exc(limit=6)
        self.log(f"host overhead {name} [{rec['variant']}]: ERROR {rec['error'][:300]}")
