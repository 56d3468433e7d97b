"""The manager section: the transfer manager's verbs at real models' block geometries.

Per geometry (GEOMETRIES: Llama-3.1-8B's blocks of 16 tokens, 32 layers x K/V x 8 heads x 128
in bf16 = 2 MiB, 256 a batch; one layer of it, 64 KiB, 1,024 a batch), a pool of as many primary
and secondary blocks and random slots:
  offload_blocks / onboard_blocks (block pairs) and offload_indices / onboard_indices (slot
  arrays), each then `sync_transfers()`: GB/s and % of one contiguous copy of the same bytes
  (same run); `returns_s`, when the call returned to Python;
  call_64_us: how long a 64-pair `offload_blocks` takes to return (a sync after each, untimed),
  over batches of 50 to 64 random pairs; `compiles`: XLA compilations while it was timed (0:
  no recompiles).
And first, a manager call's fixed cost (`fixed_cost`): ONE block (2 MiB, the Llama geometry, on
a GPU; one layer of it, 64 KiB, on the CPU and with --quick) through `offload_indices` /
`onboard_indices`, each followed by the wait for it (`sync_transfers()`), beside what the
manager stands on, on the same device and blocks: the bare jitted `copy_blocks` of that block
each way (the copy engines with indices in pinned_host memory, as the lanes take them, and the
kernel with indices on the device), each waited for, and a jitted no-op, waited for; and the
time the block's bytes take at this run's memcpy ceiling (`memcpy_us`). The cases take turns
sample by sample (drift touches all alike); median, min and max microseconds of the samples
after the warm-up ones; every copy checked against a shadow of which block each slot holds.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from typing import Any

import jax
import numpy as np

from .. import KVCacheBlock, KVCacheBlockPool, KVCacheTransferManager, copy_blocks
from .config import DTYPE, fmt_size
from .helpers import COMPILES, by_own_time, err_text, median

GEOMETRY = {"num_kv_heads": 8, "size_per_head": 128, "tokens_per_block": 16}
GEOMETRIES = (("Llama-3.1-8B", 32, 256), ("one layer of it", 1, 1024))  # name, layers, blocks
FIXED_COST_ROUNDS = {True: (5, 60), False: (50, 500)}  # --quick: (warm-up, timed) samples a case


def pairs(src: Any, dst: Any, from_primary: bool) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
    return [(KVCacheBlock(i, int(s), from_primary), KVCacheBlock(i, int(d), not from_primary))
            for i, (s, d) in enumerate(zip(src, dst))]


class ManagerMixin:
    def run_manager(self, sec: dict[str, Any]) -> None:
        fixed = sec["fixed_cost"] = {}  # first: the deadline never skips it
        try:
            self._fixed_cost(fixed)
        except Exception as e:  # noqa: BLE001 - the geometries go on
            fixed["error"] = err_text(e)
            self.log(f"manager call fixed cost: ERROR {fixed['error'][:300]}")
        self.save()
        for name, layers, nb in GEOMETRIES:
            if self.cfg.quick:
                name, layers, nb = (name, layers, 64) if layers < 2 else (
                    f"{name} with 2 layers (--quick)", 2, 64)
            pool = KVCacheBlockPool.create(num_layers=layers, **GEOMETRY, dtype=DTYPE,
                                           num_primary_blocks=nb, num_secondary_blocks=nb,
                                           device=self.dev)
            rec = sec[f"{nb} x {fmt_size(pool.block_nbytes)}"] = {
                "model": name, "layers": layers, "blocks": nb, "block_bytes": pool.block_nbytes}
            if self.past_deadline():
                rec["skipped"] = "past the deadline"
                continue
            self._manager_case(pool, rec)
            self.save()

    def _fixed_cost(self, rec: dict[str, Any]) -> None:
        """One block's manager calls beside the bare copies and a no-op (the module says how)."""
        big = self.backend == "gpu" and not self.cfg.quick
        (name, layers, _), nb = GEOMETRIES[0 if big else 1], 8
        pool = KVCacheBlockPool.create(num_layers=layers, **GEOMETRY, dtype=DTYPE,
                                       num_primary_blocks=nb, num_secondary_blocks=nb,
                                       device=self.dev)
        shape = pool.primary.shape
        pool.primary = self.random_pool(shape, pool.sharding("device"))
        pool.secondary = self.random_pool(shape, pool.sharding("pinned_host"))
        rec.update(model=name, layers=layers, block_bytes=pool.block_nbytes)
        ceil = self.ceiling(pool.block_nbytes)
        rec["memcpy_us"] = {d: pool.block_nbytes / ceil[d] / 1e3 for d in ("d2h", "h2d")}
        # the bare copies' own arrays; `held` maps (array, slot) to the (array, slot) whose
        # first contents it holds now
        arrays = {"primary": lambda: pool.primary, "secondary": lambda: pool.secondary}
        bare = {"dev": self.random_pool(shape, self.dsh), "host": self.random_pool(shape, self.hsh)}
        arrays.update({k: (lambda k=k: bare[k]) for k in bare})
        first = {k: self.fetch(get(), np.arange(nb)) for k, get in arrays.items()}
        held = {(k, i): (k, i) for k in arrays for i in range(nb)}
        cases = self._fixed_cost_cases(KVCacheTransferManager([pool]), bare, held, nb)
        warmup, timed = FIXED_COST_ROUNDS[bool(self.cfg.quick)]
        samples: dict[str, list[tuple[float, float | None]]] = {k: [] for k in cases}
        compiles = COMPILES[0]
        for r in range(warmup + timed):
            if r == warmup:
                compiles = COMPILES[0]
            for case, sample in cases.items():  # one sample of each case in turn
                out = sample(r)
                if r >= warmup:
                    samples[case].append(out)
        rec.update(compiles=COMPILES[0] - compiles, warmup=warmup, samples=timed)
        for case, xs in samples.items():
            us = [1e6 * total for total, _ in xs]
            rec[case] = {"median_us": median(us), "min_us": min(us), "max_us": max(us)}
            if xs[0][1] is not None:
                rec[case]["returns_median_us"] = median([1e6 * x for _, x in xs])
        rec["profile"] = call_profile(cases["offload"], warmup + timed, rounds=50)
        rec["verified"] = all(
            np.array_equal(self.fetch(get(), np.arange(nb)),
                           np.stack([first[k][i] for k, i in (held[(a, j)] for j in range(nb))]))
            for a, get in arrays.items())
        self.log("manager " + fixed_cost_line(rec))
        self.log("manager " + profile_line(rec["profile"]))

    def _fixed_cost_cases(self, mgr: KVCacheTransferManager, bare: dict[str, jax.Array],
                          held: dict[tuple[str, int], tuple[str, int]], nb: int
                          ) -> dict[str, Any]:
        """name -> sample(round): one timed call and its wait, (seconds, seconds until the
        call returned or None); each records what it moved in `held`. Sample r copies slot
        r % nb into slot (3r + 1) % nb."""
        def pair(r: int) -> tuple[int, int]:
            return r % nb, (3 * r + 1) % nb

        def verb(offload: bool) -> Any:
            call = mgr.offload_indices if offload else mgr.onboard_indices
            src, dst = ("primary", "secondary") if offload else ("secondary", "primary")
            slots = [np.array([i]) for i in range(nb)]  # as an engine keeps its slot tables

            def sample(r: int) -> tuple[float, float]:
                s, d = pair(r)
                t0 = time.perf_counter()
                call(slots[s], slots[d])
                t1 = time.perf_counter()
                mgr.sync_transfers()
                t2 = time.perf_counter()
                held[(dst, d)] = held[(src, s)]
                return t2 - t0, t1 - t0
            return sample

        def copy(d2h: bool, dma: bool) -> Any:
            src, dst = ("dev", "host") if d2h else ("host", "dev")
            fn = jax.jit(lambda a, b, si, di: copy_blocks(a, b, si, di, dma=dma),
                         donate_argnums=0, out_shardings=self.hsh if d2h else self.dsh)
            idx = jax.block_until_ready([jax.device_put(np.array([i], np.int32),
                                                        self.hsh if dma else self.dsh)
                                         for i in range(nb)])

            def sample(r: int) -> tuple[float, None]:
                s, d = pair(r)
                t0 = time.perf_counter()
                bare[dst] = fn(bare[dst], bare[src], idx[s], idx[d])
                bare[dst].block_until_ready()
                held[(dst, d)] = held[(src, s)]
                return time.perf_counter() - t0, None
            return sample

        noop, box = jax.jit(lambda x: x, donate_argnums=0), [jax.device_put(np.zeros(1), self.dsh)]

        def no_op(r: int) -> tuple[float, None]:
            t0 = time.perf_counter()
            box[0] = noop(box[0])
            box[0].block_until_ready()
            return time.perf_counter() - t0, None

        return {"offload": verb(True), "onboard": verb(False),
                "copy_blocks_d2h_dma": copy(True, True), "copy_blocks_h2d_dma": copy(False, True),
                "copy_blocks_d2h_kernel": copy(True, False),
                "copy_blocks_h2d_kernel": copy(False, False), "noop": no_op}

    def _manager_case(self, pool: KVCacheBlockPool, rec: dict[str, Any]) -> None:
        nb = pool.num_primary_blocks
        pool.primary = self.random_pool(pool.primary.shape, pool.sharding("device"))
        pool.secondary = self.random_pool(pool.secondary.shape, pool.sharding("pinned_host"))
        mgr = KVCacheTransferManager([pool])
        total = nb * pool.block_nbytes
        ceil = rec["ceiling"] = self.ceiling(total)
        a, b = self.perms(1, nb)[0], self.perms(1, nb)[0]
        ends = [0, nb - 1]
        onboards, offloads = pairs(b, a, False), pairs(a, b, True)  # made before the timing
        # onboard first: the host pool holds other data than the device pool's blocks
        for verb, call in (("onboard_blocks", lambda: mgr.onboard_blocks(onboards)),
                           ("onboard_indices", lambda: mgr.onboard_indices(b, a)),
                           ("offload_blocks", lambda: mgr.offload_blocks(offloads)),
                           ("offload_indices", lambda: mgr.offload_indices(a, b))):
            returns: list[float] = []

            def run(call: Any = call, returns: list[float] = returns) -> None:
                t = time.perf_counter()
                call()
                returns.append(time.perf_counter() - t)
                mgr.sync_transfers()

            gbps = total / self.timed(run) / 1e9
            on = verb.startswith("on")
            dst, src = (pool.primary, pool.secondary) if on else (pool.secondary, pool.primary)
            ok = np.array_equal(self.fetch(dst, (a if on else b)[ends]),
                                self.fetch(src, (b if on else a)[ends]))
            rec[verb] = {"gbps": gbps, "ratio": gbps / ceil["h2d" if on else "d2h"],
                         "returns_s": median(returns[-self.cfg.repeats:]), "verified": bool(ok)}
        # a 64-pair call's host time, over batches of 50..64 random pairs (several sizes)
        batches = [pairs(*self.perms(2, 48 + 2 * i if i % 2 else 64, nb), True) for i in range(8)]
        for i in range(2 * len(batches)):  # warm-up: every batch twice
            mgr.offload_blocks(batches[i % len(batches)])
        mgr.sync_transfers()
        compiles, times = COMPILES[0], []
        for i in range(48):
            t = time.perf_counter()
            mgr.offload_blocks(batches[i % len(batches)])
            times.append(time.perf_counter() - t)
            mgr.sync_transfers()  # the next call finds no copy queued
        rec["call_64_us"], rec["compiles"] = 1e6 * median(times), COMPILES[0] - compiles
        self.log("manager " + manager_line(rec))


