#!/usr/bin/env python3
"""Stress run of the KV-cache transfer manager against a NumPy shadow.

Random onboard / offload / partial / batched (with repeated indices; onboards mixing host ->
GPU and GPU -> GPU pairs) / user write (donated, and non-donated: a new array assigned back) /
sync operations over two pools of one manager that differ in head count, dtype and kv_factor. At every sync the pools are compared bitwise with a NumPy shadow of both pools, the
manager's `pending_transfers` and transfer statistics are checked against the operations issued,
and the memory in use is sampled: live jax arrays (`jax.live_arrays()`), their bytes by memory
kind, and the device allocator's `bytes_in_use` where the backend reports it. After a warm-up
(every bucket size and dispatch variant compiled) none of these may grow.

    python scripts/stress.py            # 100,000 operations (the GPU run; under 3 min on an H200)
    python scripts/stress.py --quick    # 5,000 operations (CI, CPU, ~5 s)

The last line printed is a one-line summary; the exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx
from jax_kvxfer import testing

QUICK_OPS = 5_000
FULL_OPS = 100_000

# Memory growth allowed after warm-up (noise, not leaks: a leak grows with the op count).
LIVE_ARRAY_SLACK = 2
BYTES_SLACK = 1 << 20  # plus 1 % of the baseline


@dataclass
class Config:
    ops: int
    seed: int
    num_primary: int = 24
    num_secondary: int = 32
    tokens_per_block: int = 16
    max_batch: int = 12
    sync_every: tuple[int, int] = (50, 200)  # a sync after a random number of ops in this range
    warmup_syncs: int = 4
    fail_fast: bool = False
    verbose: bool = False
    dma: bool = False  # the manager's host transfers on the copy engines


def make_pools(cfg: Config, rng: np.random.Generator) -> list[kvx.KVCacheBlockPool]:
    """Two pools of one manager: different head counts, dtypes, kv_factor and row alignment."""
    common = {"tokens_per_block": cfg.tokens_per_block, "num_primary_blocks": cfg.num_primary,
              "num_secondary_blocks": cfg.num_secondary}
    pools = [
        # 64 bf16 per head: 128-byte token rows (16-byte vector copies on the GPU).
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=4, size_per_head=64,
                                    dtype=jnp.bfloat16, **common),
        # 12 uint8 per head, K only: 12-byte rows (4-byte copies), a different head count.
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=2, size_per_head=12,
                                    dtype=jnp.uint8, kv_factor=1, **common),
    ]
    for pool in pools:
        pool.primary = jax.device_put(random_bits(rng, pool.primary.shape, pool.dtype),
                                      pool.primary.sharding)
        pool.secondary = jax.device_put(random_bits(rng, pool.secondary.shape, pool.dtype),
                                        pool.secondary.sharding)
    return pools


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Random bit patterns; for floats without NaN/inf: the user's own jitted step (XLA, not
    jax_kvxfer) may rewrite NaN payloads anywhere in the arrays it updates."""
    dtype = np.dtype(dtype)
    x = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(
        dtype).reshape(shape)
    if jnp.issubdtype(dtype, jnp.floating):
        x[~np.isfinite(x.astype(np.float32))] = 0
    return x


def read_back(x: jax.Array) -> np.ndarray:
    """The array's contents, via a fresh device copy: `np.asarray` on the pool array itself
    would leave JAX a NumPy view of it (on GPUs, of a pinned_host array), and a viewed array
    cannot be donated: the manager would take its copying fallback, not the in-place path."""
    return np.asarray(jax.device_put(x, x.sharding.with_memory_kind("device"), may_alias=False))


