"""Where the manager's host time goes (issue 4, target 6): one 64-block transfer, step by step.

Per direction (64 blocks of 64 KiB, pools of 256 blocks; median over `--calls` calls, a sync
every 8 calls, none inside the timed call):
  - the manager's verb, with its plans in the pinned-host plan ring (the default) and with
    NumPy plans (the ring switched off): the A/B of jax_kvxfer/plan_ring.py;
  - the verb's stages (batch check, run split, the jitted dispatch, statistics);
  - the jitted dispatch alone with a NumPy plan, a device plan and a pinned_host plan (as the
    ring passes it), and `jax.device_put` of a plan alone;
  - the same pinned_host dispatch as the verb makes it, one difference at a time, since inside
    the verb it took twice its time alone: with the verb's static arguments (`whole`, `dma`),
    with a plan ring's slot written before each call, and after 150 us of Python work between
    calls (the verb's own share: it leaves the host's caches as a verb does) or of waiting
    (time for the previous call's work to finish, caches left alone).
Both manager variants' results are checked against NumPy.
With --trace, instead: the verb and the same dispatch alone, each for `--calls` calls under the
JAX profiler (which records Python functions and XLA's host work, the C++ dispatch included),
and per call the host events that took the most time on the calling thread, inclusive and
self (without nested events): where inside the verb the time goes that the dispatch alone
does not take.

    python scripts/profile_manager.py [--calls 200] [--trace]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx
from jax_kvxfer import manager as mgr
from jax_kvxfer.bench.core import traced_profile
from jax_kvxfer.bench.helpers import time_calls
from jax_kvxfer.ops import IndexFacts

BLOCKS, BATCH = 256, 64


def median_us(call: Callable[[int], Any], sync: Callable[[], Any], calls: int,
              before: Callable[[], Any] | None = None) -> float:
    """Median microseconds of call(i) after a warm-up; before(), untimed, ahead of each."""
    for i in range(32):
        call(i)
    sync()
    return statistics.median(time_calls(call, sync, calls, before)) * 1e6


def python_work(us: float) -> None:
    """About `us` microseconds of the kind of Python a verb runs (small objects, dicts)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        {i: (i, str(i)) for i in range(16)}


