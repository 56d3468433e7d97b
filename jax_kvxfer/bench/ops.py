"""The ops section: `copy_blocks` over block sizes, against the same-run ceiling of each size.

Per block size (`--sizes`, bf16, `--blocks` blocks a batch, random permutations as indices so
no two neighbours are contiguous) and direction (d2h offload, device -> pinned_host; h2d
onboard; d2d device -> device):
  ceiling   one contiguous copy of the batch's bytes (see helpers)
  ours      `copy_blocks` inside `jax.jit`, destination donated, k chained calls a jit call
            (dispatch amortised), `dma=False` (the copy kernel), n in {T, T-1, T/2, 1} tokens
  ours_dma  the same with `dma=True` (the copy engines), whole blocks, host directions: the
            indices are jit arguments in pinned_host memory, where the copy engines read them
  naive     one `jax.device_put` a block from a Python loop, whole blocks, host directions
  trtllm    TensorRT-LLM's way (cupy): one cudaMemcpyAsync a block, whole blocks, GPU time
            behind the spin kernel (the best a per-block loop can do, whatever issues it)
Bandwidth counts the bytes moved (n tokens of each block); `ratio` divides it by the ceiling.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import copy_blocks
from .config import Geometry, fmt_size, geometry_for, n_cases
from .helpers import block_on, err_text


class OpsMixin:
    def run_ops(self, sec: dict[str, Any]) -> None:
        sec["cases"] = []
        for size in self.cfg.sizes:
            if self.past_deadline():
                sec["cases"].append({"block_bytes": size, "skipped": "past the deadline"})
                continue
            try:
                self._ops_size(sec["cases"], geometry_for(size))
            except Exception as e:  # noqa: BLE001 - a ceiling failed: the next size goes on
                sec["cases"].append({"block_bytes": size, "error": err_text(e)})
                self.log(f"ops {fmt_size(size)}: ERROR {err_text(e)[:300]}")
            gc.collect()

    def _ops_size(self, cases: list[dict[str, Any]], g: Geometry) -> None:
        B = self.cfg.blocks
        self.log(f"== ops: {B} blocks of {fmt_size(g.block_bytes)} {g.block_shape} ==")
        pools: dict[str, jax.Array] = {}

        def pool(name: str) -> jax.Array:  # made again where a failed donated call deleted it
            if name not in pools or pools[name].is_deleted():
                pools[name] = self.random_pool((B, *g.block_shape),
                                               self.dsh if name.startswith("dev") else self.hsh)
            return pools[name]

        for d in ("d2h", "h2d", "d2d"):
            src, dst = {"d2h": ("dev_src", "host_dst"), "h2d": ("host_src", "dev_dst"),
                        "d2d": ("dev_src", "dev_dst")}[d]
            base = {"direction": d, "block_bytes": g.block_bytes, "blocks": B}
            ceil = self.ceiling(B * g.block_bytes, (d,))
            cases.append({**base, "path": "ceiling", "gbps": ceil[d], "how": ceil["ceiling"]})
            runs = [("ours", label, n) for label, n in n_cases(g.tokens)]
            if d != "d2d":
                runs += [("ours_dma", "T", g.tokens), ("naive", "T", g.tokens)]
            if self.cupy is not None:
                runs.append(("trtllm", "T", g.tokens))
            fns: dict[bool, Any] = {}
            for path, label, n in runs:
                rec = {**base, "path": path, "n": label}
                cases.append(rec)
                if self.past_deadline():
                    rec["skipped"] = "past the deadline"
                    continue
                try:
                    if path.startswith("ours"):
                        rec.update(self._ours(d, g, pool, src, dst, n, path == "ours_dma", fns))
                    elif path == "naive":
                        rec.update(self._naive(d, g, pool(src)))
                    else:
                        rec.update(self._trtllm(d, g))
                    rec["ratio"] = rec["gbps"] / ceil[d]
                    self.log(f"{d} {fmt_size(g.block_bytes)} {path} n={label}: {rec['gbps']:8.2f}"
                             f" GB/s ({rec['ratio']:.1%} of {ceil[d]:.1f})"
                             + ("" if rec.get("verified", True) else "  VERIFY FAILED"))
                except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
                    rec["error"] = err_text(e)
                    self.log(f"{d} {fmt_size(g.block_bytes)} {path} n={label}: ERROR {e}"[:400])
                self.save()

    def _ours(self, d: str, g: Geometry, pool: Any, src: str, dst: str, n: int, dma: bool,
              fns: dict[bool, Any]) -> dict[str, Any]:
        B, d2d = self.cfg.blocks, d == "d2d"
        call_target = self.cfg.call_target["d2d" if d2d else "host"]
        k = int(min(max(math.ceil(call_target / (B * g.block_bytes)), 1), self.cfg.kmax))
        if dma not in fns:  # one jitted chain of k copies per direction and engine
            def chain(dst_pool, src_pool, si, di, nt):
                for j in range(k):
                    dst_pool = copy_blocks(dst_pool, src_pool, si[j], di[j], nt, dma=dma)
                return dst_pool

            si, di = self.perms(k, B), self.perms(k, B)
            # dma: one index vector per copy, in pinned_host memory, where the handler reads it
            idx = ((tuple(jax.device_put(list(si), self.hsh)),
                    tuple(jax.device_put(list(di), self.hsh))) if dma
                   else (jnp.asarray(si), jnp.asarray(di)))
            out = self.hsh if dst.startswith("host") else self.dsh
            fns[dma] = (jax.jit(chain, donate_argnums=0, out_shardings=out), si, di, idx)
        fn, si, di, idx = fns[dma]
        # whole blocks as a user copies them, without num_tokens
        nt = None if n >= g.tokens else jax.device_put(np.full(B, n, np.int32),
                                                       self.hsh if dma else self.dsh)
        src_pool, st = pool(src), {"dst": pool(dst)}

        def call() -> jax.Array:
            st["dst"] = fn(st["dst"], src_pool, *idx, nt)
            return st["dst"]

        moved = B * g.moved(n)
        seconds = self.per_call(call, self.pipe_for(k * moved, d2d)) / k
        ends = [0, B - 1]  # the last chained copy: si[k-1] -> di[k-1]
        ok = np.array_equal(self.fetch(st["dst"], di[-1][ends])[..., :n, :],
                            self.fetch(src_pool, si[-1][ends])[..., :n, :])
        return {"gbps": moved / seconds / 1e9, "bytes_moved": moved, "copies_per_call": k,
                "verified": bool(ok)}

    def _naive(self, d: str, g: Geometry, src_pool: jax.Array) -> dict[str, Any]:
        B = self.cfg.blocks
        si = self.perms(1, B)[0]
        blocks = [src_pool[int(i)] for i in si] if d == "d2h" else \
            [jax.device_put(b, self.hsh) for b in jax.device_put(src_pool, self.dsh)[si]]
        block_on(blocks)  # separate arrays, made beforehand
        target, out = self.hsh if d == "d2h" else self.dsh, {}

        def run() -> None:
            out["blocks"] = [jax.device_put(b, target) for b in blocks]
            block_on(out["blocks"])

        seconds = self.timed(run)
        ok = np.array_equal(np.asarray(jax.device_put(out["blocks"][0], self.dsh)).view(np.uint16),
                            self.fetch(src_pool, si[:1])[0])
        return {"gbps": B * g.block_bytes / seconds / 1e9, "verified": bool(ok)}

    def _trtllm(self, d: str, g: Geometry) -> dict[str, Any]:
        cu, B, bb = self.cupy, self.cfg.blocks, g.block_bytes
        dst, src = cu.ptrs(B * bb)[d]
        pairs = [(dst + int(j) * bb, src + int(i) * bb)
                 for i, j in zip(self.perms(1, B)[0], self.perms(1, B)[0])]

        def enqueue(stream: Any) -> None:
            for t, s in pairs:
                cu.memcpy(t, s, bb, stream)

        seconds = float(np.median(cu.time_ops(enqueue, 1, self.cfg)))
        return {"gbps": B * bb / seconds / 1e9}


def ops_summary(sec: dict[str, Any]) -> list[str]:
    """GB/s and % of the same-run ceiling, one row per direction and block size."""
    rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in sec.get("cases", []):
        if "direction" in r:
            rows.setdefault((r["direction"], r["block_bytes"]), {})[
                r["path"] + ("" if r.get("n", "T") == "T" else " n=" + r["n"])] = r
    cols = [c for c in ("ours", "ours n=T-1", "ours n=T/2", "ours n=1", "ours_dma", "naive",
                        "trtllm") if any(c in row for row in rows.values())]
    head = f"{'dir':4} {'block':>5} {'ceiling':>8} " + " ".join(f"{c:>13}" for c in cols)
    out = ["ops: copy_blocks, GB/s and % of one contiguous copy of the batch (ceiling, same run)",
           head]
    for (d, size), row in rows.items():
        cells = []
        for c in cols:
            r = row.get(c, {})
            cells.append(f"{r['gbps']:7.1f} {r['ratio']:5.0%}" if "ratio" in r else
                         f"{r.get('error') and 'ERROR' or '-':>13}")
        ceil = row.get("ceiling", {}).get("gbps")
        out.append(f"{d:4} {fmt_size(size):>5} {ceil or 0:8.1f} " + " ".join(cells))
    for (d, size), row in rows.items():  # against the baselines, at 64 KiB (the headline row of docs/performance.md)
        if size == 64 * 1024 and "ratio" in row.get("ours", {}):
            out.append(f"ops {d} 64K: ours " + ", ".join(
                f"{row['ours']['gbps'] / row[b]['gbps']:.1f}x {b}" for b in ("naive", "trtllm")
                if "ratio" in row.get(b, {})))
    return out
