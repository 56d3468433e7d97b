"""The peers section (GPU only; `--only peers`): our transfers beside what peers use, one call.

Per block size (BLOCK_SIZES) and batch (BATCHES: 64 MiB and 512 MiB of blocks), the batch's
blocks are a random subset of a pool a quarter larger, at random slots on both sides; each
direction (d2h "offload": GPU -> pinned host; h2d "onboard": pinned host -> GPU), wall time
with a wait for the GPU, median of --repeats after a warm-up, GB/s and % of one contiguous
pinned copy of the same bytes measured in the same run (`ceiling`). Rows:
  manager        KVCacheTransferManager.offload_indices / onboard_indices + sync_transfers
  manager_runs   the same with the host rows in runs of RUN_ROWS consecutive rows (runs in random
                 order), as the block manager hands them out (a prompt's onboard: 2.4 rows a run
                 on the CPU demo's chats, 5.0 on its documents), the GPU slots still random: an
                 offload's rows then go one copy a run from the snapshot, an onboard's through a
                 staging buffer in device memory
  manager_runs_unstaged  manager_runs' onboard with the staging off (one copy per block)
  copy_blocks    jax_kvxfer.copy_blocks between the device pool and the pinned_host pool
  jax            a jitted gather on the GPU + jax.device_put to pinned_host (back: device_put
                 of the packed host rows + a jitted scatter)
  torch_per_blk  one copy_(non_blocking=True) per block (vLLM's old swap_blocks)
  torch_gather   index_select on the GPU + one copy into a packed pinned buffer (back: one copy
                 from it + index_copy_)
  memcpy_batch   cudaMemcpyBatchAsync (cuda-bindings) over the same scattered blocks, stream-
                 ordered source access, on a stream of its own
The torch and cuda-bindings rows are skipped, with a line, where those are missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import KVCacheBlockPool, KVCacheTransferManager, copy_blocks
from ..testing import onboard_staging
from .config import DTYPE, KiB, MiB, fmt_size
from .helpers import block_on, err_text

BLOCK_SIZES = (2 * MiB, 256 * KiB, 64 * KiB, 16 * KiB)
BATCHES = (64 * MiB, 512 * MiB)
DIRS = ("d2h", "h2d")
ROWS = ("manager", "manager_runs", "manager_runs_unstaged", "copy_blocks", "jax",
        "torch_per_blk", "torch_gather", "memcpy_batch")
OURS = ("manager", "manager_runs", "manager_runs_unstaged", "copy_blocks")
RUN_ROWS = 4


def rows_in_runs(rng: np.random.Generator, n: int, pool_n: int, run: int = RUN_ROWS
                 ) -> np.ndarray:
    """n distinct rows of a pool of pool_n, in runs of `run` consecutive rows, runs in random
    order."""
    starts = rng.permutation(pool_n // run)[: -(-n // run)] * run
    return np.concatenate([np.arange(s, s + run) for s in starts])[:n].astype(np.int32)


def geometry(block_bytes: int) -> dict[str, int]:
    """KVCacheBlockPool.create's shape arguments for a bf16 block of `block_bytes`."""
    per_head_layer = 2 * 16 * 128 * 2  # K and V, 16 tokens of 128 bf16
    heads_layers = block_bytes // per_head_layer
    heads = min(8, heads_layers)
    return {"num_layers": heads_layers // heads, "num_kv_heads": heads, "size_per_head": 128,
            "tokens_per_block": 16}