def waiting(us: float) -> None:
    """About `us` microseconds of waiting on the clock, which leaves the caches alone."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def make_pool(rng: np.random.Generator) -> kvx.KVCacheBlockPool:
    pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=4, size_per_head=64,
                                       tokens_per_block=32, dtype=jnp.bfloat16,
                                       num_primary_blocks=BLOCKS, num_secondary_blocks=BLOCKS)
    bits = rng.integers(0, 1 << 14, pool.primary.shape, np.uint16)
    pool.primary = jax.device_put(bits.view(jnp.bfloat16), pool.sharding("device"))
    return pool


def workload(to_primary: bool, rng: np.random.Generator) -> tuple[Any, ...]:
    """(pool, batches, pair_lists, plans, pinned_plans): 16 batches of BATCH index pairs, the
    same as KVCacheBlock pairs, as [3, BATCH] NumPy plans, and as the plan ring passes them
    (three int32 vectors in pinned_host memory; None where the backend has none)."""
    pool = make_pool(rng)
    batches = [(rng.permutation(BLOCKS)[:BATCH].astype(np.int32),
                rng.permutation(BLOCKS)[:BATCH].astype(np.int32)) for _ in range(16)]
    pair_lists = [[(kvx.KVCacheBlock(k, int(s), not to_primary),
                    kvx.KVCacheBlock(k, int(d), to_primary)) for k, (s, d) in enumerate(zip(si, di))]
                  for si, di in batches]
    plans = [np.stack([si, di, np.zeros_like(si)]) for si, di in batches]
    ring_sharding = mgr.PlanRing.sharding_for(pool.sharding("device"))
    pinned_plans = None if ring_sharding is None else [
        jax.block_until_ready(tuple(jax.device_put(row, ring_sharding) for row in p))
        for p in plans]
    return pool, batches, pair_lists, plans, pinned_plans


def direct_dispatch(pool: kvx.KVCacheBlockPool, to_primary: bool) -> Callable[..., None]:
    """dispatch(plan, **static): the manager's jitted copy alone, called as the verb calls it
    (the pool's arrays in and out, a donated token), without the verb's Python around it."""
    facts = IndexFacts(hazard_free=True, unique_dst=True)
    token = [jnp.zeros((1,), jnp.int32, device=pool.device)]

    def dispatch(plan: Any, **static: Any) -> None:
        dst, src = pool.current(to_primary, "t"), pool.current(not to_primary, "t")
        out, token[:] = mgr._copy_across((dst,), (src,), plan, tuple(token), facts=facts,
                                         mesh=None, specs=(None,), **static)
        if to_primary:
            pool._primary = out[0]
        else:
            pool._secondary = out[0]
    return dispatch


def profile(verb: str, to_primary: bool, calls: int, rng: np.random.Generator) -> None:
    pool, batches, pair_lists, plans, pinned_plans = workload(to_primary, rng)
    dev_plans = [jnp.asarray(p) for p in plans]
    results: dict[str, float] = {}

    for ring in (True, False):
        manager = kvx.KVCacheTransferManager([pool], plan_ring=ring)
        fn = getattr(manager, f"{verb}_blocks")
        src_np = kvx.to_numpy(pool.current(not to_primary, "t"))
        results[f"manager verb, {'plan ring' if ring else 'NumPy plans'}"] = median_us(
            lambda i, fn=fn: fn(pair_lists[i % 16]), manager.sync_transfers, calls)
        fn(pair_lists[5])
        manager.sync_transfers()
        got = kvx.to_numpy(pool.current(to_primary, "t"))
        si, di = batches[5]
        print(f"{verb:8} plan ring {ring}: copies correctly "
              f"{np.array_equal(got[di].view(np.uint16), src_np[si].view(np.uint16))}")

    direct = direct_dispatch(pool, to_primary)
    sync = kvx.KVCacheTransferManager([pool]).sync_transfers
    results["dispatch alone, NumPy plan"] = median_us(lambda i: direct(plans[i % 16]), sync,
                                                      calls)
    results["dispatch alone, device plan"] = median_us(lambda i: direct(dev_plans[i % 16]),
                                                       sync, calls)
    if pinned_plans is not None:  # what the ring's arguments cost the dispatch itself
        results["dispatch alone, pinned_host plan"] = median_us(
            lambda i: direct(pinned_plans[i % 16]), sync, calls)
        # as the verb makes it, one difference at a time
        verb_static = {"whole": True, "dma": (False,)}
        results["  ... with the verb's static arguments"] = median_us(
            lambda i: direct(pinned_plans[i % 16], **verb_static), sync, calls)
        ring = mgr.PlanRing(pinned_plans[0][0].sharding)

        def from_ring(i: int) -> None:
            slot = ring.next_slot(plans[0].shape[1])
            direct(slot.write(plans[i % 16]))
        results["  ... with a ring slot written first"] = median_us(
            from_ring, lambda: (sync(), ring.all_done()), calls)
        results["  ... after 150 us of Python (untimed)"] = median_us(
            lambda i: direct(pinned_plans[i % 16]), sync, calls, lambda: python_work(150.0))
        results["  ... after 150 us of waiting (untimed)"] = median_us(
            lambda i: direct(pinned_plans[i % 16]), sync, calls, lambda: waiting(150.0))
        results["150 us of Python work (check)"] = median_us(
            lambda i: python_work(150.0), lambda: None, min(calls, 64))
    results["device_put of a plan alone"] = median_us(
        lambda i: jax.device_put(plans[i % 16], pool.device), lambda: None, calls)
    for name, us in results.items():
        print(f"{verb:8} {name:40} {us:8.1f} us")

    # the verb again, with a clock around each stage
    manager = kvx.KVCacheTransferManager([pool])
    fn = getattr(manager, f"{verb}_blocks")
    stage_times: dict[str, list[float]] = {}

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                stage_times.setdefault(name, []).append(time.perf_counter() - t)
        return wrapper

    saved = {n: getattr(mgr, n) for n in ("check_batch", "split_runs", "_copy_across")}
    try:
        for n, f in saved.items():
            setattr(mgr, n, timed(n, f))
        manager._count = timed("_count", manager._count)
        verb_us = median_us(lambda i: fn(pair_lists[i % 16]), manager.sync_transfers, calls)
    finally:
        for n, f in saved.items():
            setattr(mgr, n, f)
    print(f"{verb:8} stages (median us): verb {verb_us:.1f}; "
          + "; ".join(f"{n} {statistics.median(v) * 1e6:.1f}" for n, v in stage_times.items()))


def host_events(profile: Any) -> tuple[dict[str, int], dict[str, int],
                                        collections.Counter[str]]:
    """(inclusive ns, self ns, count) per event name on the host thread that ran the timed
    calls (the line holding `time_calls`; its name differs between machines); an event's self
    time leaves out the events nested in it (same thread, within its span)."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for plane in profile.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if not any("time_calls" in e.name for e in line.events):
                continue
            stack: list[tuple[int, str]] = []  # (end_ns, name) of the enclosing events
            for start, neg_dur, name in sorted((e.start_ns, -e.duration_ns, e.name)
                                               for e in line.events):
                dur = -neg_dur
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:  # nested: its time is not its parent's own
                    own[stack[-1][1]] -= dur
                incl[name] += dur
                own[name] += dur
                count[name] += 1
                stack.append((start + dur, name))
    return dict(incl), dict(own), count


def trace(verb: str, to_primary: bool, calls: int, rng: np.random.Generator) -> None:
    """The verb and the dispatch alone under the profiler; the top host events per call."""
    pool, _, pair_lists, plans, pinned_plans = workload(to_primary, rng)
    manager = kvx.KVCacheTransferManager([pool])
    fn = getattr(manager, f"{verb}_blocks")
    plan_args = plans if pinned_plans is None else pinned_plans
    dispatch = direct_dispatch(pool, to_primary)

    def direct(i: int) -> None:  # with the verb's static arguments
        dispatch(plan_args[i % 16], whole=True, dma=(False,))

    variants = {"verb": lambda i: fn(pair_lists[i % 16]), "dispatch alone": direct}
    for name, call in variants.items():
        for i in range(32):  # warm-up
            call(i)
        manager.sync_transfers()
        wall: list[float] = []
        profile = traced_profile(lambda call=call, wall=wall: wall.extend(
            time_calls(call, manager.sync_transfers, calls)))
        if profile is None:
            print(f"{verb:8} {name}: no trace written")
            continue
        incl, own, count = host_events(profile)
        if not incl:
            lines = [f"{p.name}: {ln.name}" for p in profile.planes for ln in p.lines]
            print(f"{verb:8} {name}: no host line holds the timed calls; lines: {lines[:20]}")
            continue
        print(f"{verb:8} {name}: {statistics.median(wall) * 1e6:.1f} us per call (median, "
              f"under the profiler); top host events per call, inclusive / self us:")
        for ev, ns in sorted(incl.items(), key=lambda kv: -kv[1])[:28]:
            if "start_trace" in ev or "stop_trace" in ev:
                continue
            print(f"{verb:8}   {ns / calls / 1e3:8.1f} {own[ev] / calls / 1e3:8.1f} "
                  f"x{count[ev] / calls:4.1f}  {ev[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--trace", action="store_true",
                    help="the verb and the dispatch alone under the profiler (host events)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}; {BATCH} blocks of 64 KiB per transfer")
    rng = np.random.default_rng(0)
    for verb, to_primary in (("offload", False), ("onboard", True)):
        (trace if args.trace else profile)(verb, to_primary, args.calls, rng)


if __name__ == "__main__":
    main()
