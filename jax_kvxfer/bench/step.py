"""The step section: the manager's transfers beside a compute-bound jitted step.

What a serving loop sees. A jitted chain of bf16 matmuls (the step, at least `--step-ms` alone)
and the manager's transfers of `--step-bytes` in Llama-3.1-8B's 2 MiB blocks: each alone (+ its
ratio to one contiguous copy of the same bytes, same run), then issued just before the step and
waited for together (`sync_transfers(block=False)`, then the step's result and the pools).
`added_pct` is the step's added time; `of_serial` the time over step + transfer. Cases: the
manager as made (on the lanes beside the step), partial onboards (n = T/2), both directions at
once (half the blocks each way, against the two ceilings added), the manager with `dma=False`
(the copy kernel in line on XLA's stream), and JAX's own jitted gather then `device_put` to a
new pinned_host array (a baseline that writes no pool).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import KVCacheBlockPool, KVCacheTransferManager
from .config import DTYPE, MiB
from .manager import GEOMETRY, pairs


class StepMixin:
    def run_step(self, sec: dict[str, Any]) -> None:
        cfg = self.cfg
        nb = max(2, cfg.step_bytes // (2 * MiB))
        pool = KVCacheBlockPool.create(num_layers=32, **GEOMETRY, dtype=DTYPE, device=self.dev,
                                       num_primary_blocks=nb, num_secondary_blocks=nb)
        pool.primary = self.random_pool(pool.primary.shape, pool.sharding("device"))
        total = nb * pool.block_nbytes
        ceil = sec["ceiling"] = self.ceiling(total)
        src, dst = self.rng.permutation(nb), self.rng.permutation(nb)
        offloads, onboards = pairs(src, dst, True), pairs(dst, src, False)
        self.log(f"== step: the manager's transfers of {total / MiB:.0f} MiB ({nb} x 2 MiB) "
                 "beside a jitted matmul chain ==")
        n = cfg.matmul_dim
        x = jax.random.normal(jax.random.key(1), (n, n), DTYPE)
        w = jax.random.normal(jax.random.key(2), (n, n), DTYPE) * (1.0 / n ** 0.5)

        def make_step(iters: int) -> Any:
            def chain(a: jax.Array) -> jax.Array:
                for _ in range(iters):
                    a = jnp.dot(a, w, preferred_element_type=jnp.float32).astype(DTYPE)
                return a
            return jax.jit(chain)

        probe = make_step(4)
        per_iter = self.timed(lambda: probe(x).block_until_ready()) / 4
        iters = max(4, int(np.ceil(cfg.step_ms / 1e3 / max(per_iter, 1e-7))))
        step = make_step(iters)
        step_s = self.timed(lambda: step(x).block_until_ready())
        sec.update({"blocks": nb, "block_bytes": pool.block_nbytes, "step_iters": iters,
                    "step_s": step_s, "cases": {}})
        lanes, in_line = KVCacheTransferManager([pool]), KVCacheTransferManager([pool], dma=False)
        half = pool.tokens_per_block // 2
        cases = {  # name: (manager, issue, bytes moved, ceiling GB/s)
            "offload": (lanes, lambda m: m.offload_blocks(offloads), total, ceil["d2h"]),
            "onboard": (lanes, lambda m: m.onboard_blocks(onboards), total, ceil["h2d"]),
            "partial_onboard": (lanes, lambda m: m.onboard_blocks(onboards, num_tokens=half),
                                total // 2, ceil["h2d"]),
            "both": (lanes, lambda m: m.offload_and_onboard(offloads[:nb // 2],
                                                            onboards[nb // 2:]),
                     total, ceil["d2h"] + ceil["h2d"]),
            "offload_in_line": (in_line, lambda m: m.offload_blocks(offloads), total, ceil["d2h"]),
            "onboard_in_line": (in_line, lambda m: m.onboard_blocks(onboards), total, ceil["h2d"])}

        def wait(mgr: KVCacheTransferManager, y: Any = None) -> None:
            mgr.sync_transfers(block=False)
            jax.block_until_ready([a for a in (y, pool.primary, pool.secondary) if a is not None])

        gather, idx = jax.jit(lambda p, i: p[i]), jnp.asarray(src)

        def jax_put(with_step: bool) -> None:
            jax.block_until_ready([jax.device_put(gather(pool.primary, idx), self.hsh)]
                                  + ([step(x)] if with_step else []))

        for name, (mgr, issue, nbytes, ceiling) in cases.items():
            alone = self.timed(lambda m=mgr, f=issue: (f(m), wait(m)))
            together = self.timed(lambda m=mgr, f=issue: wait(m, (f(m), step(x))[1]))
            sec["cases"][name] = self._beside(name, alone, together, step_s, nbytes, ceiling)
        sec["cases"]["jax_device_put"] = self._beside(
            "jax_device_put", self.timed(lambda: jax_put(False)), self.timed(lambda: jax_put(True)),
            step_s, total, ceil["d2h"])
        self.save()

    def _beside(self, name: str, alone: float, together: float, step_s: float, nbytes: int,
                ceiling: float) -> dict[str, Any]:
        gbps = nbytes / alone / 1e9
        rec = {"transfer_s": alone, "with_step_s": together, "gbps": gbps,
               "ratio": gbps / ceiling, "added_pct": 100 * (together / step_s - 1),
               "of_serial": together / (step_s + alone)}
        self.log("step " + step_line(name, rec, step_s))
        return rec


def step_line(name: str, r: dict[str, Any], step_s: float) -> str:
    return (f"{name:16s} alone {r['transfer_s'] * 1e3:6.2f} ms ({r['gbps']:5.1f} GB/s, "
            f"{r['ratio']:4.0%} of a contiguous copy), with the {step_s * 1e3:.1f} ms step "
            f"{r['with_step_s'] * 1e3:6.2f} ms: step {r['added_pct']:+.1f} %, "
            f"{r['of_serial']:.2f} of serial")


def step_summary(sec: dict[str, Any]) -> list[str]:
    return ["step " + step_line(name, r, sec["step_s"]) for name, r in sec.get("cases", {}).items()]