def manager_line(r: dict[str, Any]) -> str:
    verbs = [v for v in ("offload_blocks", "onboard_blocks", "offload_indices", "onboard_indices")
             if v in r]
    return (f"{r['blocks']} x {fmt_size(r['block_bytes'])} ({r['model']}), + sync, % of a "
            f"contiguous copy ({r['ceiling']['d2h']:.1f} / {r['ceiling']['h2d']:.1f} GB/s): "
            + ", ".join(f"{v} {r[v]['gbps']:.1f} GB/s {r[v]['ratio']:.0%}"
                        + ("" if r[v]["verified"] else " VERIFY FAILED") for v in verbs)
            + "; returns after " + " / ".join(f"{r[v]['returns_s'] * 1e3:.2f}" for v in verbs)
            + f" ms; a 64-pair offload_blocks returns in {r['call_64_us']:.0f} us, "
            f"{r['compiles']} compiles")


def call_profile(sample: Any, first_round: int, rounds: int, top: int = 8) -> dict[str, Any]:
    """Where a sampled call's host time goes: `rounds` samples (from round `first_round`) under
    cProfile; the functions of most own time (us a call), and the Python functions of the jax
    package called a call (JAX's jitted dispatch is C++ once warm: a Python function of its
    dispatch here is a fast path missed)."""
    prof = cProfile.Profile()
    prof.enable()
    for r in range(first_round, first_round + rounds):
        sample(r)
    prof.disable()
    jax_calls = sorted(((nc / rounds, name) for (fn, _, name), (_, nc, _, _, _)
                        in pstats.Stats(prof).stats.items() if f"{os.sep}jax{os.sep}" in fn),
                       reverse=True)
    return {"rounds": rounds,
            "own_us": [{"function": fn, "us": 1e6 * tt / rounds}
                       for fn, _, tt in by_own_time(prof, top)],
            "jax_python_calls": [{"function": name, "calls": n} for n, name in jax_calls]}


