"""Duplicate destinations in one batch.

The rule: when several pairs of one batch write the same destination block, they apply as if
one after another in batch order, so *the later pair wins on the tokens it writes*: token t of
the block comes from the last pair that writes block d with n_eff > t (n_eff = tokens_per_block
for a whole-block pair). No block is ever torn between two sources beyond that rule.

The blocks are large enough (64 tokens x 128 per head, 128 KiB in bf16: several CTAs per pair on
a GPU) and the duplicates many enough (dozens of pairs on three blocks, mixed whole and partial
counts) that a race between pairs would show on the GPU; on the CPU the same tests pin the
semantics. Every comparison is bitwise against an independent NumPy reference, and a failure
names, per token, which sources the block holds.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx

BLOCK = (2, 2, 2, 64, 128)  # [num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head]
T = BLOCK[3]
DTYPES = (jnp.bfloat16, jnp.float32, jnp.uint8, jnp.int4)
KINDS = (("device", "device"), ("device", "pinned_host"), ("pinned_host", "device"))
MODES = ("eager", "jit", "jit_donated")


def sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def random_pool(rng: np.random.Generator, num_blocks: int, dtype, block=BLOCK) -> np.ndarray:
    dtype = jnp.dtype(dtype)
    shape = (num_blocks, *block)
    if dtype == jnp.dtype(jnp.int4):
        return np.asarray(rng.integers(-8, 8, shape), dtype=dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def as_bytes(x) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.uint8).reshape(x.shape + (x.dtype.itemsize,))


def read_back(x: jax.Array) -> np.ndarray:
    """Contents via a fresh device copy: a NumPy view of a pool array (np.asarray of pinned_host
    memory on a GPU) would stop the manager from donating it, and so from copying in place."""
    return np.asarray(jax.device_put(x, x.sharding.with_memory_kind("device"), may_alias=False))


def n_eff(n: int, t: int = T) -> int:
    return t if (n <= 0 or n >= t) else n


def reference(dst: np.ndarray, src: np.ndarray, si, di, nt) -> np.ndarray:
    """Pairs in order onto a copy of dst, reading a snapshot of src; out-of-range pairs skipped."""
    out, snap = dst.copy(), src.copy()
    t = dst.shape[4]
    for s, d, n in zip(si, di, nt):
        if 0 <= s < snap.shape[0] and 0 <= d < out.shape[0]:
            out[d, ..., : n_eff(n, t), :] = snap[s, ..., : n_eff(n, t), :]
    return out


def winners(si, di, nt, block: int, num_src: int, num_dst: int, t: int = T) -> list[int | None]:
    """For each token of `block`: the batch position of the pair whose data it must hold."""
    win: list[int | None] = [None] * t
    for i, (s, d, n) in enumerate(zip(si, di, nt)):
        if d == block and 0 <= s < num_src and 0 <= d < num_dst:
            for tok in range(n_eff(n, t)):
                win[tok] = i
    return win


def explain(out: np.ndarray, src: np.ndarray, dst: np.ndarray, si, di, nt, block: int) -> str:
    """Per token of a wrong block: the source blocks (or 'old') each (layer, kv, head) row holds."""
    got = as_bytes(out[block])
    lines = []
    for tok, w in enumerate(winners(si, di, nt, block, src.shape[0], dst.shape[0], out.shape[4])):
        expected = "old" if w is None else f"src {si[w]} (pair {w})"
        rows = got[..., tok, :, :].reshape(-1, got.shape[-2] * got.shape[-1])
        holders = []
        for r in range(rows.shape[0]):
            cands = [f"src {s}" for s in range(src.shape[0]) if np.array_equal(
                rows[r], as_bytes(src[s])[..., tok, :, :].reshape(rows.shape[0], -1)[r])]
            if np.array_equal(rows[r], as_bytes(dst[block])[..., tok, :, :].reshape(
                    rows.shape[0], -1)[r]):
                cands.append("old")
            holders.append("/".join(cands) or "?")
        if len(set(holders)) > 1 or (holders[0].split("/")[0] != expected.split(" (")[0]):
            lines.append(f"  token {tok}: expected {expected}, rows hold {sorted(set(holders))}")
    return "\n".join(lines[:12]) or "  (all tokens as expected?)"


def assert_rule(out, dst, src, si, di, nt, what: str) -> None:
    out = np.asarray(out)
    expected = reference(dst, src, si, di, nt)
    if np.array_equal(as_bytes(out), as_bytes(expected)):
        return
    bad = sorted({int(b) for b in np.argwhere(np.any(as_bytes(out) != as_bytes(expected),
                                                     axis=tuple(range(1, out.ndim + 1))))[:, 0]})
    details = "\n".join(f" block {b}:\n{explain(out, src, dst, si, di, nt, b)}" for b in bad[:3])
    raise AssertionError(f"{what}: blocks {bad} break 'the later pair wins on the tokens it "
                         f"writes'\n{details}")


def duplicate_batch(rng: np.random.Generator, num_src: int, num_pairs: int, targets: list[int]):
    """Many pairs onto a few blocks, token counts mixing whole (0, -1, T, T+9) and partial."""
    counts = [0, -1, T, T + 9, 1, 2, 7, T // 2, T // 2 + 1, T - 1]
    si = rng.permutation(num_src)[:num_pairs].astype(np.int32)
    di = rng.choice(targets, num_pairs).astype(np.int32)
    nt = rng.choice(counts, num_pairs).astype(np.int32)
    return si, di, nt


def _copy(dst, src, si, di, nt):
    return kvx.copy_blocks(dst, src, si, di, nt)


_jit = jax.jit(_copy)
_jit_donated = jax.jit(_copy, donate_argnums=0)


@functools.cache
def _jit_intra(donate: bool):
    return jax.jit(lambda p, si, di, nt: kvx.copy_blocks(p, p, si, di, nt),
                   donate_argnums=(0,) if donate else ())


def run(mode: str, dst_dev, src_dev, si, di, nt):
    if mode == "eager":
        return kvx.copy_blocks(dst_dev, src_dev, si, di, nt)
    return (_jit_donated if mode == "jit_donated" else _jit)(dst_dev, src_dev, si, di, nt)


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# ---------------------------------------------------------------------------------------------
# the op


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dst_kind, src_kind", KINDS, ids=lambda k: k if isinstance(k, str) else "")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_many_duplicates_later_pair_wins(dtype, dst_kind, src_kind, mode):
    rng = np.random.default_rng(seed(dtype, dst_kind, src_kind, mode))
    num_src = 40
    dst, src = random_pool(rng, 4, dtype), random_pool(rng, num_src, dtype)
    # 36 pairs onto blocks 0-2; block 3 is never written and must keep its old data.
    si, di, nt = duplicate_batch(rng, num_src, 36, [0, 1, 2])
    out = run(mode, jax.device_put(dst, sharding(dst_kind)), jax.device_put(src, sharding(src_kind)),
              si, di, nt)
    assert out.sharding.memory_kind == dst_kind
    assert_rule(out, dst, src, si, di, nt, f"{jnp.dtype(dtype).name} {src_kind}->{dst_kind} {mode}")


@pytest.mark.parametrize("order", ["whole_then_partial", "partial_then_whole", "shrinking",
                                   "growing"])
def test_explicit_orders(order):
    """The four basic orders on one block, each token's source stated by hand."""
    rng = np.random.default_rng(seed(order))
    dst, src = random_pool(rng, 2, jnp.bfloat16), random_pool(rng, 4, jnp.bfloat16)
    si, di, nt = {
        "whole_then_partial": ([0, 1], [1, 1], [0, 5]),     # tokens 0-4 from src 1, rest src 0
        "partial_then_whole": ([0, 1], [1, 1], [5, -1]),    # all from src 1
        "shrinking": ([0, 1, 2, 3], [1, 1, 1, 1], [T, 40, 9, 1]),  # 0:3, 1-8:2, 9-39:1, 40-:0
        "growing": ([0, 1, 2, 3], [1, 1, 1, 1], [1, 9, 40, 0]),    # all from src 3
    }[order]
    out = np.asarray(jax.jit(_copy)(jax.device_put(dst), jax.device_put(src),
                                    np.int32(si), np.int32(di), np.int32(nt)))
    expected_source = {
        "whole_then_partial": [1] * 5 + [0] * (T - 5),
        "partial_then_whole": [1] * T,
        "shrinking": [3] + [2] * 8 + [1] * 31 + [0] * (T - 40),
        "growing": [3] * T,
    }[order]
    for tok, s in enumerate(expected_source):
        assert np.array_equal(as_bytes(out[1, ..., tok, :]), as_bytes(src[s, ..., tok, :])), (
            f"{order}: token {tok} is not from src {s}")
    assert np.array_equal(as_bytes(out[0]), as_bytes(dst[0]))


