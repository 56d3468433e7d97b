"""The bidirectional section: offload and onboard at the same time vs each direction alone."""

from __future__ import annotations

import gc
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import copy_blocks_both_ways
from ..ops import copy_blocks
from ..testing import dma_batches
from .config import fmt_size, geometry_for
from .helpers import block_on, err_text, median, xla_onboard_rows


class BidirectionalMixin:
    """`Bench`'s bidirectional section (uses `BenchCore`'s state and helpers)."""

    def run_bidir(self) -> None:
        cfg = self.cfg
        sec: dict[str, Any] = {}
        self.sections["bidirectional"] = sec
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory"
            return
        geom = geometry_for(cfg.bidir_block)
        B = cfg.bidir_blocks
        total = B * geom.block_bytes
        sec.update({"block_bytes": geom.block_bytes, "blocks": B, "bytes_each_way": total,
                    "paths": {}})
        self.log(f"== bidirectional: {B} x {fmt_size(geom.block_bytes)} each way ==")
        try:
            dev_a = self.random_pool(geom, B, self.dsh)
            host_b = self.random_pool(geom, B, self.hsh)
            st = {"host_a": self.zero_pool(geom, B, self.hsh),
                  "dev_b": self.zero_pool(geom, B, self.dsh)}
            si1, di1 = (jnp.asarray(self.perms(1, B, B)[0]) for _ in range(2))
            si2, di2 = (jnp.asarray(self.perms(1, B, B)[0]) for _ in range(2))
            # the DMA variant reads its indices on the host: jit arguments in pinned_host
            pinned = jax.device_put((si1, di1, si2, di2), self.hsh)
            block_on(pinned)
            block_on([dev_a, host_b, st])
            pipe = self.pipe_for(total, False)

            def xla_onboard_body(dst, src, si, di):
                return xla_onboard_rows(dst, src, si, di, B)

            def copy(dst, s, i, j):
                return copy_blocks(dst, s, i, j)

            # ours_streams: the offload and the onboard each on a GPU stream of its own (with
            # the default grid cap, or another one)
            def copy_on(stream, max_ctas=None, dma=False):
                return lambda dst, s, i, j: copy_blocks(dst, s, i, j, stream=stream,
                                                        max_ctas=max_ctas, dma=dma)

            variants = {"ours": (copy, copy), "ours_streams": (copy_on(1), copy_on(2)),
                        "ours_streams_4ctas": (copy_on(1, 4), copy_on(2, 4)),
                        "ours_streams_32ctas": (copy_on(1, 32), copy_on(2, 32)),
                        "ours_dma_streams": (copy_on(1, dma=True), copy_on(2, dma=True))}
            xla_off = jax.jit(lambda s, i: s[i], out_shardings=self.hsh)
            xla_on = jax.jit(xla_onboard_body, donate_argnums=0, out_shardings=self.dsh)
            # Outputs in the order of the donated arguments: jax matches a donated buffer to
            # the first output of its shape and dtype, memory kind not considered (jax 0.10.2
            # CPU then aborts the process when that output is the pinned_host one).
            xla_both = jax.jit(lambda dv, sa, sb, i1, i2, j2: (xla_onboard_body(dv, sb, i2, j2),
                                                               sa[i1]),
                               donate_argnums=0, out_shardings=(self.dsh, self.hsh))

            def ours_calls(name: str) -> tuple[Any, Any, Any]:
                off, on = variants[name]
                i1, j1, i2, j2 = pinned if "dma" in name else (si1, di1, si2, di2)
                f_off = jax.jit(off, donate_argnums=0, out_shardings=self.hsh)
                f_on = jax.jit(on, donate_argnums=0, out_shardings=self.dsh)
                f_both = jax.jit(lambda h, dv, sa, sb, i1, j1, i2, j2: (off(h, sa, i1, j1),
                                                                        on(dv, sb, i2, j2)),
                                 donate_argnums=(0, 1), out_shardings=(self.hsh, self.dsh))

                def c_off():
                    st["host_a"] = f_off(st["host_a"], dev_a, i1, j1)
                    return st["host_a"]

                def c_on():
                    st["dev_b"] = f_on(st["dev_b"], host_b, i2, j2)
                    return st["dev_b"]

                def c_both():
                    st["host_a"], st["dev_b"] = f_both(st["host_a"], st["dev_b"], dev_a, host_b,
                                                       i1, j1, i2, j2)
                    return st["host_a"], st["dev_b"]

                return c_off, c_on, c_both

            def c_xla_on():
                st["dev_b"] = xla_on(st["dev_b"], host_b, si2, di2)
                return st["dev_b"]

            def c_xla_both():
                st["dev_b"], out = xla_both(st["dev_b"], dev_a, host_b, si1, si2, di2)
                return out, st["dev_b"]

            calls = {name: ours_calls(name) for name in variants}
            calls["xla"] = (lambda: xla_off(dev_a, si1), c_xla_on, c_xla_both)
            for name, (off, on, both) in calls.items():
                res: dict[str, Any] = {}
                if self.past_deadline():
                    sec["paths"][name] = {"skipped": "past the deadline"}
                    continue
                try:
                    before = dma_batches()
                    t_off = median(self.time_jax(off, pipe=pipe)[0])
                    t_on = median(self.time_jax(on, pipe=pipe)[0])
                    t_both = median(self.time_jax(both, pipe=pipe)[0])
                    res = self._bidir_result(total, t_off, t_on, t_both)
                    if "dma" in name and before is not None:
                        res["dma_used"] = dma_batches() > before
                    if name.startswith("ours"):  # both destinations hold their blocks
                        ends = [0, B - 1]
                        i1, j1, i2, j2 = (np.asarray(a)[ends] for a in (si1, di1, si2, di2))
                        res["verified"] = bool(
                            np.array_equal(self.fetch(st["host_a"], j1), self.fetch(dev_a, i1))
                            and np.array_equal(self.fetch(st["dev_b"], j2),
                                               self.fetch(host_b, i2)))
                except Exception as e:  # noqa: BLE001
                    res["error"] = err_text(e)
                    self.log(f"bidirectional {name}: ERROR {res['error'][:300]}")
                sec["paths"][name] = res
                if "factor" in res:
                    self._log_bidir(name, res)

            for dma in (False, True):
                name = "ours_both_ways_dma" if dma else "ours_both_ways"
                if not self.past_deadline():
                    sec["paths"][name] = self._both_ways_path(geom, B, total, pipe, dma)

            cu = self.cupy
            if cu is not None and not self.past_deadline():
                try:
                    cu.ensure_arena(total)
                    da, db = cu.ptr("dev_a"), cu.ptr("dev_b")
                    ha, hb = cu.ptr("host_a"), cu.ptr("host_b")
                    kw = {"reps": 1, "samples": cfg.repeats, "warmup": cfg.warmup,
                          "gpu_only": True}
                    t_off = median(cu.time_ops(lambda s: cu.memcpy(hb, da, total, s), **kw)[0])
                    t_on = median(cu.time_ops(lambda s: cu.memcpy(db, ha, total, s), **kw)[0])
                    with cu.device:
                        fork, join = cu.cp.cuda.Event(), cu.cp.cuda.Event()

                    def both_streams(s: Any) -> None:
                        fork.record(s)
                        cu.stream2.wait_event(fork)
                        cu.memcpy(hb, da, total, s)
                        cu.memcpy(db, ha, total, cu.stream2)
                        join.record(cu.stream2)
                        s.wait_event(join)

                    t_both = median(cu.time_ops(both_streams, **kw)[0])
                    res = self._bidir_result(total, t_off, t_on, t_both)
                    res["variant"] = "contiguous memcpy, D2H and H2D on two streams"
                    sec["paths"]["memcpy_two_streams"] = res
                    self._log_bidir("memcpy_two_streams", res)
                except Exception as e:  # noqa: BLE001
                    sec["paths"]["memcpy_two_streams"] = {"error": err_text(e)}
                    self.log(f"bidirectional memcpy: ERROR {err_text(e)[:300]}")
        except Exception as e:  # noqa: BLE001
            sec["error"] = err_text(e)
            sec["traceback"] = traceback.format_exc(limit=6)
            self.log(f"bidirectional: ERROR {sec['error'][:300]}")
        gc.collect()
        self.save()

    def _both_ways_path(self, geom: Any, B: int, total: int, pipe: int,
                        dma: bool) -> dict[str, Any]:
        """The serving case: an offload and an onboard between the *same* GPU pool and host
        pool, one `copy_blocks_both_ways` call, against each direction alone. The offload reads
        GPU blocks [0, B) into host slots [0, B); the onboard brings host slots [B, 2B) into GPU
        blocks [B, 2B): no block is written by one direction and read by the other, so the
        call runs both directions at once (the kernel variant knows its indices when the jit
        traces; the DMA variant takes them as pinned_host arguments and says `disjoint`)."""
        name = "ours_both_ways_dma" if dma else "ours_both_ways"
        res: dict[str, Any] = {}
        try:
            st = {"gpu": self.random_pool(geom, 2 * B, self.dsh),
                  "host": self.random_pool(geom, 2 * B, self.hsh)}
            off_src, off_dst, on_src, on_dst = (
                self.perms(1, B, B)[0] + base for base in (0, 0, B, B))
            if dma:  # traced, in pinned_host memory, where the handler reads them
                idx = jax.device_put((off_src, off_dst, on_src, on_dst), self.hsh)
                block_on(idx)
                kw = {"dma": True, "disjoint": True}
                f_off = jax.jit(lambda h, g, s, d: copy_blocks(h, g, s, d, dma=True),
                                donate_argnums=0)
                f_on = jax.jit(lambda g, h, s, d: copy_blocks(g, h, s, d, dma=True),
                               donate_argnums=0)
                f_both = jax.jit(lambda g, h, *i: copy_blocks_both_ways(g, h, *i, **kw),
                                 donate_argnums=(0, 1))
            else:  # known when the jit traces: the plan sees they are disjoint
                idx = ()
                f_off = jax.jit(lambda h, g: copy_blocks(h, g, off_src, off_dst),
                                donate_argnums=0)
                f_on = jax.jit(lambda g, h: copy_blocks(g, h, on_src, on_dst), donate_argnums=0)
                f_both = jax.jit(lambda g, h: copy_blocks_both_ways(g, h, off_src, off_dst,
                                                                    on_src, on_dst),
                                 donate_argnums=(0, 1))
            off_idx, on_idx = idx[:2], idx[2:]

            def c_off():
                st["host"] = f_off(st["host"], st["gpu"], *off_idx)
                return st["host"]

            def c_on():
                st["gpu"] = f_on(st["gpu"], st["host"], *on_idx)
                return st["gpu"]

            def c_both():
                st["gpu"], st["host"] = f_both(st["gpu"], st["host"], *idx)
                return st["gpu"], st["host"]

            before = dma_batches()
            t_off = median(self.time_jax(c_off, pipe=pipe)[0])
            t_on = median(self.time_jax(c_on, pipe=pipe)[0])
            t_both = median(self.time_jax(c_both, pipe=pipe)[0])
            res = self._bidir_result(total, t_off, t_on, t_both)
            if dma and before is not None:
                res["dma_used"] = dma_batches() > before
            ends = [0, B - 1]  # every copy is idempotent: the pools it reads never change
            res["verified"] = bool(
                np.array_equal(self.fetch(st["host"], off_dst[ends]),
                               self.fetch(st["gpu"], off_src[ends]))
                and np.array_equal(self.fetch(st["gpu"], on_dst[ends]),
                                   self.fetch(st["host"], on_src[ends])))
            res["variant"] = "one copy_blocks_both_ways call between one GPU and one host pool"
            self._log_bidir(name, res)
        except Exception as e:  # noqa: BLE001
            res["error"] = err_text(e)
            self.log(f"bidirectional {name}: ERROR {res['error'][:300]}")
        return res

    @staticmethod
    def _bidir_result(total: int, t_off: float, t_on: float, t_both: float) -> dict[str, Any]:
        g_off, g_on, g_both = total / t_off / 1e9, total / t_on / 1e9, 2 * total / t_both / 1e9
        return {"offload_s": t_off, "onboard_s": t_on, "both_s": t_both,
                "offload_gbps": g_off, "onboard_gbps": g_on, "aggregate_gbps": g_both,
                "factor": g_both / max(g_off, g_on)}

    def _log_bidir(self, name: str, r: dict[str, Any]) -> None:
        self.log(f"bidirectional {name}: offload {r['offload_gbps']:.1f}, onboard "
                 f"{r['onboard_gbps']:.1f}, both {r['aggregate_gbps']:.1f} GB/s aggregate "
                 f"= {r['factor']:.2f}x one direction")