def as_u8(x: np.ndarray) -> np.ndarray:
    """Raw bytes, one row per block: bitwise comparison (NaN bit patterns included)."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(x.shape[0], -1)


# The user's own jitted step: overwrite one primary block in place (donated), no sync.
def _user_write(pool, index, value):
    return pool.at[index].set(value)


_user_write_donated = jax.jit(_user_write, donate_argnums=0)
_user_write_new_array = jax.jit(_user_write)  # another buffer, as `pool.primary.at[i].set(x)`


@dataclass
class MemorySample:
    live_arrays: int
    live_bytes: dict[str, int]
    bytes_in_use: int | None


def sample_memory(manager: kvx.KVCacheTransferManager, collect: bool = False) -> MemorySample:
    """Live arrays and bytes now. Arrays are freed by reference counting the moment the last
    reference goes; `collect` also runs the cycle collector (30 ms: only when needed).

    The manager's plan ring (jax_kvxfer/transfer/_plan_ring.py) is left out: a bounded set of
    small pinned-host arrays, 16 per batch bucket, allocated when a bucket is first used."""
    if collect:
        gc.collect()
    plans = testing.plan_ring(manager)
    ring = {id(a) for a in plans.arrays()} if plans is not None else set()
    arrays = [a for a in jax.live_arrays() if id(a) not in ring]
    by_kind: Counter[str] = Counter()
    for a in arrays:
        by_kind[a.sharding.memory_kind or "device"] += a.nbytes
    in_use = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats raise various errors
        stats = None
    if stats and "bytes_in_use" in stats:
        in_use = int(stats["bytes_in_use"])
    return MemorySample(len(arrays), dict(by_kind), in_use)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class Run:
    cfg: Config
    rng: np.random.Generator
    pools: list[kvx.KVCacheBlockPool]
    manager: kvx.KVCacheTransferManager
    shadow: list[list[np.ndarray]]  # per pool: [primary, secondary]
    ops_done: int = 0
    pairs_done: int = 0
    syncs: int = 0
    mismatches: int = 0  # blocks that differed from the shadow, over all syncs
    bookkeeping_errors: int = 0
    log: list[str] = field(default_factory=list)  # the ops since the last sync
    pending: dict = field(default_factory=dict)  # expected pending_transfers: slot -> [r, w, ops]
    stats: Counter = field(default_factory=Counter)  # expected transfer stats
    samples: list[MemorySample] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # op kinds issued

    # -- random operations ----------------------------------------------------------------

    def pair(self, verb: str, hot: list[int] | None = None) -> tuple[kvx.KVCacheBlock, ...]:
        """A pair the verb takes: an offload's GPU -> host, an onboard's host -> GPU or (the
        partial-reuse copy) GPU -> GPU."""
        if verb.startswith("offload"):
            return self.block(True, hot), self.block(False, hot)
        return self.block(bool(self.rng.random() < 0.3), hot), self.block(True, hot)

    def block(self, primary: bool, hot: list[int] | None = None) -> kvx.KVCacheBlock:
        limit = self.cfg.num_primary if primary else self.cfg.num_secondary
        if hot is not None and self.rng.random() < 0.6:  # repeats within one batch
            index = int(hot[int(self.rng.integers(len(hot)))]) % limit
        else:
            index = int(self.rng.integers(limit))
        return kvx.KVCacheBlock(block_id=int(self.rng.integers(1 << 20)),
                                memory_pool_block_index=index, is_primary=primary)

    def tokens(self) -> int:
        t = self.cfg.tokens_per_block
        return int(self.rng.choice([-1, 0, 0, 1, 2, t // 2, t - 1, t, t + 3]))

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.04:
            self.user_write(donated=r < 0.02)
            return
        if r < 0.1:
            self.offload_and_onboard()
            return
        if r < 0.45:
            verb = "offload" if self.rng.random() < 0.5 else "onboard"
            pairs, tokens = [self.pair(verb)], [self.tokens()]
            getattr(self.manager, verb)(*pairs[0], num_tokens=tokens[0])
            self.counts[verb] += 1
        else:
            hot = [int(i) for i in self.rng.integers(0, 1 << 16, 3)]
            verb = "offload_blocks" if self.rng.random() < 0.5 else "onboard_blocks"
            pairs = [self.pair(verb, hot)
                     for _ in range(int(self.rng.integers(1, self.cfg.max_batch + 1)))]
            form = self.rng.random()
            if form < 0.2:
                tokens, arg = [0] * len(pairs), None
            elif form < 0.4:
                n = self.tokens()
                tokens, arg = [n] * len(pairs), n
            else:
                tokens = [self.tokens() for _ in pairs]
                arg = tokens if self.rng.random() < 0.5 else np.asarray(tokens, np.int64)
            getattr(self.manager, verb)(pairs, num_tokens=arg)
            self.counts[verb] += 1
        self.apply(verb, pairs, tokens)

    def offload_and_onboard(self) -> None:
        """Evictions and reuses in one call; primary blocks and secondary slots drawn from a
        few, so that an onboard often reuses an evicted block or reads a slot just written."""
        cfg = self.cfg
        hot_p = self.rng.integers(cfg.num_primary, size=4)
        hot_s = self.rng.integers(cfg.num_secondary, size=4)

        def blk(hot, primary):
            return kvx.KVCacheBlock(block_id=int(self.rng.integers(1 << 20)),
                                    memory_pool_block_index=int(self.rng.choice(hot)),
                                    is_primary=primary)

        n_off, n_on = (int(self.rng.integers(0, cfg.max_batch + 1)) for _ in range(2))
        off = [(blk(hot_p, True), blk(hot_s, False)) for _ in range(n_off)]
        on = [(blk(hot_s, False), blk(hot_p, True)) for _ in range(n_on)]
        off_tokens = [self.tokens() for _ in off]
        on_tokens = [self.tokens() for _ in on]
        self.manager.offload_and_onboard(off, on, off_tokens, on_tokens)
        self.counts["offload_and_onboard"] += 1
        for verb, pairs, tokens in (("offload_blocks", off, off_tokens),
                                    ("onboard_blocks", on, on_tokens)):
            if pairs:
                self.apply(verb, pairs, tokens)

    def apply(self, verb: str, pairs, tokens) -> None:
        """The shadow, pending records and stats: the pairs one after another, in order."""
        op = verb.removesuffix("_blocks")
        t = self.cfg.tokens_per_block
        for (src, dst), n in zip(pairs, tokens):
            n_eff = t if (n <= 0 or n >= t) else n
            for pool, arrays in zip(self.pools, self.shadow):
                s = arrays[0 if src.is_primary else 1]
                d = arrays[0 if dst.is_primary else 1]
                d[dst.memory_pool_block_index, ..., :n_eff, :] = (
                    s[src.memory_pool_block_index, ..., :n_eff, :].copy())
                kind = ("offloaded" if src.is_primary and not dst.is_primary else
                        "onboarded" if dst.is_primary and not src.is_primary else "copied")
                self.stats[f"{kind}_bytes"] += pool.token_run_nbytes(n)
            self.stats[f"{kind}_blocks"] += 1
            for slot, is_write in ((src.slot, False), (dst.slot, True)):
                rec = self.pending.setdefault(slot, [0, 0, []])
                rec[1 if is_write else 0] += 1
                rec[2].append(op)
            self.log.append(f"{verb} {src.slot}->{dst.slot} n={n}")
        self.ops_done += 1
        self.pairs_done += len(pairs)

    def user_write(self, donated: bool) -> None:
        """User code overwrites any primary block right away, between transfers: in place
        (donated), or as JAX's ordinary functional update whose new array is assigned back.
        Reading `pool.primary` orders the update after the onboards in flight, so it may be a
        block an onboard writes, or an offload's source."""
        index = int(self.rng.integers(self.cfg.num_primary))
        write = _user_write_donated if donated else _user_write_new_array
        for pool, arrays in zip(self.pools, self.shadow):
            value = random_bits(self.rng, pool.block_shape, pool.dtype)
            pool.primary = write(pool.primary, np.int32(index), value)
            arrays[0][index] = value
        kind = "user_write" if donated else "user_update"
        self.counts[kind] += 1
        self.log.append(f"{kind} primary[{index}]")
        self.ops_done += 1

    # -- checks -----------------------------------------------------------------------------

    def grew(self, sample: MemorySample) -> bool:
        return _grew(self.samples[min(self.cfg.warmup_syncs, len(self.samples) - 1)], sample)

    def check_bookkeeping(self) -> None:
        got = {slot: (p.reads, p.writes, p.ops) for slot, p in self.manager.pending_transfers.items()}
        want = {slot: (r, w, tuple(ops)) for slot, (r, w, ops) in self.pending.items()}
        if got != want:
            self.bookkeeping_errors += 1
            bad = sorted(set(got) ^ set(want)) or [s for s in want if got.get(s) != want[s]]
            print(f"  pending_transfers differ at sync {self.syncs}: slots {bad[:5]}")
        stats = self.manager.get_and_reset_transfer_stats()
        want_stats = kvx.TransferStats(**{k: self.stats[k] for k in (
            "onboarded_blocks", "onboarded_bytes", "offloaded_blocks", "offloaded_bytes",
            "copied_blocks", "copied_bytes")})
        if stats != want_stats:
            self.bookkeeping_errors += 1
            print(f"  transfer stats differ at sync {self.syncs}: {stats} != {want_stats}")
        self.pending.clear()
        self.stats.clear()

    def compare(self, p: int, m: int) -> int:
        """Blocks of pool p's primary (m=0) or secondary (m=1) that differ from the shadow."""
        pool, arrays = self.pools[p], self.shadow[p]
        got = read_back(pool.primary if m == 0 else pool.secondary)
        diff = np.flatnonzero(np.any(as_u8(got) != as_u8(arrays[m]), axis=1))
        if diff.size:
            print(f"  MISMATCH at sync {self.syncs} (op {self.ops_done}): pool {p} "
                  f"{('primary', 'secondary')[m]} blocks {diff[:10].tolist()}")
            arrays[m] = got.copy()  # resynchronise, so that one bug is reported once
        return int(diff.size)

    def sync_and_check(self) -> bool:
        self.check_bookkeeping()
        # half the syncs return at once (the GPU joins the lanes); reading back waits anyway
        self.manager.sync_transfers(block=bool(self.rng.random() < 0.5))
        self.syncs += 1
        if self.manager.pending_transfers:
            self.bookkeeping_errors += 1
            print(f"  pending_transfers not empty after sync {self.syncs}")
        bad_here = sum(self.compare(p, m) for p in range(len(self.pools)) for m in (0, 1))
        if bad_here:
            self.mismatches += bad_here
            print("  ops since the previous sync:\n    " + "\n    ".join(self.log[-40:]))
        self.log.clear()
        sample = sample_memory(self.manager, collect=self.syncs == self.cfg.warmup_syncs + 1)
        if self.samples and self.syncs > self.cfg.warmup_syncs + 1 and self.grew(sample):
            sample = sample_memory(self.manager, collect=True)  # growth or garbage? collect and look again
        self.samples.append(sample)
        if self.cfg.verbose:
            s = self.samples[-1]
            print(f"  sync {self.syncs}: op {self.ops_done}, live arrays {s.live_arrays}, "
                  f"bytes_in_use {fmt_bytes(s.bytes_in_use)}")
        return bad_here == 0 and self.bookkeeping_errors == 0