def test_duplicates_with_padding_and_traced_out_of_range_indices():
    """Skipped pairs (padding, out-of-range traced indices) among duplicates never win."""
    rng = np.random.default_rng(7)
    dst, src = random_pool(rng, 3, jnp.float32), random_pool(rng, 12, jnp.float32)
    si = np.int32([0, 1, -1, 2, 10**6, 3, 4, 5, -5, 6, 7, 2**31 - 1])
    di = np.int32([0, 0, 0, 1, 0, 1, 10**6, 0, 1, -1, 1, 1])
    nt = np.int32([0, 17, 0, 3, -1, 0, 0, 40, 0, 0, 63, 5])
    out = _jit_donated(jax.device_put(dst), jax.device_put(src), si, di, nt)
    assert_rule(out, dst, src, si, di, nt, "padding and out-of-range among duplicates")


@pytest.mark.parametrize("num_pairs, block, num_dst", [
    (40, (1, 2, 2, 16, 64), 24), (300, (2, 2, 2, 64, 128), 24), (3000, (1, 1, 2, 16, 32), 24),
    (3000, (1, 1, 2, 16, 32), 6000)])
@pytest.mark.parametrize("kinds", [("device", "device"), ("pinned_host", "device"),
                                   ("device", "pinned_host")])
@pytest.mark.parametrize("whole", [False, True], ids=["mixed_tokens", "no_num_tokens"])
def test_duplicates_traced_small_and_large_batches(num_pairs, block, num_dst, kinds, whole):
    """Traced indices, so the GPU finds later writers on the device: inside the copy kernel for
    a batch of few pairs and small blocks; for a large one before the copy, from each block's
    last writer (found with atomics where the workspace is in device memory) or by every pair
    scanning the later ones (a copy to pinned_host memory) (ffi/copy_kernel.cu). Onto 24
    blocks every block is written many times; onto 6,000 most are written once, a few twice or
    more. Either way the later pair wins. Without num_tokens the host knows every pair copies a
    whole block, and the kernel takes its whole-block units."""
    rng = np.random.default_rng(seed("traced-batches", num_pairs, num_dst, kinds))
    t = block[3]
    dst = random_pool(rng, num_dst, jnp.bfloat16, block)
    src = random_pool(rng, num_pairs, jnp.bfloat16, block)
    si = rng.permutation(num_pairs).astype(np.int32)
    di = rng.integers(0, num_dst, num_pairs).astype(np.int32)
    si[rng.integers(0, num_pairs, num_pairs // 10)] = -1  # padding
    nt = rng.choice([0, -1, t, 1, 2, t // 2, t - 1], num_pairs).astype(np.int32)
    if whole:
        nt[:] = 0
    out = _jit(jax.device_put(dst, sharding(kinds[0])), jax.device_put(src, sharding(kinds[1])),
               si, di, None if whole else nt)
    assert_rule(read_back(out), dst, src, si, di, nt, f"{num_pairs} pairs {kinds} whole={whole}")


@pytest.mark.parametrize("donate", [False, True])
def test_duplicates_within_one_pool_with_hazards(donate):
    """Source and destination one array (the staged path): duplicates onto blocks that other
    pairs of the batch read; every pair reads the pool as it was before the call."""
    rng = np.random.default_rng(seed("intra", donate))
    pool = random_pool(rng, 24, jnp.bfloat16)
    si, di, nt = duplicate_batch(rng, 24, 24, [0, 1, 2, 3])  # sources include blocks 0-3
    out = _jit_intra(donate)(jax.device_put(pool), si, di, nt)  # traced indices: not hazard-free
    assert_rule(out, pool, pool, si, di, nt, f"one pool, donate={donate}")


def test_repeated_runs_agree():
    """The same duplicate-heavy batch, run repeatedly: one result every time (no race)."""
    rng = np.random.default_rng(11)
    dst, src = random_pool(rng, 2, jnp.bfloat16), random_pool(rng, 64, jnp.bfloat16)
    si, di, nt = duplicate_batch(rng, 64, 64, [0, 1])
    src_dev = jax.device_put(src)
    expected = as_bytes(reference(dst, src, si, di, nt))
    for i in range(6):
        out = _jit_donated(jax.device_put(dst), src_dev, si, di, nt)
        assert np.array_equal(as_bytes(out), expected), f"run {i} differs"


def test_odd_int4_rows_copy_whole_blocks_and_later_wins():
    """4-bit pools with odd size_per_head only copy whole blocks: the last pair wins whole."""
    rng = np.random.default_rng(5)
    block = (1, 2, 2, 8, 3)
    dst, src = random_pool(rng, 2, jnp.int4, block), random_pool(rng, 6, jnp.int4, block)
    si, di = np.int32([0, 1, 2, 3]), np.int32([1, 1, 0, 1])
    out = kvx.copy_blocks(jax.device_put(dst), jax.device_put(src), si, di)
    assert_rule(out, dst, src, si, di, [0, 0, 0, 0], "int4, odd rows")


# ---------------------------------------------------------------------------------------------
# the manager


def _pools(rng, num_primary=8, num_secondary=8):
    pools = [
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=2, size_per_head=128,
                                    tokens_per_block=T, dtype=jnp.bfloat16,
                                    num_primary_blocks=num_primary,
                                    num_secondary_blocks=num_secondary),
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=1, size_per_head=6,
                                    tokens_per_block=T, dtype=jnp.uint8, kv_factor=1,
                                    num_primary_blocks=num_primary,
                                    num_secondary_blocks=num_secondary),
    ]
    for pool in pools:
        pool.primary = jax.device_put(random_pool(rng, num_primary, pool.dtype, pool.block_shape),
                                      pool.primary.sharding)
        pool.secondary = jax.device_put(
            random_pool(rng, num_secondary, pool.dtype, pool.block_shape), pool.secondary.sharding)
    return pools


def _blk(i: int, primary: bool) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(block_id=i, memory_pool_block_index=i, is_primary=primary)


@pytest.mark.parametrize("verb", ["offload_blocks", "onboard_blocks"])
def test_manager_batch_with_duplicate_destinations(verb):
    rng = np.random.default_rng(seed(verb))
    pools = _pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    before = [(read_back(p.primary), read_back(p.secondary)) for p in pools]
    offload = verb == "offload_blocks"
    # 8 sources onto 2 destination slots, mixed whole and partial; one batch, one direction.
    src_idx = rng.permutation(8)
    dst_idx = rng.choice([2, 5], 8)
    tokens = [int(n) for n in rng.choice([0, 1, 9, T // 2, T - 1, T + 1, -1], 8)]
    pairs = [(_blk(int(s), offload), _blk(int(d), not offload)) for s, d in zip(src_idx, dst_idx)]
    getattr(m, verb)(pairs, num_tokens=tokens)
    assert m.pending_transfers[(2, not offload)].writes + m.pending_transfers[
        (5, not offload)].writes == 8
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, before):
        src, dst = (prim, sec) if offload else (sec, prim)
        got = np.asarray(pool.secondary if offload else pool.primary)
        assert_rule(got, dst, src, src_idx, dst_idx, tokens, f"{verb} {pool.dtype}")


def test_manager_batch_reading_a_slot_it_wrote_twice():
    """Two writes to one slot, then a read of it in the same batch: the read sees the later
    write's tokens over the earlier's (the batch is split there, the rule holds across)."""
    rng = np.random.default_rng(3)
    pools = _pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    before = [(read_back(p.primary), read_back(p.secondary)) for p in pools]
    m.offload_blocks([(_blk(0, True), _blk(4, False)), (_blk(1, True), _blk(4, False))],
                     num_tokens=[0, 10])
    m.onboard_blocks([(_blk(4, False), _blk(6, True)), (_blk(2, False), _blk(6, True)),
                      (_blk(4, False), _blk(7, True))], num_tokens=[-1, 3, 20])
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, before):
        slot4 = prim[0].copy()
        slot4[..., :10, :] = prim[1][..., :10, :]
        p6 = slot4.copy()
        p6[..., :3, :] = sec[2][..., :3, :]
        p7 = prim[7].copy()
        p7[..., :20, :] = slot4[..., :20, :]
        got_p, got_s = np.asarray(pool.primary), np.asarray(pool.secondary)
        assert np.array_equal(as_bytes(got_s[4]), as_bytes(slot4))
        assert np.array_equal(as_bytes(got_p[6]), as_bytes(p6))
        assert np.array_equal(as_bytes(got_p[7]), as_bytes(p7))


@pytest.mark.parametrize("dst_kind, src_kind", KINDS, ids=lambda k: k if isinstance(k, str) else "")
def test_unique_dst_indices_promise_with_traced_indices(dst_kind, src_kind):
    """unique_dst_indices=True tells the op that destinations do not repeat, so with traced
    indices the GPU skips its duplicate scan: the copy is still exact (padding may repeat)."""
    rng = np.random.default_rng(seed("unique-promise", dst_kind, src_kind))
    dst, src = random_pool(rng, 16, jnp.bfloat16), random_pool(rng, 12, jnp.bfloat16)
    si = rng.integers(0, 12, 10).astype(np.int32)
    di = rng.permutation(16)[:10].astype(np.int32)
    si[[2, 7]] = -1  # padding: its destinations may repeat others
    di[7] = di[1]
    nt = rng.integers(-1, T + 2, 10).astype(np.int32)
    fn = jax.jit(lambda d, s, a, b, n: kvx.copy_blocks(d, s, a, b, n, unique_dst_indices=True),
                 donate_argnums=0)
    out = fn(jax.device_put(dst, sharding(dst_kind)), jax.device_put(src, sharding(src_kind)),
             si, di, nt)
    np.testing.assert_array_equal(as_bytes(read_back(out)), as_bytes(reference(dst, src, si, di, nt)))
    # the promise reaches the handler: no duplicate scan for traced indices
    text = jax.jit(lambda d, s, a, b: kvx.copy_blocks(d, s, a, b, unique_dst_indices=True)).lower(
        dst, src, si, di).as_text()
    plain = jax.jit(lambda d, s, a, b: kvx.copy_blocks(d, s, a, b)).lower(dst, src, si, di).as_text()
    assert "unique_dst = true" in text and "unique_dst = false" in plain