def profile_line(p: dict[str, Any]) -> str:
    top = ", ".join(f"{e['function']} {e['us']:.1f}" for e in p["own_us"][:6])
    jax_calls = ", ".join(f"{e['function']} x{e['calls']:.0f}"
                          for e in p["jax_python_calls"][:6]) or "none"
    return (f"offload_indices + sync under cProfile ({p['rounds']} calls): own time, us a call: "
            f"{top}; jax's Python functions a call: {jax_calls}")


def fixed_cost_line(r: dict[str, Any]) -> str:
    def us(case: str) -> str:
        x = r[case]
        return f"{x['median_us']:.0f} ({x['min_us']:.0f}-{x['max_us']:.0f})"

    def pair(how: str) -> str:
        return f"{us(f'copy_blocks_d2h_{how}')} / {us(f'copy_blocks_h2d_{how}')}"

    return (f"call fixed cost, one {fmt_size(r['block_bytes'])} block ({r['model']}), us, median "
            f"(min-max) of {r['samples']} after {r['warmup']}: offload_indices + sync "
            f"{us('offload')}, returns after {r['offload']['returns_median_us']:.0f}; "
            f"onboard_indices + sync {us('onboard')}, returns after "
            f"{r['onboard']['returns_median_us']:.0f}; bare jitted copy_blocks + wait, d2h / "
            f"h2d: dma=True {pair('dma')}, dma=False {pair('kernel')}; jitted no-op + wait "
            f"{us('noop')}; the block alone at the memcpy ceiling {r['memcpy_us']['d2h']:.0f} / "
            f"{r['memcpy_us']['h2d']:.0f}; {r['compiles']} compiles"
            + ("" if r["verified"] else "; VERIFY FAILED"))


def manager_summary(sec: dict[str, Any]) -> list[str]:
    fixed = sec.get("fixed_cost", {})
    first = ([f"manager {fixed_cost_line(fixed)}"] if "verified" in fixed else
             [f"manager call fixed cost: ERROR {fixed['error'][:300]}"] if "error" in fixed
             else [])
    if "profile" in fixed:
        first.append(f"manager {profile_line(fixed['profile'])}")
    return first + [
        f"manager {r.get('skipped') or manager_line(r)}" for r in sec.values()
        if isinstance(r, dict) and ("skipped" in r or "call_64_us" in r)]