def _grew(base: MemorySample, s: MemorySample) -> bool:
    if s.live_arrays > base.live_arrays + LIVE_ARRAY_SLACK:
        return True
    if any(v > base.live_bytes.get(k, 0) * 1.01 + BYTES_SLACK for k, v in s.live_bytes.items()):
        return True
    return (base.bytes_in_use is not None and s.bytes_in_use is not None
            and s.bytes_in_use > base.bytes_in_use * 1.01 + BYTES_SLACK)


def memory_growth(samples: list[MemorySample], warmup: int) -> tuple[list[str], str]:
    """Growth of live arrays / bytes after warm-up beyond a small bound, and a summary text."""
    if not samples:
        return [], "live arrays n/a, bytes_in_use n/a"
    base = samples[min(warmup, len(samples) - 1)]
    after = samples[min(warmup, len(samples) - 1):]
    last = samples[-1]
    problems = []
    peak_live = max(s.live_arrays for s in after)
    if peak_live > base.live_arrays + LIVE_ARRAY_SLACK:
        problems.append(f"live arrays grew {base.live_arrays} -> {peak_live}")
    for kind in sorted(set().union(*(s.live_bytes for s in after))):
        b0 = base.live_bytes.get(kind, 0)
        peak = max(s.live_bytes.get(kind, 0) for s in after)
        if peak > b0 + BYTES_SLACK + b0 // 100:
            problems.append(f"live {kind} bytes grew {fmt_bytes(b0)} -> {fmt_bytes(peak)}")
    if base.bytes_in_use is not None:
        peak = max(s.bytes_in_use or 0 for s in after)
        if peak > base.bytes_in_use + BYTES_SLACK + base.bytes_in_use // 100:
            problems.append(f"bytes_in_use grew {fmt_bytes(base.bytes_in_use)} -> {fmt_bytes(peak)}")
    kinds = ", ".join(f"{k} {fmt_bytes(base.live_bytes.get(k, 0))}->{fmt_bytes(v)}"
                      for k, v in sorted(last.live_bytes.items()))
    text = (f"live arrays {base.live_arrays}->{last.live_arrays} ({kinds}), "
            f"bytes_in_use {fmt_bytes(base.bytes_in_use)}->{fmt_bytes(last.bytes_in_use)}")
    return problems, text