class PeersMixin:
    def run_peers(self, sec: dict[str, Any]) -> None:
        if self.backend != "gpu":
            sec["skipped"] = ("GPU only: the peers (torch, cudaMemcpyBatchAsync) and the pinned "
                              f"link they are measured on need CUDA; backend is {self.backend}")
            self.log("peers: " + sec["skipped"])
            return
        torch, cudart = _optional("torch"), _optional("cuda.bindings.runtime")
        for name, mod in (("torch", torch), ("cuda-bindings", cudart)):
            if isinstance(mod, str):
                sec.setdefault("notes", []).append(f"{name} missing ({mod}): its rows skipped")
                self.log(f"peers: {name} missing ({mod}): its rows skipped")
        sizes = BLOCK_SIZES[-1:] if self.cfg.quick else BLOCK_SIZES
        batches = (4 * MiB,) if self.cfg.quick else BATCHES
        for bb in sizes:
            for batch in batches:
                key = f"{batch // bb} x {fmt_size(bb)}"
                rec = sec[key] = {"block_bytes": bb, "blocks": batch // bb, "bytes": batch}
                if self.past_deadline():
                    rec["skipped"] = "past the deadline"
                    continue
                self._peers_case(rec, torch, cudart)
                self.log("peers " + key + ": " + ", ".join(
                    f"{r} {d} {rec[r][d]['gbps']:.1f}" for r in ROWS if r in rec
                    for d in DIRS if "gbps" in rec[r].get(d, {})))
                self.save()

    def _peers_case(self, rec: dict[str, Any], torch: Any, cudart: Any) -> None:
        bb, n = rec["block_bytes"], rec["blocks"]
        pool_n = n + n // 4
        rec["ceiling"] = self.ceiling(n * bb)
        src, dst = self.perms(1, n, pool_n)[0], self.perms(1, n, pool_n)[0]
        rec["indices"] = {"device": src[:4].tolist(), "host": dst[:4].tolist()}
        self._peers_jax(rec, geometry(bb), pool_n, src, dst)
        if not isinstance(torch, str):
            self._peers_torch(rec, torch, cudart, pool_n, src, dst)
            torch.cuda.empty_cache()  # its pools go back before the next case's JAX pools
        for r in ROWS:
            for d in DIRS:
                if "gbps" in rec.get(r, {}).get(d, {}):
                    rec[r][d]["ratio"] = rec[r][d]["gbps"] / rec["ceiling"][d]

    def _peers_row(self, rec: dict[str, Any], row: str, d: str, run: Callable[[], Any],
                   check: Callable[[], bool] | None = None) -> None:
        """Times run() (which waits for its work) into rec[row][d]; an error is recorded."""
        out = rec.setdefault(row, {})
        try:
            gbps = rec["bytes"] / self.timed(run) / 1e9
            out[d] = {"gbps": gbps}
            if check is not None:
                out[d]["verified"] = bool(check())
        except Exception as e:  # noqa: BLE001
            out[d] = {"error": err_text(e)}
            self.log(f"peers {row} {d}: FAILED {err_text(e)}")

    def _peers_jax(self, rec: dict[str, Any], geo: dict[str, int], pool_n: int,
                   src: np.ndarray, dst: np.ndarray) -> None:
        pool = KVCacheBlockPool.create(**geo, dtype=DTYPE, num_primary_blocks=pool_n,
                                       num_secondary_blocks=pool_n, device=self.dev)
        pool.primary = self.random_pool(pool.primary.shape, pool.sharding("device"))
        pool.secondary = self.random_pool(pool.secondary.shape, pool.sharding("pinned_host"))
        mgr = KVCacheTransferManager([pool])
        ends = [0, len(src) - 1]

        def same(a: jax.Array, ai: np.ndarray, b: jax.Array, bi: np.ndarray) -> bool:
            return np.array_equal(self.fetch(a, ai[ends]), self.fetch(b, bi[ends]))

        def mgr_run(off: bool) -> Callable[[], None]:
            def run() -> None:
                (mgr.offload_indices(src, dst) if off else mgr.onboard_indices(dst, src))
                mgr.sync_transfers()
            return run

        # onboard first: the host pool holds other data than the device pool's blocks
        self._peers_row(rec, "manager", "h2d", mgr_run(False),
                        lambda: same(pool.primary, src, pool.secondary, dst))
        self._peers_row(rec, "manager", "d2h", mgr_run(True),
                        lambda: same(pool.secondary, dst, pool.primary, src))
        self._peers_runs(rec, mgr, pool, src, same)
        s_j, d_j = jnp.asarray(src), jnp.asarray(dst)
        st = {"h": pool.secondary, "g": pool.primary}  # donated below, as the manager does

        def cb_run(off: bool) -> Callable[[], None]:
            def run() -> None:
                k = "h" if off else "g"
                st[k] = (copy_blocks(st["h"], st["g"], s_j, d_j, donate=True) if off
                         else copy_blocks(st["g"], st["h"], d_j, s_j, donate=True))
                block_on(st[k])
            return run

        self._peers_row(rec, "copy_blocks", "h2d", cb_run(False),
                        lambda: same(st["g"], src, st["h"], dst))
        self._peers_row(rec, "copy_blocks", "d2h", cb_run(True),
                        lambda: same(st["h"], dst, st["g"], src))
        g = st["g"]
        gather = jax.jit(lambda p, i: p[i])
        scatter = jax.jit(lambda p, i, x: p.at[i].set(x), donate_argnums=0)
        packed = jax.device_put(gather(g, s_j), self.hsh)
        self._peers_row(rec, "jax", "d2h",
                        lambda: block_on(jax.device_put(gather(g, s_j), self.hsh)),
                        lambda: np.array_equal(self.fetch(jax.device_put(gather(g, s_j),
                                                                         self.hsh), [-1]),
                                               self.fetch(g, src[-1:])))
        buf = [g]  # donated: the scatter updates the device pool in place, as the others do

        def jax_onboard() -> None:
            buf[0] = scatter(buf[0], s_j, jax.device_put(packed, self.dsh))
            block_on(buf[0])

        self._peers_row(rec, "jax", "h2d", jax_onboard,
                        lambda: np.array_equal(self.fetch(buf[0], src[-1:]),
                                               self.fetch(packed, [-1])))

    def _peers_runs(self, rec: dict[str, Any], mgr: KVCacheTransferManager,
                    pool: KVCacheBlockPool, src: np.ndarray, same: Callable[..., bool]) -> None:
        """The manager's rows with the host rows in runs (module docstring): staged onboards,
        then the same with the staging off, then offloads."""
        rows = rows_in_runs(self.rng, len(src), pool.num_secondary_blocks)

        def run(off: bool) -> Callable[[], None]:
            def go() -> None:
                (mgr.offload_indices(src, rows) if off else mgr.onboard_indices(rows, src))
                mgr.sync_transfers()
            return go

        check = lambda: same(pool.primary, src, pool.secondary, rows)
        self._peers_row(rec, "manager_runs", "h2d", run(False), check)
        with onboard_staging(0):
            self._peers_row(rec, "manager_runs_unstaged", "h2d", run(False), check)
        self._peers_row(rec, "manager_runs", "d2h", run(True),
                        lambda: same(pool.secondary, rows, pool.primary, src))

    def _peers_torch(self, rec: dict[str, Any], torch: Any, cudart: Any, pool_n: int,
                     src: np.ndarray, dst: np.ndarray) -> None:
        n, row = len(src), rec["block_bytes"] // 2
        dev = torch.device("cuda", getattr(self.dev, "local_hardware_id", None) or 0)
        g = torch.randint(0, 1 << 14, (pool_n, row), dtype=torch.int16, device=dev)
        h = torch.empty((pool_n, row), dtype=torch.int16, pin_memory=True)
        packed = torch.empty((n, row), dtype=torch.int16, pin_memory=True)
        si_d = torch.from_numpy(src.astype(np.int64)).to(dev)
        sl, dl = src.tolist(), dst.tolist()

        def wait(f: Callable[[], Any]) -> Callable[[], None]:
            return lambda: (f(), torch.cuda.synchronize(dev))

        def per_blk(off: bool) -> None:
            for s, d in zip(sl, dl):
                (h[d].copy_(g[s], non_blocking=True) if off
                 else g[s].copy_(h[d], non_blocking=True))

        def same(a: Any, ai: list[int], b: Any, bi: list[int]) -> bool:
            return all(torch.equal(a[x].cpu(), b[y].cpu()) for x, y in ((ai[0], bi[0]),
                                                                         (ai[-1], bi[-1])))

        self._peers_row(rec, "torch_per_blk", "h2d", wait(lambda: per_blk(False)),
                        lambda: same(g, sl, h, dl))
        self._peers_row(rec, "torch_per_blk", "d2h", wait(lambda: per_blk(True)),
                        lambda: same(h, dl, g, sl))
        self._peers_row(rec, "torch_gather", "d2h", wait(lambda: packed.copy_(
            g.index_select(0, si_d), non_blocking=True)),
            lambda: torch.equal(packed[-1], g[sl[-1]].cpu()))
        self._peers_row(rec, "torch_gather", "h2d", wait(lambda: g.index_copy_(
            0, si_d, packed.to(dev, non_blocking=True))),
            lambda: torch.equal(packed[0], g[sl[0]].cpu()))
        if isinstance(cudart, str):
            return
        # a stream of its own: cudaMemcpyBatchAsync refuses the legacy default stream, which
        # is torch's current one (cudaErrorInvalidValue on the H200)
        stream = torch.cuda.Stream(dev)
        for d in DIRS:
            pairs = [(g[s].data_ptr(), h[t].data_ptr()) for s, t in zip(sl, dl)]
            dsts, srcs = zip(*[(b, a) if d == "d2h" else (a, b) for a, b in pairs])
            self._peers_row(rec, "memcpy_batch", d,
                            wait(lambda dsts=dsts, srcs=srcs: memcpy_batch(
                                cudart, stream, list(dsts), list(srcs), rec["block_bytes"])),
                            lambda d=d: (same(h, dl, g, sl) if d == "d2h"
                                         else same(g, sl, h, dl)))


def memcpy_batch(cudart: Any, stream: Any, dsts: list[int], srcs: list[int],
                 nbytes: int) -> None:
    """One cudaMemcpyBatchAsync of len(dsts) copies of nbytes on `stream` (a torch stream, not
    the legacy default one), the sources read in stream order (one attribute for the whole
    batch)."""
    attr = cudart.cudaMemcpyAttributes()
    attr.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    res = cudart.cudaMemcpyBatchAsync(dsts, srcs, [nbytes] * len(dsts), len(dsts), [attr], [0],
                                      1, cudart.cudaStream_t(stream.cuda_stream))
    err = res[0] if isinstance(res, tuple) else res
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemcpyBatchAsync returned {res}")


def _optional(module: str) -> Any:
    """The module, or the import error's text (a str) where it is missing."""
    try:
        return __import__(module, fromlist=["_"])
    except Exception as e:  # noqa: BLE001
        return err_text(e)


def peers_summary(sec: dict[str, Any]) -> list[str]:
    """One table (rows: mechanisms; columns: case x direction; GB/s and % of the ceiling), then
    a line per case naming the best peer and our best row's ratio to it."""
    cases = {k: r for k, r in sec.items() if isinstance(r, dict) and "ceiling" in r}
    out = [f"peers: {n}" for n in sec.get("notes", [])]
    out += [f"peers {k}: {r['skipped']}" for k, r in sec.items()
            if isinstance(r, dict) and "skipped" in r]
    if not cases:
        return out
    cols = [(k, d) for k in cases for d in DIRS]
    out.append("peers, GB/s (% of one contiguous pinned copy, same run); d2h offload, h2d onboard")
    out.append(f"{'':22}" + "".join(f"{k + ' ' + d:>26}" for k, d in cols))
    out.append(f"{'ceiling':22}" + "".join(f"{cases[k]['ceiling'][d]:>20.1f}      "
                                            for k, d in cols))
    for row in ROWS:
        cells = []
        for k, d in cols:
            c = cases[k].get(row, {}).get(d)
            cells.append("-" if c is None else "FAILED" if "error" in c else
                         f"{c['gbps']:.1f} ({c['ratio']:.0%})"
                         + ("" if c.get("verified", True) else " BAD"))
        if any(c != "-" for c in cells):
            out.append(f"{row:22}" + "".join(f"{c:>26}" for c in cells))
    for row in ROWS:
        for k, d in cols:
            c = cases[k].get(row, {}).get(d)
            if c is not None and "error" in c:
                out.append(f"peers {row} {k} {d} failed: {c['error'][:200]}")
    for k, d in cols:
        gb = {row: cases[k][row][d]["gbps"] for row in ROWS
              if "gbps" in cases[k].get(row, {}).get(d, {})}
        ours = max((gb[r], r) for r in OURS if r in gb) if any(r in gb for r in OURS) else None
        peer = max(((v, r) for r, v in gb.items() if r not in OURS), default=None)
        if ours and peer:
            out.append(f"peers {k} {d}: best peer {peer[1]} {peer[0]:.1f} GB/s; ours "
                       f"({ours[1]}) {ours[0]:.1f} GB/s = {ours[0] / peer[0]:.2f}x of it")
    return out
