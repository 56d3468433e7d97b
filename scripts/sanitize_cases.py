#!/usr/bin/env python3
"""Every code path of the CUDA block-copy handler, once each, checked bitwise.

Run under compute-sanitizer by scripts/sanitize.sh: memcheck then proves that no kernel reads or
writes outside the pools, the scratch buffers or the index vectors, also for deliberately
out-of-range traced indices (10**6, -5, int32 max/min); racecheck and synccheck check the
duplicate-scan kernel's shared-memory reduction; initcheck that no kernel reads memory nothing
wrote. Every input is made by `jax.device_put` from NumPy (a CUDA memcpy, which initcheck
tracks) and every jitted function holds nothing but the custom call, so the only device code
that runs is ours.

    python scripts/sanitize_cases.py                 # on a GPU
    python scripts/sanitize_cases.py --allow-cpu     # the same cases on the CPU handler
    python scripts/sanitize_cases.py --pytest "tests/ops/test_ops.py -k memory_kinds"  # then pytest

Paths covered: device<->pinned_host both ways, device->device, pinned_host->pinned_host;
whole and partial copies at every vector width the kernel picks (16, 8, 4 and 1 bytes, and
packed int4), with one run and with many (the warp-per-run partial path); duplicate
destinations (the superseded-token scan, also with more pairs than one CTA has threads) and
known-unique ones (no scan); one array as source and destination with a chain and duplicates
under jit with traced indices (the staged path) and eagerly with known indices (staged, and
hazard-free); padding; out-of-range traced indices; a single pair; an empty batch; pools of
zero blocks; large blocks (several CTAs per pair); many pairs; a non-donated destination;
partial_block_copy; the manager.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

CASES: list[tuple[str, Callable[[np.random.Generator], None]]] = []
OPTIONS = {"int4": True, "device_only": False}


def case(fn):
    CASES.append((fn.__name__, fn))
    return fn


def sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def kind_of(kind: str) -> str:
    return "device" if OPTIONS["device_only"] else kind


def put(x: np.ndarray, kind: str = "device") -> jax.Array:
    return jax.device_put(np.array(x, copy=True), sharding(kind_of(kind)))


def random_pool(rng, shape, dtype) -> np.ndarray:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(jnp.int4):
        return np.asarray(rng.integers(-8, 8, shape), dtype=dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def reference(dst, src, si, di, nt=None) -> np.ndarray:
    out, snap = dst.copy(), src.copy()
    t = dst.shape[4]
    nt = [0] * len(si) if nt is None else nt
    for s, d, n in zip(np.asarray(si).tolist(), np.asarray(di).tolist(), np.asarray(nt).tolist()):
        if 0 <= s < snap.shape[0] and 0 <= d < out.shape[0]:
            n = t if (n <= 0 or n >= t) else n
            out[d, ..., :n, :] = snap[s, ..., :n, :]
    return out


def check(got, expected, what: str) -> None:
    got = np.ascontiguousarray(np.asarray(got))
    expected = np.ascontiguousarray(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (
        f"{what}: {got.dtype}{got.shape} != {expected.dtype}{expected.shape}")
    if got.size and not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
        bad = np.flatnonzero(np.any(got.reshape(got.shape[0], -1).view(np.uint8)
                                    != expected.reshape(expected.shape[0], -1).view(np.uint8),
                                    axis=1))
        raise AssertionError(f"{what}: blocks {bad[:10].tolist()} differ from the reference")


def _copy(dst, src, si, di, nt):
    return kvx.copy_blocks(dst, src, si, di, nt)


def _intra(pool, si, di, nt):
    return kvx.copy_blocks(pool, pool, si, di, nt)


JIT = {
    "donated": jax.jit(_copy, donate_argnums=0),
    "kept": jax.jit(_copy),
    "intra_donated": jax.jit(_intra, donate_argnums=0),
    "intra_kept": jax.jit(_intra),
    "whole": jax.jit(lambda d, s, si, di: kvx.copy_blocks(d, s, si, di), donate_argnums=0),
    "partial": jax.jit(lambda d, s, n: kvx.partial_block_copy(d, s, n), donate_argnums=0),
}


def i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).clip(-2**31, 2**31 - 1).astype(np.int32)


def run_copy(rng, block, dtype, src_kind, dst_kind, si, di, nt, *, num_dst=6, num_src=6,
             jit="donated", what=""):
    dst = random_pool(rng, (num_dst, *block), dtype)
    src = random_pool(rng, (num_src, *block), dtype)
    si, di = i32(si), i32(di)
    if nt is None:  # whole blocks (num_tokens=None)
        nt = np.zeros(len(si), np.int32)
        out = JIT["whole"](put(dst, dst_kind), put(src, src_kind), si, di)
    else:
        nt = i32(nt)
        out = JIT[jit](put(dst, dst_kind), put(src, src_kind), si, di, nt)
    assert out.sharding.memory_kind == kind_of(dst_kind), (out.sharding, dst_kind)
    check(out, reference(dst, src, si, di, nt), what or f"{src_kind}->{dst_kind} {dtype}")


# ---------------------------------------------------------------------------------------------
# the cases

BLOCK = (2, 2, 2, 8, 16)  # [layers, kv, heads, tokens, size_per_head]
KINDS = [("device", "pinned_host"), ("pinned_host", "device"), ("device", "device"),
         ("pinned_host", "pinned_host")]


@case
def memory_kinds_whole_and_partial(rng):
    for src_kind, dst_kind in KINDS:
        run_copy(rng, BLOCK, jnp.float32, src_kind, dst_kind,
                 si=[0, 1, 2, 3, 4], di=[5, 4, 3, 0, 1], nt=[0, 3, 7, 8, -1])


@case
def every_vector_width(rng):
    # token rows of 64 (16-byte vectors), 8 (8-byte), 4 (4-byte), 3 (1-byte) and, packed int4,
    # 2 bytes; partial copies make runs of those sizes at a pitch of tokens * row.
    widths = [(jnp.float32, 16), (jnp.bfloat16, 4), (jnp.bfloat16, 2), (jnp.uint8, 3)]
    if OPTIONS["int4"]:
        widths.append((jnp.int4, 4))
    for dtype, size_per_head in widths:
        for src_kind, dst_kind in KINDS[:3]:
            run_copy(rng, (1, 2, 3, 5, size_per_head), dtype, src_kind, dst_kind,
                     si=[0, 1, 2, 3], di=[1, 2, 3, 4], nt=[1, 2, 4, 0],
                     what=f"{jnp.dtype(dtype).name} x{size_per_head} {src_kind}->{dst_kind}")


@case
def odd_int4_rows_whole_blocks(rng):
    if OPTIONS["int4"]:
        run_copy(rng, (1, 2, 1, 4, 3), jnp.int4, "device", "pinned_host",
                 si=[0, 1], di=[2, 2], nt=None)


@case
def duplicate_destinations(rng):
    # 40 pairs onto 3 blocks, whole and partial: the later pair wins on the tokens it writes
    # (found by the duplicate-scan kernel before the copy).
    n = 40
    si = rng.permutation(48)[:n]
    di = rng.choice([0, 1, 2], n)
    nt = rng.choice([0, -1, 1, 3, 7, 8, 12], n)
    for src_kind, dst_kind in KINDS[:3]:
        run_copy(rng, BLOCK, jnp.bfloat16, src_kind, dst_kind, si, di, nt, num_dst=4, num_src=48)
        # without num_tokens: the host tells the kernel every pair copies a whole block
        run_copy(rng, BLOCK, jnp.bfloat16, src_kind, dst_kind, si, di, None, num_dst=4,
                 num_src=48, what=f"{src_kind}->{dst_kind} whole blocks")


@case
def more_duplicates_than_threads(rng):
    # 2,100 pairs (> 256 threads of the scan's CTA, so each thread checks several later
    # pairs) onto 2 blocks of a small pool.
    n = 2100
    si = rng.integers(0, 8, n)
    di = rng.choice([1, 3], n)
    nt = rng.choice([0, 1, 2, 3], n)
    run_copy(rng, (1, 1, 1, 4, 4), jnp.float32, "pinned_host", "device", si, di, nt,
             num_dst=4, num_src=8)


@case
def one_array_chain_traced(rng):
    # Source and destination one array, indices traced (so not known hazard-free): the staged
    # path. A chain 1->2->3, duplicates onto 4 and a partial copy reading a written block.
    for kind in ("device", "pinned_host"):
        for jit in ("intra_donated", "intra_kept"):
            pool = random_pool(rng, (8, *BLOCK), jnp.bfloat16)
            si, di, nt = i32([1, 2, 5, 6, 3, 2]), i32([2, 3, 4, 4, 7, 4]), i32([0, 0, 3, 0, 5, 2])
            out = JIT[jit](put(pool, kind), si, di, nt)
            check(out, reference(pool, pool, si, di, nt), f"chain {kind} {jit}")


@case
def one_array_eager_known_indices(rng):
    # Known indices: a chain (staged) and a hazard-free batch (copied in place, no staging).
    pool = random_pool(rng, (8, *BLOCK), jnp.float32)
    for si, di, nt in (([1, 2], [2, 3], [0, 4]), ([0, 1], [5, 6], [3, 0])):
        a = put(pool)
        out = kvx.copy_blocks(a, a, si, di, nt)
        check(out, reference(pool, pool, si, di, nt), f"eager one array {si}->{di}")


@case
def eager_known_indices(rng):
    # Known indices: unique destinations (no duplicate scan) and duplicates (the scan), between
    # two arrays of each memory-kind combination.
    for src_kind, dst_kind in KINDS:
        for si, di, nt in (([0, 1, 2], [3, 4, 5], [0, 2, 7]), ([0, 1, 2], [4, 4, 1], [0, 3, 0])):
            dst = random_pool(rng, (6, *BLOCK), jnp.bfloat16)
            src = random_pool(rng, (6, *BLOCK), jnp.bfloat16)
            out = kvx.copy_blocks(put(dst, dst_kind), put(src, src_kind), si, di, nt)
            check(out, reference(dst, src, si, di, nt), f"eager {src_kind}->{dst_kind} {di}")


@case
def padding(rng):
    run_copy(rng, BLOCK, jnp.float16, "device", "pinned_host",
             si=[-1, 0, -1, 2, 3], di=[0, -1, -1, 1, 2], nt=[0, 0, 0, 3, 0])


@case
def out_of_range_traced_indices(rng):
    # Deliberately out of range: skipped, and (under memcheck) never touching memory.
    big, neg = 10**6, -5
    si = [big, 0, neg, 1, 2**31 - 1, 2, -2**31, 3]
    di = [0, big, 1, neg, 2, 2**31 - 1, 3, 4]
    nt = [0, 0, 0, 0, 0, 3, 0, 1]
    for src_kind, dst_kind in KINDS:
        run_copy(rng, BLOCK, jnp.float32, src_kind, dst_kind, si, di, nt)
    # ...also in the staged path (one array) and with a huge token count.
    pool = random_pool(rng, (6, *BLOCK), jnp.float32)
    si2, di2, nt2 = i32([big, 1, 2, neg]), i32([1, 2, big, 3]), i32([0, 0, 0, 2**31 - 1])
    out = JIT["intra_donated"](put(pool), si2, di2, nt2)
    check(out, reference(pool, pool, si2, di2, nt2), "out of range, one array")


@case
def single_pair(rng):
    run_copy(rng, BLOCK, jnp.float32, "pinned_host", "device", si=[3], di=[1], nt=[5])


@case
def empty_batch(rng):
    run_copy(rng, BLOCK, jnp.float32, "device", "pinned_host", si=[], di=[], nt=[])


@case
def pools_of_zero_blocks(rng):
    # Every pair is out of range; the handler returns before launching anything.
    run_copy(rng, BLOCK, jnp.float32, "pinned_host", "device", si=[0, 1], di=[0, 1], nt=[0, 2],
             num_src=0)
    run_copy(rng, BLOCK, jnp.float32, "device", "pinned_host", si=[0, 1], di=[0, 1], nt=[0, 2],
             num_dst=0)


@case
def large_blocks(rng):
    # 256 KiB blocks: several CTAs per pair; whole and partial, both directions.
    block = (4, 2, 4, 32, 128)
    for src_kind, dst_kind in KINDS[:3]:
        run_copy(rng, block, jnp.bfloat16, src_kind, dst_kind, si=[0, 1, 2], di=[2, 0, 0],
                 nt=[0, 17, 5], num_dst=3, num_src=3)


CAPPED = {cap: jax.jit(lambda d, s, si, di, nt, cap=cap: kvx.copy_blocks(d, s, si, di, nt,
                                                                       max_ctas=cap),
                       donate_argnums=0) for cap in (1, 2)}


@case
def capped_grid(rng):
    # max_ctas: 1-2 CTAs of 1024 threads walk every work unit (several per 256 KiB block), with
    # each vector width.
    for dtype, block in ((jnp.bfloat16, (4, 2, 4, 32, 128)), (jnp.uint8, (1, 2, 3, 5, 3)),
                         (jnp.bfloat16, (1, 2, 3, 5, 2))):
        for src_kind, dst_kind in KINDS:
            for name, fn in (("cap1", CAPPED[1]), ("cap2", CAPPED[2])):
                dst = random_pool(rng, (5, *block), dtype)
                src = random_pool(rng, (5, *block), dtype)
                si, di, nt = i32([0, 1, 2, 4]), i32([2, 0, 0, 4]), i32([0, 3, 1, -1])
                out = fn(put(dst, dst_kind), put(src, src_kind), si, di, nt)
                check(out, reference(dst, src, si, di, nt),
                      f"{name} {jnp.dtype(dtype).name} {block} {src_kind}->{dst_kind}")


@case
def copy_engines(rng):
    # dma=True: the handler reads the indices on the host and enqueues copies (merged whole
    # runs, strided partial blocks, in pair order when a block is written twice); no kernel
    # of ours runs, so this case checks the copies' results and the CUDA API calls.
    for dtype, block in ((jnp.bfloat16, (4, 2, 4, 32, 128)), (jnp.uint8, (1, 2, 3, 5, 3))):
        for src_kind, dst_kind in (("device", "pinned_host"), ("pinned_host", "device")):
            dst = random_pool(rng, (6, *block), dtype)
            src = random_pool(rng, (6, *block), dtype)
            si, di, nt = i32([0, 1, 2, 5, -1, 3]), i32([3, 4, 0, 0, 1, 5]), i32([0, 0, 3, 1, 2, -1])
            out = kvx.copy_blocks(put(dst, dst_kind), put(src, src_kind), si, di, nt, dma=True)
            check(out, reference(dst, src, si, di, nt),
                  f"dma {jnp.dtype(dtype).name} {block} {src_kind}->{dst_kind}")


@case
def many_pairs(rng):
    n = 4096
    si = rng.permutation(n)
    di = rng.permutation(n)
    nt = rng.integers(-1, 6, n)
    run_copy(rng, (1, 1, 1, 4, 8), jnp.uint8, "device", "pinned_host", si, di, nt,
             num_dst=n, num_src=n)


@case
def destination_not_donated(rng):
    for src_kind, dst_kind in KINDS[:3]:
        run_copy(rng, BLOCK, jnp.float32, src_kind, dst_kind, si=[0, 1], di=[1, 1], nt=[0, 2],
                 jit="kept")


@case
def partial_block_copy(rng):
    for src_kind, dst_kind in KINDS[:3]:
        dst = random_pool(rng, BLOCK, jnp.bfloat16)
        src = random_pool(rng, BLOCK, jnp.bfloat16)
        for n in (3, 0, 99):
            out = JIT["partial"](put(dst, dst_kind), put(src, src_kind), np.int32(n))
            check(out[None], reference(dst[None], src[None], [0], [0], [n]),
                  f"partial_block_copy n={n} {src_kind}->{dst_kind}")


@case
def manager_transfers(rng):
    pools = [
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=4, size_per_head=32,
                                    tokens_per_block=8, dtype=jnp.bfloat16,
                                    num_primary_blocks=6, num_secondary_blocks=6),
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=1, size_per_head=6,
                                    tokens_per_block=8, dtype=jnp.uint8, kv_factor=1,
                                    num_primary_blocks=6, num_secondary_blocks=6),
    ]
    shadow = []
    for p in pools:
        prim = random_pool(rng, p.primary.shape, p.dtype)
        sec = random_pool(rng, p.secondary.shape, p.dtype)
        p.primary, p.secondary = put(prim, "device"), put(sec, "pinned_host")
        shadow.append([prim, sec])
    m = kvx.KVCacheTransferManager(pools)

    def blk(i, primary):
        return kvx.KVCacheBlock(block_id=i, memory_pool_block_index=i, is_primary=primary)

    ops = [("offload_blocks", [(blk(0, True), blk(1, False)), (blk(2, True), blk(1, False))],
            [0, 3]),
           ("onboard", [(blk(1, False), blk(4, True))], [0]),
           ("onboard", [(blk(4, True), blk(5, True))], [5]),
           ("onboard_blocks", [(blk(5, True), blk(0, True)), (blk(0, True), blk(3, True))],
            [2, 0])]
    for verb, pairs, tokens in ops:
        if verb in ("offload", "onboard"):
            getattr(m, verb)(*pairs[0], num_tokens=tokens[0])
        else:
            getattr(m, verb)(pairs, num_tokens=tokens)
        for (s, d), n in zip(pairs, tokens):
            for arrays in shadow:
                t = arrays[0].shape[4]
                n_eff = t if (n <= 0 or n >= t) else n
                src_a = arrays[0 if s.is_primary else 1]
                dst_a = arrays[0 if d.is_primary else 1]
                dst_a[d.memory_pool_block_index, ..., :n_eff, :] = (
                    src_a[s.memory_pool_block_index, ..., :n_eff, :].copy())
    m.sync_transfers()
    for p, (prim, sec) in zip(pools, shadow):
        check(p.primary, prim, f"manager primary {p.dtype}")
        check(p.secondary, sec, f"manager secondary {p.dtype}")


@case
def staged_onboards(rng):
    # Onboards of small host rows in runs go through a staging buffer (ffi/lanes_cuda.cu,
    # StageOnboard): the runs' copies into staging, the scatter kernel from it on the lane,
    # padding pairs (a batch of 6 in a bucket of 8) skipped; back to back, so that the plan
    # ring's slots are written again while the lane's kernels may still be reading indices.
    from jax_kvxfer import testing
    nb = 16
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=32,
                                       tokens_per_block=8, dtype=jnp.bfloat16,
                                       num_primary_blocks=nb, num_secondary_blocks=nb)
    prim = random_pool(rng, pool.primary.shape, pool.dtype)
    sec = random_pool(rng, pool.secondary.shape, pool.dtype)
    pool.primary, pool.secondary = put(prim, "device"), put(sec, "pinned_host")
    m = kvx.KVCacheTransferManager(pool)
    before = testing.staged_onboards()
    for start in (2, 9, 4):
        rows = np.arange(start, start + 6)
        pages = rng.permutation(nb)[:6]
        m.onboard_indices(rows, pages)
        prim[pages] = sec[rows]
    m.sync_transfers()
    check(pool.primary, prim, "staged onboards")
    staged = testing.staged_onboards()
    if before is not None and staged - before != 3:
        raise AssertionError(f"staged onboards: {staged - before} of 3 were staged")


@case
def layer_group_onboards(rng):
    # Onboards landing in groups of layers (ffi/lanes_cuda.cu, EnqueueLayerGroups): each
    # group's part of every block, whole and partial, a block written twice, then a step that
    # waits for its layers group by group (WaitLayers) and reads every layer.
    nb, layers = 12, 6
    pool = kvx.KVCacheBlockPool.create(num_layers=layers, num_kv_heads=2, size_per_head=32,
                                       tokens_per_block=8, dtype=jnp.bfloat16,
                                       num_primary_blocks=nb, num_secondary_blocks=nb)
    prim = random_pool(rng, pool.primary.shape, pool.dtype)
    sec = random_pool(rng, pool.secondary.shape, pool.dtype)
    pool.primary, pool.secondary = put(prim, "device"), put(sec, "pinned_host")
    m = kvx.KVCacheTransferManager(pool, layer_groups=3)
    pairs, tokens = [(4, 1), (7, 9), (2, 1), (0, 5)], [0, 3, 5, 0]
    m.onboard_indices([a for a, _ in pairs], [b for _, b in pairs], tokens)
    for (a, b), n in zip(pairs, tokens):
        n = 8 if n <= 0 else n
        prim[b, ..., :n, :] = sec[a, ..., :n, :]
    m.sync_transfers(block=False, layer_wise=True)

    def step(x):
        parts = []
        for g in range(3):
            lo, hi = kvx.layer_group_bounds(g, 3, layers)
            x = kvx.wait_for_layers(x, hi)
            # as bits: the random bytes hold NaNs, which bfloat16 arithmetic may rewrite
            parts.append(jax.lax.bitcast_convert_type(x[:, lo:hi], jnp.uint16))
        return jnp.concatenate(parts, axis=1), x

    read, pool.primary = jax.jit(step, donate_argnums=0)(pool.primary)
    check(read, prim.view(np.uint16), "layer-group onboards, read layer by layer")
    m.sync_transfers()


@case
def layer_pool_transfers(rng):
    # A pool over K/V-first per-layer arrays (from_layers): the layered copies, one part per layer
    # and slab in one kernel launch, whole and partial, both ways, on the lanes and in line; then
    # the copy traced inside jit with duplicate host rows (one scan for later writers serves
    # every part).
    from jax_kvxfer.transfer._layers import layer_copy_call
    nb, rows, t = 6, 5, 8
    host_arrays = [random_pool(rng, (2, nb, t, 3, 16), jnp.bfloat16) for _ in range(3)]
    pool = kvx.KVCacheBlockPool.from_layers([put(a, "device") for a in host_arrays],
                                            token_axis=2, block_axis=1,
                                            num_secondary_blocks=rows)
    m = kvx.KVCacheTransferManager(pool)
    model = [np.moveaxis(a, 1, 0).copy() for a in host_arrays]  # [nb, 2, t, 3, 16]
    host = [np.zeros((rows, *a.shape[1:]), a.dtype) for a in model]

    def apply(dst, src, pairs, tokens):
        for (a, b), n in zip(pairs, tokens):
            n = t if n <= 0 or n >= t else n
            for d, s_ in zip(dst, src):
                d[b, :, :n] = s_[a, :, :n]

    m.offload_indices([1, 4, 0], [0, 3, 2], [0, 3, 0])  # on the lanes (a GPU's default)
    apply(host, model, [(1, 0), (4, 3), (0, 2)], [0, 3, 0])
    m.onboard_indices([3, 0], [5, 2], [0, 5])
    apply(model, host, [(3, 5), (0, 2)], [0, 5])
    m.offload_indices([2], [1])  # whole blocks: the snapshot's rows
    apply(host, model, [(2, 1)], [0])
    m.onboard_indices([0, 2], [3, 1])  # whole blocks: every part from its host row
    apply(model, host, [(0, 3), (2, 1)], [0, 0])
    m.sync_transfers()
    in_line = kvx.KVCacheTransferManager(pool, dma=False)  # the copy kernel on XLA's stream
    in_line.offload_indices([5, 3], [4, 0], [0, 2])
    apply(host, model, [(5, 4), (3, 0)], [0, 2])
    in_line.onboard_indices([4], [1], [6])
    apply(model, host, [(4, 1)], [6])
    in_line.sync_transfers()
    check(pool.secondary, np.concatenate([h.reshape(rows, -1) for h in host], 1), "layer rows")
    for k, (got, want) in enumerate(zip(pool.primary, model)):
        check(got, np.moveaxis(want, 0, 1), f"layer array {k}")
    views = pool.storage.views
    out = jax.jit(lambda h, ls, a, b, n: layer_copy_call(h, ls, a, b, n, offload=True,
                                                          views=views))(
        pool.secondary, pool.primary, i32([0, 1, 2, 3]), i32([4, 4, 1, 4]), i32([2, 0, 0, 5]))
    apply(host, model, [(0, 4), (1, 4), (2, 1), (3, 4)], [2, 0, 0, 5])
    check(out, np.concatenate([h.reshape(rows, -1) for h in host], 1), "layer rows, duplicates")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on a non-GPU backend too (checks the script itself)")
    parser.add_argument("--no-int4", action="store_true", help="skip the packed int4 cases")
    parser.add_argument("--initcheck", action="store_true",
                        help="skip the cases whose inputs XLA's own device code may write (a "
                             "non-donated destination's copy, packing int4): with the kernel "
                             "filter, initcheck does not track those writes")
    parser.add_argument("--device-only", action="store_true",
                        help="put every pool in device memory (for an initcheck that would "
                             "count pinned host memory filled by the CPU as uninitialized)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--pytest", metavar="ARGS",
                        help="afterwards, run pytest in this process with these arguments")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    print(f"sanitize_cases: jax {jax.__version__}, backend {backend} "
          f"({jax.devices()[0].device_kind}), CUDA handlers {kvx.HAS_CUDA_HANDLERS}", flush=True)
    if backend != "gpu" and not args.allow_cpu:
        print("sanitize_cases: not on a GPU (pass --allow-cpu to run the cases anyway)")
        return 2
    OPTIONS["int4"] = not (args.no_int4 or args.initcheck)
    OPTIONS["device_only"] = args.device_only
    skip = {"destination_not_donated"} if args.initcheck else set()
    if args.device_only:
        skip.add("manager_transfers")  # its secondary pools are pinned_host by design
    rng = np.random.default_rng(1234)
    failed = []
    t0 = time.perf_counter()
    selected = [(n, f) for n, f in CASES
                if n not in skip and (not args.only or args.only in n)]
    for name, fn in selected:
        t = time.perf_counter()
        try:
            fn(rng)
            status = "ok"
        except Exception:  # noqa: BLE001 - report every case
            failed.append(name)
            status = "FAILED\n" + traceback.format_exc()
        print(f"  case {name}: {status} ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"sanitize_cases: {len(selected)} cases, {len(failed)} failed "
          f"({time.perf_counter() - t0:.0f} s){': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    rc = 1 if failed else 0
    if args.pytest:
        import pytest

        prc = pytest.main(["-q", "-p", "no:cacheprovider", *shlex.split(args.pytest)])
        print(f"sanitize_cases: pytest exit {int(prc)} ({args.pytest})", flush=True)
        rc = rc or int(prc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