def run(cfg: Config) -> int:
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    pools = make_pools(cfg, rng)
    run = Run(cfg, rng, pools, kvx.KVCacheTransferManager(pools, dma=cfg.dma),
              [[read_back(p.primary).copy(), read_back(p.secondary).copy()] for p in pools])
    print(f"stress: {cfg.ops} ops, seed {cfg.seed}, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"CUDA handlers {kvx.HAS_CUDA_HANDLERS}, dma {cfg.dma}")
    for p in pools:
        print(f"  {p!r}")
    next_sync = int(rng.integers(*cfg.sync_every))
    ok = True
    while run.ops_done < cfg.ops:
        run.step()
        next_sync -= 1
        if next_sync <= 0 or run.ops_done >= cfg.ops:
            ok = run.sync_and_check() and ok
            next_sync = int(rng.integers(*cfg.sync_every))
            if not ok and cfg.fail_fast:
                break
    run.samples.append(sample_memory(run.manager, collect=True))  # the final state, garbage collected
    elapsed = time.perf_counter() - t0
    problems, memory_text = memory_growth(run.samples, cfg.warmup_syncs)
    for p in problems:
        print(f"  MEMORY GROWTH: {p}")
    print(f"  op mix: {dict(sorted(run.counts.items()))}; {run.pairs_done} pairs; "
          f"{elapsed:.1f} s ({run.ops_done / elapsed:,.0f} ops/s)")
    failed = run.mismatches or run.bookkeeping_errors or problems or run.ops_done < cfg.ops
    print(f"stress: {run.ops_done} ops, {run.syncs} syncs, {run.mismatches} mismatches, "
          f"{run.bookkeeping_errors} bookkeeping errors, {memory_text}, {elapsed:.0f} s: "
          f"{'FAILED' if failed else 'OK'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_OPS:,} operations (CI) instead of {FULL_OPS:,}")
    parser.add_argument("--ops", type=int, help="number of operations (overrides --quick)")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first bad sync")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per sync")
    parser.add_argument("--dma", action="store_true",
                        help="a manager made with dma=True (host transfers on the copy engines)")
    args = parser.parse_args(argv)
    ops = args.ops if args.ops is not None else (QUICK_OPS if args.quick else FULL_OPS)
    cfg = Config(ops=ops, seed=args.seed, fail_fast=args.fail_fast, verbose=args.verbose,
                 dma=args.dma)
    if args.quick and args.ops is None:
        cfg.sync_every = (30, 120)  # more syncs (and memory samples) in the short run
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
