"""The step section: the manager's transfers beside a compute-bound jitted step.

What a serving loop sees. A jitted chain of bf16 matmuls (the step, at least `--step-ms` alone)
and the manager's `offload_blocks` / `onboard_blocks` of `--step-bytes` (2 MiB blocks, Llama-8B
shaped: 32 layers x 2 x 8 heads x 16 tokens x 128): each alone, then issued just before the
step and waited for together (`sync_transfers(block=False)`, then the step's result and the
pools). `added_pct` is the step's added time; `of_serial` the time over step + transfer. Cases:
the manager as made (the lanes), with `dma=False` (the copy kernel on XLA's stream, in line),
partial onboards (n = T/2), both directions at once, and JAX's own `device_put` of the gathered
blocks to a new pinned_host array (a baseline that writes no pool).

Then the host-overhead figures: 1,024 pairs of 64 KiB blocks (32 with --quick), offload + sync and onboard + sync,
by block pairs and by index arrays, against one contiguous copy of the same bytes (cupy's memcpy, else `jax.device_put`), and the
time a 64-pair call takes to return to Python.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..manager import KVCacheTransferManager
from ..pool import KVCacheBlock, KVCacheBlockPool
from .config import DTYPE, MiB
from .helpers import err_text, median

_STEP_GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "size_per_head": 128,
                  "tokens_per_block": 16}  # 2 MiB blocks in bf16
_SMALL_GEOMETRY = dict(_STEP_GEOMETRY, num_layers=1)  # 64 KiB


def _pairs(src: np.ndarray, dst: np.ndarray, src_primary: bool) -> list:
    return [(KVCacheBlock(int(a), int(a), src_primary), KVCacheBlock(int(b), int(b), not src_primary))
            for a, b in zip(src, dst)]


class BesideStepMixin:
    """`Bench`'s step section (uses `BenchCore`'s state and helpers)."""

    def run_beside_step(self) -> None:
        sec: dict[str, Any] = {}
        self.sections["step"] = sec
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory"
            return
        try:
            self._beside_step(sec)
        except Exception as e:  # noqa: BLE001
            sec["error"] = err_text(e)
            self.log(traceback.format_exc())
        try:
            self._host_overhead_figures(sec)
        except Exception as e:  # noqa: BLE001
            sec["overhead_error"] = err_text(e)
            self.log(traceback.format_exc())
        self.save()

    def _timed(self, run: Callable[[], Any], samples: int | None = None) -> float:
        """Median wall seconds of run() (which waits for its own work), after warm-up."""
        for _ in range(max(1, self.cfg.warmup)):
            run()
        times = []
        for _ in range(samples or self.cfg.repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return median(times)

    def _beside_step(self, sec: dict[str, Any]) -> None:
        cfg = self.cfg
        block_nbytes = KVCacheBlockPool(**_STEP_GEOMETRY, dtype=DTYPE, num_primary_blocks=1,
                                        num_secondary_blocks=1).block_nbytes
        nb = max(2, cfg.step_bytes // block_nbytes)
        pool = KVCacheBlockPool.create(**_STEP_GEOMETRY, dtype=DTYPE, num_primary_blocks=nb,
                                       num_secondary_blocks=nb, device=self.dev)
        pool.primary = jax.device_put(
            jax.random.normal(jax.random.key(cfg.seed), pool.primary.shape, DTYPE),
            pool.sharding("device"))
        total = nb * pool.block_nbytes
        src, dst = self.rng.permutation(nb), self.rng.permutation(nb)
        offloads, onboards = _pairs(src, dst, True), _pairs(dst, src, False)
        sec.update({"block_bytes": pool.block_nbytes, "blocks": nb, "bytes": total})
        self.log(f"== step: the manager's transfers of {total / MiB:.0f} MiB ({nb} x "
                 f"{pool.block_nbytes // 1024} KiB) beside a jitted matmul chain ==")

        n_dim = cfg.matmul_dim
        x = jax.random.normal(jax.random.key(1), (n_dim, n_dim), DTYPE)
        w = jax.random.normal(jax.random.key(2), (n_dim, n_dim), DTYPE) * (1.0 / n_dim ** 0.5)

        def make_step(iters: int) -> Callable[[jax.Array], jax.Array]:
            def chain(a):
                for _ in range(iters):
                    a = jnp.dot(a, w, preferred_element_type=jnp.float32).astype(DTYPE)
                return a
            return jax.jit(chain)

        probe = make_step(4)
        per_iter = self._timed(lambda: probe(x).block_until_ready()) / 4
        iters = max(4, int(np.ceil(cfg.step_ms / 1e3 / max(per_iter, 1e-7))))
        step = make_step(iters)
        step_s = self._timed(lambda: step(x).block_until_ready())
        sec.update({"step_iters": iters, "step_s": step_s, "cases": {}})

        managers = {"lanes": KVCacheTransferManager([pool]),
                    "in_line": KVCacheTransferManager([pool], dma=False)}
        half = pool.tokens_per_block // 2

        def issue(case: str) -> None:
            mgr = managers["in_line" if case.endswith("in_line") else "lanes"]
            if case.startswith("offload"):
                mgr.offload_blocks(offloads)
            elif case.startswith("partial_onboard"):
                mgr.onboard_blocks(onboards, num_tokens=half)
            elif case.startswith("onboard"):
                mgr.onboard_blocks(onboards)
            else:  # both
                mgr.offload_and_onboard(offloads[: nb // 2], onboards[nb // 2:])

        def wait(mgr: KVCacheTransferManager, y: Any = None) -> None:
            mgr.sync_transfers(block=False)
            jax.block_until_ready([a for a in (y, pool.primary, pool.secondary) if a is not None])

        gather = jax.jit(lambda p, i: p[i])
        idx = jnp.asarray(src)

        def jax_baseline(with_step: bool) -> None:
            host = jax.device_put(gather(pool.primary, idx), self.hsh)
            y = step(x) if with_step else None
            jax.block_until_ready([a for a in (host, y) if a is not None])

        cases = ("offload", "onboard", "partial_onboard", "both", "offload_in_line",
                 "onboard_in_line")
        for case in cases:
            mgr = managers["in_line" if case.endswith("in_line") else "lanes"]
            try:
                alone = self._timed(lambda c=case, m=mgr: (issue(c), wait(m)))
                together = self._timed(lambda c=case, m=mgr: wait(m, (issue(c), step(x))[1]))
            except Exception as e:  # noqa: BLE001
                sec["cases"][case] = {"error": err_text(e)}
                self.log(traceback.format_exc())
                continue
            moved = total // 2 if case.startswith("partial") else total  # n = T/2 of each block
            sec["cases"][case] = self._overlap_record(alone, together, step_s, moved, case)
        alone = self._timed(lambda: jax_baseline(False))
        together = self._timed(lambda: jax_baseline(True))
        sec["cases"]["jax_device_put"] = self._overlap_record(alone, together, step_s, total,
                                                              "jax_device_put")

    def _overlap_record(self, alone: float, together: float, step_s: float, nbytes: int,
                        name: str) -> dict[str, Any]:
        rec = {"transfer_s": alone, "with_step_s": together,
               "added_pct": 100 * (together / step_s - 1),
               "of_serial": together / (step_s + alone),
               "transfer_gbps": nbytes / alone / 1e9}
        self.log(f"  {name:18s} alone {alone * 1e3:7.2f} ms ({rec['transfer_gbps']:5.1f} GB/s), "
                 f"with the step {together * 1e3:7.2f} ms: step +{rec['added_pct']:.1f} %, "
                 f"{rec['of_serial']:.2f} of serial")
        return rec

    def _host_overhead_figures(self, sec: dict[str, Any]) -> None:
        cfg = self.cfg
        nb = cfg.step_overhead_blocks
        pool = KVCacheBlockPool.create(**_SMALL_GEOMETRY, dtype=DTYPE, num_primary_blocks=nb,
                                       num_secondary_blocks=nb, device=self.dev)
        mgr = KVCacheTransferManager([pool])
        src, dst = self.rng.permutation(nb), self.rng.permutation(nb)
        total = nb * pool.block_nbytes
        rec: dict[str, Any] = {"blocks": nb, "block_bytes": pool.block_nbytes}
        offload_pairs, onboard_pairs = _pairs(src, dst, True), _pairs(dst, src, False)
        calls = {"offload": lambda: mgr.offload_blocks(offload_pairs),
                 "onboard": lambda: mgr.onboard_blocks(onboard_pairs),
                 "offload_indices": lambda: mgr.offload_indices(src, dst),
                 "onboard_indices": lambda: mgr.onboard_indices(dst, src)}
        for name, call in calls.items():
            t = self._timed(lambda c=call: (c(), mgr.sync_transfers()))
            returns = []  # the host's part: how long the call takes to return
            for _ in range(self.cfg.repeats):
                t0 = time.perf_counter()
                call()
                returns.append(time.perf_counter() - t0)
                mgr.sync_transfers()
            rec[name] = {"s": t, "gbps": total / t / 1e9, "returns_s": median(returns)}
        rec["ceiling"] = self._contiguous_ceiling(total)
        for name in calls:
            ceiling = rec["ceiling"].get("d2h" if name.startswith("offload") else "h2d")
            if ceiling:
                rec[name]["ratio"] = rec[name]["gbps"] / ceiling
        # return time of a 64-pair call, not waiting for the device
        pairs = _pairs(src[:64], dst[:64], True)
        times = []
        for i in range(40 + cfg.warmup):
            t = time.perf_counter()
            mgr.offload_blocks(pairs)
            times.append(time.perf_counter() - t)
            if i % 8 == 7:
                mgr.sync_transfers()
        mgr.sync_transfers()
        rec["call_64_pairs_us"] = 1e6 * median(times[cfg.warmup:])
        sec["overhead"] = rec
        self.log(f"  {nb} x 64 KiB: offload {rec['offload']['gbps']:.1f} GB/s "
                 f"({rec['offload'].get('ratio', 0) * 100:.0f} % of contiguous), onboard "
                 f"{rec['onboard']['gbps']:.1f} GB/s ({rec['onboard'].get('ratio', 0) * 100:.0f} "
                 f"%); a 64-pair call returns in {rec['call_64_pairs_us']:.0f} us")
        self.log(f"  {nb} x 64 KiB by index arrays: offload_indices "
                 f"{rec['offload_indices'].get('ratio', 0) * 100:.0f} %, onboard_indices "
                 f"{rec['onboard_indices'].get('ratio', 0) * 100:.0f} % of contiguous; host "
                 f"returns after {rec['offload_indices']['returns_s'] * 1e6:.0f} / "
                 f"{rec['onboard_indices']['returns_s'] * 1e6:.0f} us")

    def _contiguous_ceiling(self, nbytes: int) -> dict[str, float]:
        """GB/s of one contiguous copy of `nbytes` each way: cupy's memcpy (GPU time), else
        jax.device_put of one array (wall)."""
        cu = self.cupy
        if cu is not None:
            cu.ensure_arena(nbytes)
            out = {}
            for name, dst, src in (("d2h", "host_b", "dev_a"), ("h2d", "dev_a", "host_b")):
                d, s = cu.ptr(dst), cu.ptr(src)
                times, _ = cu.time_ops(lambda st, d=d, s=s: cu.memcpy(d, s, nbytes, st), reps=1,
                                       samples=self.cfg.repeats, warmup=self.cfg.warmup,
                                       gpu_only=True)
                out[name] = nbytes / median(times) / 1e9
            out["source"] = "cupy memcpy"
            return out
        dev = jnp.zeros((nbytes // 2,), DTYPE, device=self.dsh)
        host = jax.device_put(dev, self.hsh).block_until_ready()
        d2h = self._timed(lambda: jax.device_put(dev, self.hsh).block_until_ready())
        h2d = self._timed(lambda: jax.device_put(host, self.dsh).block_until_ready())
        return {"d2h": nbytes / d2h / 1e9, "h2d": nbytes / h2d / 1e9, "source": "device_put"}
