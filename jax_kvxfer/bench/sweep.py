"""The block-size sweep: ceilings, ours, xla, naive and TensorRT-LLM-style paths per direction."""

from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import copy_blocks
from ..testing import dma_batches
from .config import DIRECTIONS, DTYPE, Geometry, MiB, fmt_size, geometry_for, n_cases
from .helpers import block_on, clamp, err_text, xla_onboard_rows


class SweepMixin:
    """`Bench`'s sweep section (uses `BenchCore`'s state and helpers)."""

    def run_sweep(self) -> None:
        for size in self.cfg.sizes:
            if self.past_deadline():
                self.log(f"deadline passed: skipping {fmt_size(size)} blocks")
                self.results.append({"path": "sweep", "block_bytes": size,
                                     "skipped": "past the deadline"})
                continue
            try:
                self.sweep_size(size)
            except Exception as e:  # noqa: BLE001
                self.log(f"size {fmt_size(size)}: setup ERROR {err_text(e)[:300]}")
                self.results.append({"path": "setup", "block_bytes": size,
                                     "error": err_text(e),
                                     "traceback": traceback.format_exc(limit=6)})
            gc.collect()
            self.save()

    def sweep_size(self, size: int) -> None:
        cfg = self.cfg
        geom = geometry_for(size)
        B = cfg.blocks
        total = B * geom.block_bytes
        self.log(f"== block {fmt_size(size)} {geom.block_shape} x {B} blocks "
                 f"= {total / MiB:.1f} MiB per batch ==")
        pools: dict[str, jax.Array] = {}

        def pool(name: str) -> jax.Array:
            """Lazily (re)made: a failed donated call may leave a pool deleted."""
            p = pools.get(name)
            if p is None or p.is_deleted():
                sh = self.dsh if name.startswith("dev") else self.hsh
                maker = self.random_pool if name.endswith("src") else self.zero_pool
                p = pools[name] = maker(geom, B, sh)
                block_on(p)
            return p

        base = {"block_bytes": geom.block_bytes, "geometry": geom.as_dict(), "blocks": B}
        directions = [d for d in DIRECTIONS if d == "d2d" or self.hsh is not None]
        src_of = {"d2h": "dev_src", "h2d": "host_src", "d2d": "dev_src"}
        dst_of = {"d2h": "host_dst", "h2d": "dev_dst", "d2d": "dev_dst"}
        ns = n_cases(geom.tokens)
        if self.cupy and ({"ceiling", "trtllm"} & cfg.only):
            self.cupy.ensure_arena(total)

        for d in directions:
            d2d = d == "d2d"
            dbase = {**base, "direction": d}
            if "ceiling" in cfg.only:
                self.ceiling_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d])
            if "ours" in cfg.only:
                self.ours_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d], ns)
            if "unique" in cfg.only:
                self.ours_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d],
                                [c for c in ns if c[0] in ("T", "T/2")], unique=True)
            if "dma" in cfg.only and not d2d:
                self.ours_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d],
                                [c for c in ns if c[0] in ("T", "T/2", "1")], dma=True)
            if "manager" in cfg.only and not d2d:
                self.manager_cases(d, geom, B, dbase)
            if "eager" in cfg.only and not d2d:
                self.eager_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d])
            if "xla" in cfg.only:
                self.xla_cases(d, geom, B, dbase, pool, src_of[d], dst_of[d],
                               ns if d2d else ns[:1])
            if "naive" in cfg.only and not d2d:
                self.naive_case(d, geom, B, dbase, pool, src_of[d])
            if "trtllm" in cfg.only and self.cupy is not None:
                self.trt_cases(d, geom, B, dbase, ns)
        pools.clear()

    def ceiling_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                      pool: Callable[[str], jax.Array], src: str, dst: str) -> None:
        total = B * geom.block_bytes
        d2d = d == "d2d"
        if self.cupy is not None:
            cu = self.cupy
            s_name, d_name = {"d2h": ("dev_a", "host_b"), "h2d": ("host_a", "dev_b"),
                              "d2d": ("dev_a", "dev_b")}[d]

            def memcpy_case() -> dict[str, Any]:
                times, info = self.memcpy_times(s_name, d_name, total, d2d)
                ok = bool(np.array_equal(cu.read(d_name, 0, 4096), cu.read(s_name, 0, 4096)))
                return self.timing(times, total, timing="cuda events", verified=ok, **info)

            rec = self.case({**dbase, "path": "memcpy", "kind": "ceiling", "n_label": "T"},
                            memcpy_case)
            if rec.get("gbps"):
                self.ceilings[(d, geom.block_bytes)] = {"gbps": rec["gbps"], "path": "memcpy"}
            if d2d and "ours" in self.cfg.only:
                self.same_bytes_ceilings(geom, B, dbase)

        def contig_case() -> dict[str, Any]:
            x = pool(src)
            if d == "d2h":
                call = lambda: jax.device_put(x, self.hsh)
            elif d == "h2d":
                call = lambda: jax.device_put(x, self.dsh)
            else:
                cp_fn = jax.jit(jnp.copy)
                call = lambda: cp_fn(x)
            pipe = self.pipe_for(total, d2d)
            times, first = self.time_jax(call, pipe=pipe)
            return self.timing(times, total, timing="wall, block_until_ready", pipe=pipe,
                               first_call_s=first)

        rec = self.case({**dbase, "path": "jax_contig", "kind": "ceiling", "n_label": "T"},
                        contig_case)
        if rec.get("gbps") and (d, geom.block_bytes) not in self.ceilings:
            self.ceilings[(d, geom.block_bytes)] = {"gbps": rec["gbps"], "path": "jax_contig"}

    def memcpy_times(self, s_name: str, d_name: str, nbytes: int, d2d: bool
                     ) -> tuple[list[float], dict[str, Any]]:
        """Seconds per contiguous memcpy of `nbytes` between two cupy buffers, GPU time
        between CUDA events, enough copies per sample to fill the sample target."""
        cu = self.cupy
        sp, dp = cu.ptr(s_name), cu.ptr(d_name)
        target = self.cfg.sample_target_d2d if d2d else self.cfg.sample_target_host
        return cu.time_ops(lambda s: cu.memcpy(dp, sp, nbytes, s),
                           reps=clamp(math.ceil(target / nbytes), 1, 32),
                           samples=self.cfg.repeats, warmup=self.cfg.warmup, gpu_only=True)

    def same_bytes_ceilings(self, geom: Geometry, B: int, dbase: dict[str, Any]) -> None:
        """Device to device, one contiguous memcpy of as many bytes as a partial copy of B
        blocks moves (path "memcpy", n_label T/2, ...): HBM reaches less on a shorter copy, so
        this is the ceiling a partial copy can reach (`same_bytes_ratio`), beside the whole
        batch's memcpy (`ratio`)."""
        for label, n in n_cases(geom.tokens):
            if n >= geom.tokens:
                continue
            nbytes = B * geom.moved(n)

            def memcpy_case(nbytes: int = nbytes) -> dict[str, Any]:
                times, info = self.memcpy_times("dev_a", "dev_b", nbytes, True)
                return self.timing(times, nbytes, timing="cuda events", **info)

            rec = self.case({**dbase, "path": "memcpy", "kind": "ceiling", "n_label": label},
                            memcpy_case)
            if rec.get("gbps"):
                self.same_bytes[("d2d", geom.block_bytes, label)] = rec["gbps"]

    def ours_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                   pool: Callable[[str], jax.Array], src: str, dst: str,
                   ns: list[tuple[str, int]], dma: bool = False, unique: bool = False) -> None:
        """`copy_blocks` in a jitted chain of k calls; dma: `dma=True` ("ours_dma"), the index
        vectors and token counts then jit arguments in pinned_host memory; unique:
        `unique_dst_indices=True` ("ours_unique": the destinations, permutations, promised
        distinct, so the GPU skips its duplicate scan)."""
        d2d = d == "d2d"
        k, _ = self.plan(B * geom.block_bytes, d2d)
        si_all, di_all = self.perms(k, B, B), self.perms(k, B, B)
        out_sh = self.hsh if dst.startswith("host") else self.dsh

        def chain(dst_pool, src_pool, si, di, nt):
            for j in range(k):
                dst_pool = copy_blocks(dst_pool, src_pool, si[j], di[j], nt, dma=dma,
                                       unique_dst_indices=unique)
            return dst_pool

        fn = jax.jit(chain, donate_argnums=0, out_shardings=out_sh)
        if dma:  # one vector per chained call: a pinned_host argument reaches the handler as is
            si_dev = tuple(jax.device_put(si_all[j], self.hsh) for j in range(k))
            di_dev = tuple(jax.device_put(di_all[j], self.hsh) for j in range(k))
        else:
            si_dev, di_dev = jnp.asarray(si_all), jnp.asarray(di_all)
        for label, n in ns:
            def run(n: int = n) -> dict[str, Any]:
                # whole blocks as a user copies them, without num_tokens (so the handler knows)
                nt = None if n >= geom.tokens else jax.device_put(
                    np.full((B,), n, np.int32), self.hsh if dma else self.dsh)
                st = {"dst": pool(dst)}
                s_pool = pool(src)

                def call() -> jax.Array:
                    st["dst"] = fn(st["dst"], s_pool, si_dev, di_dev, nt)
                    return st["dst"]

                # calls per sample by the bytes this case moves (a partial copy moves less than
                # the whole blocks that k was planned for)
                pipe = self.pipe_for(k * B * geom.moved(n), d2d)
                before = dma_batches()
                times, first = self.time_jax(call, pipe=pipe)
                extra = {"dma_used": dma_batches() > before} if dma and before is not None else {}
                times = [t / k for t in times]
                gpu = None if dma else self.gpu_times(call)
                if gpu:  # the kernels' own time and the GPU timeline's span, beside the wall
                    moved = B * geom.moved(n) * k
                    extra.update(gpu_seconds=gpu["kernel_s"] / k,
                                 gpu_gbps=moved / gpu["kernel_s"] / 1e9,
                                 span_seconds=gpu["span_s"] / k,
                                 span_gbps=moved / gpu["span_s"] / 1e9,
                                 span_other_gpu_us=gpu["others_us"])
                # the last chained call used si_all[k-1] -> di_all[k-1]
                pairs = [0, B - 1]
                got = self.fetch(st["dst"], di_all[k - 1][pairs])[..., :n, :]
                want = self.fetch(s_pool, si_all[k - 1][pairs])[..., :n, :]
                return self.timing(times, B * geom.moved(n), timing="wall, block_until_ready",
                                   k_per_call=k, pipe=pipe, first_call_s=first,
                                   verified=bool(np.array_equal(got, want)), n=n, **extra)

            path = "ours_dma" if dma else "ours_unique" if unique else "ours"
            self.case({**dbase, "path": path, "kind": "path", "n_label": label}, run)

    def manager_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any]) -> None:
        """The transfer manager's `offload_blocks` / `onboard_blocks` of B whole blocks, one
        dispatch per call as a serving loop makes them (plans through its pinned-host ring),
        with the copy kernel ("manager") and with the copy engines ("manager_dma")."""
        from ..manager import KVCacheTransferManager
        from ..pool import KVCacheBlock, KVCacheBlockPool

        offload = d == "d2h"
        for dma in (False, True):
            def run(dma: bool = dma) -> dict[str, Any]:
                kvpool = KVCacheBlockPool.create(
                    num_layers=geom.layers, num_kv_heads=geom.heads, size_per_head=geom.head_dim,
                    tokens_per_block=geom.tokens, dtype=DTYPE, num_primary_blocks=B,
                    num_secondary_blocks=B, kv_factor=geom.kv)
                if offload:
                    kvpool.primary = self.random_pool(geom, B, kvpool.sharding("device"))
                else:
                    kvpool.secondary = self.random_pool(geom, B, kvpool.sharding("pinned_host"))
                tm = KVCacheTransferManager([kvpool], dma=dma)
                batches = [(self.perms(1, B, B)[0], self.perms(1, B, B)[0]) for _ in range(4)]
                lists = [[(KVCacheBlock(0, int(s), offload), KVCacheBlock(0, int(t), not offload))
                          for s, t in zip(si, di)] for si, di in batches]
                verb = tm.offload_blocks if offload else tm.onboard_blocks
                calls = [0]

                def call() -> jax.Array:
                    verb(lists[calls[0] % len(lists)])
                    calls[0] += 1
                    return kvpool.secondary if offload else kvpool.primary

                pipe = self.pipe_for(B * geom.block_bytes, False)
                before = dma_batches()
                times, first = self.time_jax(call, pipe=pipe)
                extra = {"dma_used": dma_batches() > before} if dma and before is not None else {}
                si, di = batches[(calls[0] - 1) % len(batches)]
                src, dst = ((kvpool.primary, kvpool.secondary) if offload else
                            (kvpool.secondary, kvpool.primary))
                pairs = [0, B - 1]
                ok = np.array_equal(self.fetch(dst, di[pairs]), self.fetch(src, si[pairs]))
                return self.timing(times, B * geom.block_bytes, timing="wall, block_until_ready",
                                   pipe=pipe, first_call_s=first, verified=bool(ok), **extra)

            self.case({**dbase, "path": "manager_dma" if dma else "manager", "kind": "path",
                       "n_label": "T"}, run)
            gc.collect()

    def eager_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                    pool: Callable[[str], jax.Array], src: str, dst: str) -> None:
        """`copy_blocks` called outside jit with NumPy indices, whole blocks, one call per
        batch: with the default `dma="auto"` ("eager", which takes the copy engines for large
        blocks) and with `dma=False` ("eager_kernel")."""
        pipe = self.pipe_for(B * geom.block_bytes, False)
        batches = [(self.perms(1, B, B)[0], self.perms(1, B, B)[0]) for _ in range(4)]
        for dma in ("auto", False):
            def run(dma: Any = dma) -> dict[str, Any]:
                st = {"dst": pool(dst), "calls": 0}
                s_pool = pool(src)

                def call() -> jax.Array:
                    si, di = batches[st["calls"] % len(batches)]
                    st["dst"] = copy_blocks(st["dst"], s_pool, si, di, donate=True, dma=dma)
                    st["calls"] += 1
                    return st["dst"]

                before = dma_batches()
                times, first = self.time_jax(call, pipe=pipe)
                extra = {} if before is None else {"dma_used": dma_batches() > before}
                si, di = batches[(st["calls"] - 1) % len(batches)]
                pairs = [0, B - 1]
                ok = np.array_equal(self.fetch(st["dst"], di[pairs]), self.fetch(s_pool, si[pairs]))
                return self.timing(times, B * geom.block_bytes, timing="wall, block_until_ready",
                                   pipe=pipe, first_call_s=first, verified=bool(ok), **extra)

            self.case({**dbase, "path": "eager" if dma == "auto" else "eager_kernel",
                       "kind": "path", "n_label": "T"}, run)

    def xla_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                  pool: Callable[[str], jax.Array], src: str, dst: str,
                  ns: list[tuple[str, int]]) -> None:
        T = geom.tokens
        for label, n in ns:
            def run(n: int = n) -> dict[str, Any]:
                s_pool = pool(src)
                op_bytes = B * geom.moved(n)
                if d == "d2h":  # gather, result in pinned_host (a new array)
                    pipe = self.pipe_for(B * geom.block_bytes, False)
                    si = self.perms(1, B, B)[0]
                    fn = jax.jit(lambda s, i: s[i, :, :, :, :n, :] if n < T else s[i],
                                 out_shardings=self.hsh)
                    si_dev = jnp.asarray(si)
                    last: dict[str, Any] = {}

                    def call() -> jax.Array:
                        last["out"] = fn(s_pool, si_dev)
                        return last["out"]

                    times, first = self.time_jax(call, pipe=pipe)
                    got = self.fetch(last["out"], [0, B - 1])
                    want = self.fetch(s_pool, si[[0, B - 1]])[..., :n, :]
                    k = 1
                    variant = "jit gather, out_shardings pinned_host (new array)"
                elif d == "h2d":  # unrolled dynamic_slice (host) -> device_put -> DUS, donated
                    pipe = self.pipe_for(B * geom.block_bytes, False)
                    si, di = self.perms(1, B, B)[0], self.perms(1, B, B)[0]

                    fn = jax.jit(lambda d, s, i, j: xla_onboard_rows(d, s, i, j, B), donate_argnums=0,
                                 out_shardings=self.dsh)
                    st = {"dst": pool(dst)}
                    si_dev, di_dev = jnp.asarray(si), jnp.asarray(di)

                    def call() -> jax.Array:
                        st["dst"] = fn(st["dst"], s_pool, si_dev, di_dev)
                        return st["dst"]

                    times, first = self.time_jax(call, pipe=pipe)
                    got = self.fetch(st["dst"], di[[0, B - 1]])
                    want = self.fetch(s_pool, si[[0, B - 1]])
                    k = 1
                    variant = ("jit, unrolled dynamic_slice of the pinned_host pool -> "
                               "device_put(Space.Device) -> dynamic_update_slice, donated")
                else:  # d2d gather + scatter, chained K times, donated
                    k, pipe = self.plan(B * geom.block_bytes, True)
                    si_all, di_all = self.perms(k, B, B), self.perms(k, B, B)

                    def chain(dst_pool, src_pool, si, di):
                        for j in range(k):
                            if n < T:
                                dst_pool = dst_pool.at[di[j], :, :, :, :n, :].set(
                                    src_pool[si[j], :, :, :, :n, :])
                            else:
                                dst_pool = dst_pool.at[di[j]].set(src_pool[si[j]])
                        return dst_pool

                    fn = jax.jit(chain, donate_argnums=0, out_shardings=self.dsh)
                    st = {"dst": pool(dst)}
                    si_dev, di_dev = jnp.asarray(si_all), jnp.asarray(di_all)

                    def call() -> jax.Array:
                        st["dst"] = fn(st["dst"], s_pool, si_dev, di_dev)
                        return st["dst"]

                    times, first = self.time_jax(call, pipe=pipe)
                    times = [t / k for t in times]
                    got = self.fetch(st["dst"], di_all[k - 1][[0, B - 1]])[..., :n, :]
                    want = self.fetch(s_pool, si_all[k - 1][[0, B - 1]])[..., :n, :]
                    variant = "jit gather + scatter (.at[].set), donated"
                return self.timing(times, op_bytes, timing="wall, block_until_ready",
                                   k_per_call=k, pipe=pipe, first_call_s=first, n=n,
                                   variant=variant, verified=bool(np.array_equal(got, want)))

            self.case({**dbase, "path": "xla", "kind": "path", "n_label": label}, run)

    def naive_case(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                   pool: Callable[[str], jax.Array], src: str) -> None:
        def run() -> dict[str, Any]:
            si = self.perms(1, B, B)[0]
            s_pool = pool(src)
            dev_pool = s_pool if d == "d2h" else pool("dev_src")
            blocks = [dev_pool[int(i)] for i in si]  # per-block arrays, made beforehand
            target = self.hsh
            if d == "h2d":
                blocks = [jax.device_put(b, self.hsh) for b in blocks]
                target = self.dsh
            block_on(blocks)
            last: dict[str, Any] = {}

            def call() -> list[jax.Array]:
                last["outs"] = [jax.device_put(b, target) for b in blocks]
                return last["outs"]

            times, first = self.time_jax(call, pipe=1, samples=min(self.cfg.repeats, 3))
            got = np.asarray(jax.device_put(last["outs"][0], self.dsh)).view(np.uint16)
            want = self.fetch(dev_pool, si[:1])[0]
            return self.timing(times, B * geom.block_bytes, timing="wall, block_until_ready",
                               first_call_s=first, verified=bool(np.array_equal(got, want)),
                               variant="one jax.device_put per block from a Python loop")

        self.case({**dbase, "path": "naive", "kind": "path", "n_label": "T"}, run)

    def trt_cases(self, d: str, geom: Geometry, B: int, dbase: dict[str, Any],
                  ns: list[tuple[str, int]]) -> None:
        cu = self.cupy
        assert cu is not None
        s_name, d_name = {"d2h": ("dev_a", "host_b"), "h2d": ("host_a", "dev_b"),
                          "d2d": ("dev_a", "dev_b")}[d]
        bb = geom.block_bytes
        si, di = self.perms(1, B, B)[0], self.perms(1, B, B)[0]
        src_addr = [cu.ptr(s_name) + int(i) * bb for i in si]
        dst_addr = [cu.ptr(d_name) + int(i) * bb for i in di]
        T, D, outer = geom.tokens, geom.head_dim, geom.outer
        for label, n in ns:
            if n >= T:
                def enqueue(s: Any) -> None:
                    for sa, da in zip(src_addr, dst_addr):
                        cu.memcpy(da, sa, bb, s)
                how = "one cudaMemcpyAsync per block"
            else:
                kern = cu.kernel("trt_style_partial_copy")
                elems = outer * n * D
                grid = ((elems + 255) // 256,)
                args = [(np.uint64(sa), np.uint64(da), np.int32(outer), np.int32(T),
                         np.int32(n), np.int32(D)) for sa, da in zip(src_addr, dst_addr)]

                def enqueue(s: Any, kern: Any = kern, grid: tuple[int] = grid,
                            args: list[tuple[Any, ...]] = args) -> None:
                    for a in args:
                        kern(grid, (256,), a, stream=s)
                how = "one scalar-kernel launch per block (one element per thread)"

            for path, gpu_only in (("trt_gpu", True), ("trt_loop", False)):
                def run(n: int = n, enqueue: Callable[[Any], None] = enqueue,
                        gpu_only: bool = gpu_only, how: str = how) -> dict[str, Any]:
                    times, info = cu.time_ops(enqueue, reps=1, samples=self.cfg.repeats,
                                              warmup=self.cfg.warmup, gpu_only=gpu_only)
                    rows = geom.outer
                    got = cu.read(d_name, int(di[0]) * bb, bb).reshape(rows, T, -1)[:, :n]
                    want = cu.read(s_name, int(si[0]) * bb, bb).reshape(rows, T, -1)[:, :n]
                    return self.timing(times, B * geom.moved(n), timing="cuda events", n=n,
                                       variant=how, verified=bool(np.array_equal(got, want)),
                                       **info)

                self.case({**dbase, "path": path, "kind": "path", "n_label": label}, run)
