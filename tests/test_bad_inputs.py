"""The bad-input matrix: every bad input to the ops, the pools and the manager
raises a clear exception of a known type and message, and leaves every pool unchanged.

`CASES` is the single source of the table in docs/bad-inputs.md: `test_doc_table_is_current`
fails when the two differ. Regenerate the doc with

    python tests/test_bad_inputs.py

Messages are written in full; `…` stands for a part that varies (a device name, a repr), and
the test checks the pieces in order, anchored at both ends of the message.
"""

from __future__ import annotations

import functools
import gc
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer.observe import events as kv_events
from jax_kvxfer.observe import metrics as kv_metrics
from jax_kvxfer.transfer import limits

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"
BEGIN, END = "<!-- BEGIN bad-input table (generated) -->", "<!-- END bad-input table -->"

# Bugs found by this matrix and not fixed yet: each such case states the behaviour it should
# have and is a strict xfail until the fix lands (then delete its id here). The two this matrix
# found (one pool passed twice; a non-bool is_primary) reached XLA as INVALID_ARGUMENT at
# dispatch; both are fixed.
KNOWN_BUGS: dict[str, str] = {}

T = 4  # tokens per block
BLOCK = (1, 2, 2, T, 4)  # [num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head]
NUM_PRIMARY, NUM_SECONDARY = 6, 8


def P(i: Any) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(block_id=100, memory_pool_block_index=i, is_primary=True)


def S(i: Any) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(block_id=200, memory_pool_block_index=i, is_primary=False)


def sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


# ---------------------------------------------------------------------------------------------
# the world each case starts from, and the check that it is unchanged afterwards


class Ctx:
    """Fresh random pools for one case: op operands and two pools of one manager."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.arrays: list[jax.Array] = []  # op operands that must stay intact
        self.pools: list[kvx.KVCacheBlockPool] = []  # pools that must stay intact
        self.managers: list[kvx.KVCacheTransferManager] = []
        self.deleted_on_purpose: set[int] = set()
        self.dst = self.array((6, *BLOCK), jnp.float32, "device")  # 6 blocks
        self.src = self.array((5, *BLOCK), jnp.float32, "pinned_host")  # 5 blocks
        self.pair = self.make_pools()
        self.manager = self.make_manager(self.pair)

    def array(self, shape, dtype, kind: str, track: bool = True) -> jax.Array:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
        if kind not in kinds:
            pytest.skip(f"this device has no {kind} memory (it has {sorted(kinds)})")
        dtype = jnp.dtype(dtype)
        if dtype.itemsize == 1 and dtype.name in ("int4", "uint4"):
            host = np.asarray(self.rng.integers(0, 8, shape), dtype=dtype)
        else:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            host = self.rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
        a = jax.device_put(host, sharding(kind))
        if track:
            self.arrays.append(a)
        return a

    def pool(self, *, dtype=jnp.float32, num_kv_heads=2, size_per_head=4, kv_factor=2,
             tokens_per_block=T, num_primary_blocks=NUM_PRIMARY,
             num_secondary_blocks=NUM_SECONDARY) -> kvx.KVCacheBlockPool:
        pool = kvx.KVCacheBlockPool.create(
            num_layers=1, num_kv_heads=num_kv_heads, size_per_head=size_per_head,
            tokens_per_block=tokens_per_block, dtype=dtype, kv_factor=kv_factor,
            num_primary_blocks=num_primary_blocks, num_secondary_blocks=num_secondary_blocks)
        pool.primary = self.array(pool.primary.shape, dtype, "device", track=False)
        if pool.secondary is not None:
            pool.secondary = self.array(pool.secondary.shape, dtype, "pinned_host", track=False)
        self.pools.append(pool)
        return pool

    def make_pools(self, **kw) -> list[kvx.KVCacheBlockPool]:
        """Two pools of one manager: different head counts and dtypes."""
        return [self.pool(dtype=jnp.float32, num_kv_heads=2, **kw),
                self.pool(dtype=jnp.bfloat16, num_kv_heads=1, kv_factor=1, **kw)]

    def make_manager(self, pools) -> kvx.KVCacheTransferManager:
        m = kvx.KVCacheTransferManager(pools)
        self.managers.append(m)
        return m

    def delete(self, array: jax.Array) -> None:
        """Deletes an array the way donation does (the user did not assign the result back)."""
        _donate(array)
        if not array.is_deleted():  # a backend that ignored the donation
            array.delete()
        self.deleted_on_purpose.add(id(array))

    def mislabeled_pinned_host(self, shape, dtype=jnp.float32) -> jax.Array:
        """A pinned_host array whose JAX type says device memory (jax 0.10's jit bug)."""
        x = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding("pinned_host"))()
        space = getattr(jax.typeof(x), "memory_space", None)
        if space is None or getattr(space, "name", "") == "Host":
            pytest.skip("this JAX labels jit outputs in pinned_host correctly")
        return x

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> dict:
        gc.collect()
        return {
            "arrays": [(a, None if id(a) in self.deleted_on_purpose else np.asarray(a).copy())
                       for a in self.arrays],
            "pools": [(p, p.primary, p.secondary,
                       None if p.primary.is_deleted() else np.asarray(p.primary).copy(),
                       None if p.secondary is None or p.secondary.is_deleted()
                       else np.asarray(p.secondary).copy()) for p in self.pools],
            "live": len(jax.live_arrays()),
        }

    def assert_unchanged(self, snap: dict) -> None:
        for m in self.managers:
            assert not m.pending_transfers, "a failed call left pending transfers"
            assert m.get_and_reset_transfer_stats() == kvx.TransferStats(), "stats moved"
            m.sync_transfers()
        for a, before in snap["arrays"]:
            if before is None:
                continue
            assert not a.is_deleted(), "an operand was consumed by a failed call"
            assert_bitwise(a, before, "operand")
        for pool, prim, sec, prim_before, sec_before in snap["pools"]:
            assert pool.primary is prim and pool.secondary is sec, "a pool array was replaced"
            if prim_before is not None:
                assert_bitwise(pool.primary, prim_before, "pool.primary")
            if sec_before is not None:
                assert_bitwise(pool.secondary, sec_before, "pool.secondary")
        gc.collect()
        assert len(jax.live_arrays()) <= snap["live"], "a failed call left arrays alive"


_donate = jax.jit(lambda a: a, donate_argnums=0)


def assert_bitwise(actual: jax.Array, expected: np.ndarray, what: str) -> None:
    a = np.ascontiguousarray(np.asarray(actual))
    assert a.shape == expected.shape and a.dtype == expected.dtype, what
    assert np.array_equal(a.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)), (
        f"{what} changed")


def message_matches(message: str, pattern: str) -> bool:
    """`pattern` is the whole message, with `…` for parts that vary."""
    regex = ".*".join(re.escape(piece) for piece in pattern.split("…"))
    return re.fullmatch(regex, message, flags=re.DOTALL) is not None


# ---------------------------------------------------------------------------------------------
# the matrix


@dataclass(frozen=True)
class Case:
    id: str
    api: str  # what is called
    bad: str  # the bad input, in words
    error: type[BaseException]
    message: str  # the whole message; … marks a part that varies
    setup: Callable[[Ctx, pytest.MonkeyPatch], Callable[[], Any]]  # returns the failing call


def _copy(ctx: Ctx, dst=None, src=None, si=(0,), di=(1,), nt=None):
    dst = ctx.dst if dst is None else dst
    src = ctx.src if src is None else src
    return lambda: kvx.copy_blocks(dst, src, si, di, nt)


def _jit_copy(ctx: Ctx, dst, src, si=(0,), di=(1,), nt=None):
    """copy_blocks inside jax.jit: indices and token counts traced."""
    si, di = np.int32(si), np.int32(di)
    return lambda: jax.jit(kvx.copy_blocks)(dst, src, si, di, nt)


def _from_layers(ctx: Ctx, *shapes, dtypes=None, token_axis=1):
    arrays = [ctx.array(shape, dtype, "device")
              for shape, dtype in zip(shapes, dtypes or (jnp.float32,) * len(shapes))]
    return lambda: kvx.KVCacheBlockPool.from_layers(arrays, token_axis=token_axis,
                                                    num_secondary_blocks=2)


def _assign_layers(ctx: Ctx, count: int):
    arrays = [ctx.array((6, T, 2, 4), jnp.float32, "device") for _ in range(2)]
    pool = kvx.KVCacheBlockPool.from_layers(arrays, token_axis=1, num_secondary_blocks=2)

    def assign():
        pool.primary = arrays[:count]
    return assign


def _traced_int2_copy():
    """int2 pools, traced only: no backend has to hold a 2-bit array for this check."""
    pool = jax.ShapeDtypeStruct((2, *BLOCK), jnp.int2)
    return lambda: jax.eval_shape(lambda d, s: kvx.copy_blocks(d, s, [0], [1]), pool, pool)


def _int4_pools(ctx: Ctx, size_per_head: int):
    dst = ctx.array((2, 1, 2, 1, T, size_per_head), jnp.int4, "device")
    src = ctx.array((2, 1, 2, 1, T, size_per_head), jnp.int4, "pinned_host")
    return dst, src


def _odd_int4_manager(ctx: Ctx):
    m = ctx.make_manager([ctx.pool(dtype=jnp.int4, size_per_head=3)])
    return lambda: m.offload(P(0), S(0), num_tokens=1)


def _no_secondary_manager(ctx: Ctx, verb: str):
    m = ctx.make_manager(ctx.make_pools(num_secondary_blocks=0))
    if verb == "offload":
        return lambda: m.offload(P(0), S(0))
    return lambda: m.onboard(S(0), P(1))


def _donated_primary(ctx: Ctx):
    ctx.delete(ctx.pair[1].primary)
    return lambda: ctx.manager.offload(P(0), S(1))


def _deleted_secondary(ctx: Ctx):
    ctx.delete(ctx.pair[0].secondary)
    return lambda: ctx.manager.onboard(S(0), P(1))


def _disagreeing_pools(ctx: Ctx, **kw):
    a, b = ctx.pool(), ctx.pool(**kw)
    return lambda: kvx.KVCacheTransferManager([a, b])


def _assign(pool: kvx.KVCacheBlockPool, name: str, value: Any):
    return lambda: setattr(pool, name, value)


def _assign_deleted(ctx: Ctx):
    array = ctx.array((NUM_PRIMARY, *BLOCK), jnp.float32, "device", track=False)
    ctx.delete(array)
    return _assign(ctx.pair[0], "primary", array)


def _copy_deleted(ctx: Ctx):
    ctx.delete(ctx.dst)
    return _copy(ctx)


def _too_big_for_device(ctx: Ctx, mp: pytest.MonkeyPatch):
    mp.setattr(limits, "free_device_bytes", lambda device: 2**30)  # 1 GiB free
    return lambda: kvx.KVCacheBlockPool.create(
        num_layers=32, num_kv_heads=8, size_per_head=128, tokens_per_block=32,
        dtype=jnp.bfloat16, num_primary_blocks=512, num_secondary_blocks=0)  # 2 GiB


def _too_big_for_pinned_host(ctx: Ctx, mp: pytest.MonkeyPatch):
    mp.setattr(limits, "pinned_host_limit_bytes", lambda device: 2**30)  # 1 GiB limit
    return lambda: kvx.KVCacheBlockPool.create(
        num_layers=32, num_kv_heads=8, size_per_head=128, tokens_per_block=32,
        dtype=jnp.bfloat16, num_primary_blocks=1, num_secondary_blocks=512)  # 2 GiB


def _too_big_for_this_device(ctx: Ctx, mp: pytest.MonkeyPatch):
    return lambda: kvx.KVCacheBlockPool.create(
        num_layers=80, num_kv_heads=8, size_per_head=128, tokens_per_block=64,
        dtype=jnp.bfloat16, num_primary_blocks=100_000, num_secondary_blocks=0)  # 1.9 TiB


def _too_big_for_host_memory(ctx: Ctx, mp: pytest.MonkeyPatch):
    mp.setattr(limits, "pinned_host_limit_bytes", lambda device: None)  # no XLA cap
    mp.setattr(limits, "available_host_bytes", lambda: 2**30)  # 1 GiB available
    return lambda: kvx.KVCacheBlockPool.create(
        num_layers=32, num_kv_heads=8, size_per_head=128, tokens_per_block=32,
        dtype=jnp.bfloat16, num_primary_blocks=1, num_secondary_blocks=512)  # 2 GiB


def _to_numpy_donated(ctx: Ctx):
    array = ctx.array((NUM_PRIMARY, *BLOCK), jnp.float32, "device", track=False)
    ctx.delete(array)
    return lambda: kvx.to_numpy(array)


POOL_SHAPE = f"[{NUM_PRIMARY}, {', '.join(map(str, BLOCK))}]"
SEC_SHAPE = f"[{NUM_SECONDARY}, {', '.join(map(str, BLOCK))}]"
TOKENS_TYPE = "num_tokens must be None, an int or a sequence of ints, got "

CASES: list[Case] = [
    # -- ops: copy_blocks / partial_block_copy ---------------------------------------------
    Case("ops-dtype", "copy_blocks", "src_pool of another dtype (bfloat16 into float32)",
         TypeError, "src_pool has dtype bfloat16, expected dst_pool's float32",
         lambda c, mp: _copy(c, src=c.array((5, *BLOCK), jnp.bfloat16, "pinned_host"))),
    Case("ops-block-shape", "copy_blocks", "src_pool with another block shape (3 heads, not 2)",
         ValueError, "src_pool has block shape (1, 2, 3, 4, 4), expected dst_pool's "
         "(1, 2, 2, 4, 4)",
         lambda c, mp: _copy(c, src=c.array((5, 1, 2, 3, T, 4), jnp.float32, "pinned_host"))),
    Case("ops-rank", "copy_blocks", "a 5-D array (one block) as dst_pool", ValueError,
         "dst_pool must be a 6-D pool [num_blocks, num_layers, kv_factor, num_kv_heads, "
         "tokens_per_block, size_per_head], got shape (1, 2, 2, 4, 4)",
         lambda c, mp: _copy(c, dst=c.array(BLOCK, jnp.float32, "device"))),
    Case("ops-partial-rank", "partial_block_copy", "6-D pools instead of 5-D blocks",
         ValueError, "dst must be a 5-D block [num_layers, kv_factor, num_kv_heads, "
         "tokens_per_block, size_per_head], got shape (6, 1, 2, 2, 4, 4)",
         lambda c, mp: lambda: kvx.partial_block_copy(c.dst, c.dst, 2)),
    Case("ops-token-axis-range", "copy_blocks", "token_axis past the pool's last axis",
         ValueError, "token_axis=6 is out of range for an array of 6 dimensions",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], token_axis=6)),
    Case("ops-token-axis-order", "copy_blocks", "token_axis before block_axis", ValueError,
         "token_axis (1) must come after block_axis (2) in dst_pool of shape "
         f"({NUM_PRIMARY}, 1, 2, 2, 4, 4)",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], token_axis=1,
                                               block_axis=2)),
    Case("ops-block-axis-alone", "copy_blocks", "block_axis without token_axis", TypeError,
         "block_axis needs token_axis: the axis a partial copy's tokens run along",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], block_axis=1)),
    Case("ops-not-an-array", "copy_blocks", "a NumPy array as dst_pool", TypeError,
         "dst_pool must be a jax.Array, got ndarray",
         lambda c, mp: _copy(c, dst=np.zeros((6, *BLOCK), np.float32))),
    Case("ops-unpinned-host", "copy_blocks", "src_pool in memory kind unpinned_host",
         ValueError, "src_pool must live in memory kind 'device' or 'pinned_host', got "
         "'unpinned_host'",
         lambda c, mp: _copy(c, src=c.array((5, *BLOCK), jnp.float32, "unpinned_host"))),
    Case("ops-mislabeled-pinned-host", "copy_blocks",
         "a pinned_host array whose JAX type says device memory (jax 0.10: made by "
         "`jax.jit(f, out_shardings=<pinned_host>)`)", ValueError,
         "dst_pool is in pinned_host memory but its JAX type says …: this JAX version mislabels "
         "arrays made by jax.jit(..., out_shardings=<pinned_host sharding>); make them with "
         "jax.device_put(x, <pinned_host sharding>) or return them from a jitted function "
         "whose input was already in pinned_host",
         lambda c, mp: _copy(c, dst=c.mislabeled_pinned_host((6, *BLOCK)))),
    Case("ops-deleted", "copy_blocks", "a dst_pool already donated to another jitted call",
         ValueError, "dst_pool has been deleted (was it donated to a jitted function?)",
         lambda c, mp: _copy_deleted(c)),
    Case("ops-dst-index-out-of-range", "copy_blocks", "dst index 6 into a 6-block pool (known)",
         IndexError, "dst_indices holds block index 6, but dst_pool has 6 blocks (valid: "
         "0..num_blocks-1, or negative to skip the pair)",
         lambda c, mp: _copy(c, si=[0], di=[6])),
    Case("ops-src-index-out-of-range", "copy_blocks", "src index 5 of a 5-block pool (known)",
         IndexError, "src_indices holds block index 5, but src_pool has 5 blocks (valid: "
         "0..num_blocks-1, or negative to skip the pair)",
         lambda c, mp: _copy(c, si=np.array([0, 5]), di=np.array([1, 2]))),
    Case("ops-index-beyond-int32", "copy_blocks", "an index of 2**40", IndexError,
         "src_indices holds values outside int32: min 1099511627776, max 1099511627776",
         lambda c, mp: _copy(c, si=[2**40])),
    Case("ops-index-float", "copy_blocks", "float indices ([1.5])", TypeError,
         "src_indices must hold integers, got dtype float64",
         lambda c, mp: _copy(c, si=[1.5])),
    Case("ops-index-jax-float", "copy_blocks", "a float jax.Array of indices", TypeError,
         "dst_indices must hold integers, got dtype float32",
         lambda c, mp: _copy(c, di=jnp.array([1.0]))),
    Case("ops-traced-index-float", "copy_blocks (in jax.jit)", "traced float indices",
         TypeError, "src_indices must hold integers, got dtype float32",
         lambda c, mp: lambda: jax.jit(kvx.copy_blocks)(c.dst, c.src, jnp.array([1.0]),
                                                        jnp.array([1]))),
    Case("ops-index-bool", "copy_blocks", "boolean indices ([True])", TypeError,
         "src_indices must hold integers, got dtype bool",
         lambda c, mp: _copy(c, si=[True])),
    Case("ops-index-str", "copy_blocks", "string indices (['0'])", TypeError,
         "src_indices must hold integers, got dtype <U1",
         lambda c, mp: _copy(c, si=["0"])),
    Case("ops-index-2d", "copy_blocks", "2-D indices ([[0]])", ValueError,
         "src_indices must be 1-D, got shape (1, 1)",
         lambda c, mp: _copy(c, si=[[0]])),
    Case("ops-index-lengths", "copy_blocks", "src and dst index vectors of different lengths",
         ValueError, "src_indices has length 2 but dst_indices has length 1",
         lambda c, mp: _copy(c, si=[0, 1], di=[2])),
    Case("ops-max-ctas-zero", "copy_blocks", "max_ctas=0", ValueError,
         "max_ctas must be None or a positive int, got 0",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], max_ctas=0)),
    Case("ops-unique-dst-not-bool", "copy_blocks", "unique_dst_indices=1", TypeError,
         "unique_dst_indices must be True or False, got 1",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], unique_dst_indices=1)),
    Case("ops-unique-dst-broken", "copy_blocks", "unique_dst_indices=True, dst_indices [1, 1]",
         ValueError, "unique_dst_indices=True, but dst_indices writes one block in two pairs "
         "(negative padding may repeat)",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0, 2], [1, 1],
                                               unique_dst_indices=True)),
    Case("ops-dma-not-bool", "copy_blocks", "dma='yes'", TypeError,
         "dma must be True, False or \"auto\", got 'yes'",
         lambda c, mp: lambda: kvx.copy_blocks(c.dst, c.src, [0], [1], dma="yes")),
    Case("ops-dma-same-kind", "copy_blocks", "dma=True between two device pools", ValueError,
         "dma=True copies between device and pinned_host memory; dst_pool and src_pool are in "
         "'device' and 'device'",
         lambda c, mp: functools.partial(kvx.copy_blocks, c.dst,
                                         c.array((5, *BLOCK), jnp.float32, "device"), [0], [1],
                                         dma=True)),
    Case("ops-dma-device-indices", "copy_blocks",
         "dma=True in jit with indices in device memory", ValueError,
         "dma=True needs src_indices in pinned_host memory, where the GPU handler reads it while "
         "it enqueues the copies; it is in …",
         lambda c, mp: lambda: jax.jit(lambda d, s, i, j: kvx.copy_blocks(d, s, i, j, dma=True))(
             c.dst, c.src, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32))),
    Case("ops-num-tokens-float", "copy_blocks", "num_tokens=1.5", TypeError,
         "num_tokens must hold integers, got dtype float64",
         lambda c, mp: _copy(c, nt=1.5)),
    Case("ops-num-tokens-bool", "copy_blocks", "num_tokens=True", TypeError,
         "num_tokens must be an integer, got True",
         lambda c, mp: _copy(c, nt=True)),
    Case("ops-num-tokens-str", "copy_blocks", "num_tokens='2'", TypeError,
         "num_tokens must hold integers, got dtype <U1",
         lambda c, mp: _copy(c, nt="2")),
    Case("ops-num-tokens-length", "copy_blocks", "two token counts for one pair", ValueError,
         "num_tokens has length 2, expected 1 (one per pair)",
         lambda c, mp: _copy(c, nt=[1, 2])),
    Case("ops-partial-num-tokens-list", "partial_block_copy", "num_tokens=[1] (not a scalar)",
         TypeError, "num_tokens must be an int or an integer scalar array, got [1]",
         lambda c, mp: lambda: kvx.partial_block_copy(c.dst[0], c.dst[1], [1])),
    Case("ops-partial-num-tokens-float", "partial_block_copy", "num_tokens=2.0", TypeError,
         "num_tokens must be an int or an integer scalar array, got 2.0",
         lambda c, mp: lambda: kvx.partial_block_copy(c.dst[0], c.dst[1], 2.0)),
    Case("ops-sub-byte-odd-partial", "copy_blocks",
         "partial copy of int4 with odd size_per_head (3)", ValueError,
         "partial copies of int4 need an even size_per_head (a token row must be a whole "
         "number of bytes), got size_per_head=3; copy whole blocks (num_tokens=None) instead",
         lambda c, mp: _copy(c, *_int4_pools(c, 3), si=[0], di=[1], nt=[1])),
    Case("ops-sub-byte-odd-traced-tokens", "copy_blocks (in jax.jit)",
         "traced num_tokens (maybe partial) on int4 with odd size_per_head", ValueError,
         "partial copies of int4 need an even size_per_head (a token row must be a whole "
         "number of bytes), got size_per_head=3; copy whole blocks (num_tokens=None) instead",
         lambda c, mp: _jit_copy(c, *_int4_pools(c, 3), nt=np.int32([0]))),
    Case("ops-sub-byte-odd-block", "copy_blocks",
         "int4 blocks of an odd number of elements (1x1x1x1x3)", ValueError,
         "a block of int4 with shape (1, 1, 1, 1, 3) is not a whole number of bytes; use an even "
         "number of elements per block",
         lambda c, mp: _copy(c, c.array((2, 1, 1, 1, 1, 3), jnp.int4, "device"),
                             c.array((2, 1, 1, 1, 1, 3), jnp.int4, "device"))),
    Case("ops-unsupported-dtype", "copy_blocks (traced)", "2-bit pools (int2)", TypeError,
         "dtype int2 is not supported: only 4-bit sub-byte types are",
         lambda c, mp: _traced_int2_copy()),
    # -- pools: KVCacheBlockPool.create and assignment ---------------------------------------
    Case("pool-bad-geometry", "KVCacheBlockPool.create", "num_layers=0", ValueError,
         "num_layers must be an integer >= 1, got 0",
         lambda c, mp: lambda: kvx.KVCacheBlockPool.create(
             num_layers=0, num_kv_heads=1, size_per_head=2, tokens_per_block=2,
             dtype=jnp.float32, num_primary_blocks=2, num_secondary_blocks=1)),
    Case("pool-not-a-dtype", "KVCacheBlockPool.create", "dtype='foo'", TypeError,
         "dtype must be a JAX dtype, got 'foo'",
         lambda c, mp: lambda: c.pool(dtype="foo")),
    Case("pool-unsupported-dtype", "KVCacheBlockPool.create", "dtype=int2", TypeError,
         "dtype int2 is not supported: only 4-bit sub-byte types are",
         lambda c, mp: lambda: c.pool(dtype=jnp.int2)),
    Case("pool-odd-sub-byte-block", "KVCacheBlockPool.create",
         "int4 blocks of an odd number of elements", ValueError,
         "a block of int4 with shape (1, 1, 1, 3, 3) is not a whole number of bytes; use an even "
         "number of elements per block",
         lambda c, mp: lambda: c.pool(dtype=jnp.int4, num_kv_heads=1, kv_factor=1,
                                      tokens_per_block=3, size_per_head=3)),
    Case("pool-larger-than-free-device-memory", "KVCacheBlockPool.create",
         "a 2 GiB primary pool with 1 GiB of device memory free (simulated)", MemoryError,
         "primary pool (512, 32, 2, 8, 32, 128) needs 2.00 GiB but … has 1.00 GiB free; use "
         "fewer blocks…", _too_big_for_device),
    Case("pool-larger-than-this-device", "KVCacheBlockPool.create",
         "a 1.9 TiB primary pool, against the device's real free memory (a CPU device's is "
         "the host's available memory)", MemoryError,
         "primary pool (100000, 80, 2, 8, 64, 128) needs 1953.12 GiB but … GiB free; use "
         "fewer blocks…", _too_big_for_this_device),
    Case("pool-larger-than-host-memory", "KVCacheBlockPool.create",
         "a 2 GiB secondary pool with 1 GiB of host memory available (simulated)", MemoryError,
         "secondary pool (512, 32, 2, 8, 32, 128) needs 2.00 GiB of host memory but this "
         "machine has 1.00 GiB available; use fewer secondary blocks",
         _too_big_for_host_memory),
    Case("pool-device-as-string", "KVCacheBlockPool.create", "device='cpu'", TypeError,
         "device must be a jax.Device (for example jax.devices()[0]), got 'cpu'",
         lambda c, mp: lambda: kvx.KVCacheBlockPool.create(
             num_layers=1, num_kv_heads=1, size_per_head=2, tokens_per_block=2,
             dtype=jnp.float32, num_primary_blocks=2, num_secondary_blocks=1, device="cpu")),
    Case("to-numpy-not-a-jax-array", "to_numpy", "a NumPy array", TypeError,
         "to_numpy: array must be a concrete jax.Array (a pool's primary or secondary array), "
         "got ndarray",
         lambda c, mp: lambda: kvx.to_numpy(np.zeros(3))),
    Case("to-numpy-donated", "to_numpy", "a deleted (donated) array", ValueError,
         "to_numpy: the array has been deleted — it was donated to a jitted function or a "
         "transfer; read the pool's current array (pool.primary / pool.secondary) instead",
         lambda c, mp: _to_numpy_donated(c)),
    Case("pool-larger-than-pinned-host-limit", "KVCacheBlockPool.create",
         "a 2 GiB secondary pool over a 1 GiB pinned-host limit (simulated)", MemoryError,
         "secondary pool (512, 32, 2, 8, 32, 128) needs 2.00 GiB of pinned host memory, over "
         "XLA's limit of 1.00 GiB; raise it with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=<GiB> (set "
         "before JAX starts) or use fewer secondary blocks",
         _too_big_for_pinned_host),
    # -- pools over an engine's arrays: KVCacheBlockPool.from_layers ----------------------------
    Case("layers-block-counts-differ", "KVCacheBlockPool.from_layers",
         "arrays of 6 and 5 blocks", ValueError,
         "arrays[1] has 5 blocks along block_axis, expected arrays[0]'s 6",
         lambda c, mp: _from_layers(c, (6, T, 2, 4), (5, T, 2, 4))),
    Case("layers-dtypes-differ", "KVCacheBlockPool.from_layers",
         "a float32 and a bfloat16 array", TypeError,
         "arrays[1] has dtype bfloat16, expected arrays[0]'s float32",
         lambda c, mp: _from_layers(c, (6, T, 2, 4), (6, T, 2, 4), dtypes=(jnp.float32,
                                                                          jnp.bfloat16))),
    Case("layers-token-axis-out-of-range", "KVCacheBlockPool.from_layers",
         "token_axis=4 for 4-D arrays", ValueError,
         "token_axis=4 is out of range for an array of 4 dimensions",
         lambda c, mp: _from_layers(c, (6, T, 2, 4), token_axis=4)),
    Case("layers-assign-too-few", "pool.primary = …",
         "one array to a pool over two", ValueError, "pool.primary must hold 2 arrays, got 1",
         lambda c, mp: _assign_layers(c, 1)),
    Case("pool-assign-wrong-shape", "pool.primary = …", "an array of another shape",
         ValueError, f"pool.primary must be float32{POOL_SHAPE}, got float32[2, 2]",
         lambda c, mp: _assign(c.pair[0], "primary", c.array((2, 2), jnp.float32, "device"))),
    Case("pool-assign-wrong-dtype", "pool.primary = …", "an array of another dtype",
         ValueError, f"pool.primary must be float32{POOL_SHAPE}, got bfloat16{POOL_SHAPE}",
         lambda c, mp: _assign(c.pair[0], "primary",
                               c.array((NUM_PRIMARY, *BLOCK), jnp.bfloat16, "device"))),
    Case("pool-assign-wrong-memory-kind", "pool.secondary = …", "a device array", ValueError,
         "pool.secondary must live in memory kind 'pinned_host', got 'device'",
         lambda c, mp: _assign(c.pair[0], "secondary",
                               c.array((NUM_SECONDARY, *BLOCK), jnp.float32, "device"))),
    Case("pool-assign-unpinned-host", "pool.secondary = …", "an unpinned_host array",
         ValueError, "pool.secondary must live in memory kind 'pinned_host', got 'unpinned_host'",
         lambda c, mp: _assign(c.pair[0], "secondary",
                               c.array((NUM_SECONDARY, *BLOCK), jnp.float32, "unpinned_host"))),
    Case("pool-assign-mislabeled-pinned-host", "pool.secondary = …",
         "a pinned_host array whose JAX type says device memory (jax 0.10)", ValueError,
         "pool.secondary is in pinned_host memory but its JAX type says …: this JAX version "
         "mislabels arrays made by jax.jit(..., out_shardings=<pinned_host sharding>); make "
         "them with jax.device_put(x, <pinned_host sharding>) or return them from a jitted "
         "function whose input was already in pinned_host",
         lambda c, mp: _assign(c.pair[0], "secondary",
                               c.mislabeled_pinned_host((NUM_SECONDARY, *BLOCK)))),
    Case("pool-assign-deleted", "pool.primary = …", "a deleted (donated) array", ValueError,
         "pool.primary: the array has been deleted (donated?)",
         lambda c, mp: _assign_deleted(c)),
    Case("pool-assign-numpy", "pool.primary = …", "a NumPy array", TypeError,
         "pool.primary must be a concrete jax.Array, got ndarray",
         lambda c, mp: _assign(c.pair[0], "primary", np.zeros((NUM_PRIMARY, *BLOCK)))),
    Case("pool-assign-secondary-of-size-0", "pool.secondary = …",
         "any array, on a pool with 0 secondary blocks", ValueError,
         "secondary: this pool has 0 secondary blocks; nothing can be assigned",
         lambda c, mp: _assign(c.pool(num_secondary_blocks=0), "secondary", c.src)),
    # -- the manager ---------------------------------------------------------------------------
    Case("manager-primary-index-out-of-range", "offload", "primary block index 6 of 6",
         IndexError, "pairs[0] src has memory_pool_block_index 6, outside the primary pool's 0..5",
         lambda c, mp: lambda: c.manager.offload(P(6), S(0))),
    Case("manager-secondary-index-out-of-range", "offload", "secondary block index 8 of 8",
         IndexError, "pairs[0] dst has memory_pool_block_index 8, outside the secondary pool's "
         "0..7",
         lambda c, mp: lambda: c.manager.offload(P(0), S(8))),
    Case("manager-negative-index", "onboard", "block index -1", IndexError,
         "pairs[0] dst has memory_pool_block_index -1, outside the primary pool's 0..5",
         lambda c, mp: lambda: c.manager.onboard(S(0), P(-1))),
    Case("manager-later-pair-bad", "offload_blocks",
         "a batch whose second pair is out of range (the first is valid)", IndexError,
         "pairs[1] dst has memory_pool_block_index 99, outside the secondary pool's 0..7",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0)), (P(1), S(99))])),
    Case("manager-indices-out-of-range", "offload_indices", "dst [0, 8] on 8 secondary blocks",
         IndexError, "dst[1] is 8, outside the secondary pool's 0..7",
         lambda c, mp: lambda: c.manager.offload_indices([0, 1], [0, 8])),
    Case("manager-indices-negative", "onboard_indices", "src [-1]", IndexError,
         "src[0] is -1, outside the secondary pool's 0..7",
         lambda c, mp: lambda: c.manager.onboard_indices([-1], [0])),
    Case("manager-indices-lengths", "offload_indices", "3 sources, 2 destinations",
         ValueError, "src has 3 entries but dst has 2; give one destination per source",
         lambda c, mp: lambda: c.manager.offload_indices([0, 1, 2], [0, 1])),
    Case("manager-indices-float", "onboard_indices", "dst of floats", TypeError,
         "dst must hold integers, got dtype float64",
         lambda c, mp: lambda: c.manager.onboard_indices([0], [1.0])),
    Case("manager-indices-float-jax-array", "onboard_indices", "dst as a float jax.Array",
         TypeError, "dst must hold integers, got dtype float32",
         lambda c, mp: lambda: c.manager.onboard_indices(jnp.array([0]), jnp.array([1.0]))),
    Case("manager-indices-bool-jax-array", "offload_indices", "src as a bool jax.Array",
         TypeError, "src must hold integers, got dtype bool",
         lambda c, mp: lambda: c.manager.offload_indices(jnp.array([True]), [0])),
    Case("manager-indices-traced", "offload_indices (in jax.jit)", "src traced", TypeError,
         "src must be a 1-D array or sequence of slot indices known on the host, got a traced "
         "value; the manager's verbs are called outside jax.jit",
         lambda c, mp: lambda: jax.jit(lambda i: c.manager.offload_indices(i, [0]) or i)(
             jnp.array([0]))),
    Case("manager-reversed-offload", "offload_blocks", "a host -> GPU pair", ValueError,
         "offload: pairs[1] copies a secondary block into a primary block (KVCacheBlock(…) -> "
         "KVCacheBlock(…)), but offload copies primary -> secondary; that pair is an onboard",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0)), (S(3), P(3))])),
    Case("manager-reversed-onboard", "onboard", "a GPU -> host pair", ValueError,
         "onboard: pairs[0] copies a primary block into a secondary block (KVCacheBlock(…) -> "
         "KVCacheBlock(…)), but onboard copies secondary -> primary or primary -> primary; "
         "that pair is an offload",
         lambda c, mp: lambda: c.manager.onboard(P(4), S(4))),
    Case("manager-offload-within-host", "offload", "a host -> host pair", ValueError,
         "offload: pairs[0] copies a secondary block into a secondary block (KVCacheBlock(…) -> "
         "KVCacheBlock(…)), but offload copies primary -> secondary",
         lambda c, mp: lambda: c.manager.offload(S(5), S(6))),
    Case("manager-reversed-in-both-ways", "offload_and_onboard",
         "an onboard pair that goes GPU -> host", ValueError,
         "onboard: onboard_pairs[0] copies a primary block into a secondary block "
         "(KVCacheBlock(…) -> KVCacheBlock(…)), but onboard copies secondary -> primary or "
         "primary -> primary; that pair is an offload",
         lambda c, mp: lambda: c.manager.offload_and_onboard([(P(0), S(0))], [(P(1), S(1))])),
    Case("manager-indices-2d", "offload_indices", "a 2-D src", ValueError,
         "src must be 1-D, got shape (1, 2)",
         lambda c, mp: lambda: c.manager.offload_indices([[0, 1]], [0, 1])),
    Case("manager-indices-not-a-sequence", "offload_indices", "src=None", TypeError,
         "src must be a 1-D array or sequence of slot indices, got NoneType",
         lambda c, mp: lambda: c.manager.offload_indices(None, [0])),
    Case("manager-indices-tokens-length", "offload_indices", "num_tokens of 1 for 2 pairs",
         ValueError, "num_tokens has 1 entries for 2 pairs",
         lambda c, mp: lambda: c.manager.offload_indices([0, 1], [0, 1], [1])),
    Case("block-index-float", "KVCacheBlock(...)", "memory_pool_block_index=1.0", TypeError,
         "KVCacheBlock.memory_pool_block_index must be an integer, got 1.0",
         lambda c, mp: lambda: c.manager.offload(P(1.0), S(0))),
    Case("block-id-str", "KVCacheBlock(...)", "block_id='7'", TypeError,
         "KVCacheBlock.block_id must be an integer, got '7'",
         lambda c, mp: lambda: kvx.KVCacheBlock(block_id="7", memory_pool_block_index=0,
                                                is_primary=True)),
    Case("manager-not-a-block", "offload", "a tuple instead of a KVCacheBlock", TypeError,
         "pairs[0] dst must be a KVCacheBlock, got (0, False)",
         lambda c, mp: lambda: c.manager.offload(P(0), (0, False))),
    Case("block-is-primary-not-bool", "KVCacheBlock(...)", "is_primary='yes'", TypeError,
         "KVCacheBlock.is_primary must be a bool, got 'yes'",
         lambda c, mp: lambda: c.manager.onboard(
             kvx.KVCacheBlock(block_id=1, memory_pool_block_index=0, is_primary="yes"), P(1))),
    Case("block-is-primary-none", "KVCacheBlock(...)", "is_primary=None", TypeError,
         "KVCacheBlock.is_primary must be a bool, got None",
         lambda c, mp: lambda: kvx.KVCacheBlock(block_id=1, memory_pool_block_index=0,
                                                is_primary=None)),
    Case("manager-pair-length", "offload_blocks", "a 1-tuple as a pair", ValueError,
         "pairs[0] must be a (src_block, dst_block) tuple, got (KVCacheBlock(…),)",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0),)])),
    Case("manager-pair-lengths-mismatched", "offload_blocks",
         "a 3-tuple then a 1-tuple (four blocks for two pairs)", ValueError,
         "pairs[0] must be a (src_block, dst_block) tuple, got (KVCacheBlock(…), "
         "KVCacheBlock(…), KVCacheBlock(…))",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0), P(1)), (S(1),)])),
    Case("manager-index-past-int64", "offload", "block index 2**70", IndexError,
         "pairs[0] src has memory_pool_block_index 1180591620717411303424, outside the primary "
         "pool's 0..5",
         lambda c, mp: lambda: c.manager.offload(P(2**70), S(0))),
    Case("manager-pairs-not-a-sequence", "onboard_blocks", "pairs=None", TypeError,
         "pairs must be a sequence of (src_block, dst_block) tuples",
         lambda c, mp: lambda: c.manager.onboard_blocks(None)),
    Case("manager-num-tokens-float", "offload", "num_tokens=1.5", TypeError,
         "num_tokens must be an integer, got 1.5",
         lambda c, mp: lambda: c.manager.offload(P(0), S(0), 1.5)),
    Case("manager-num-tokens-bool", "offload", "num_tokens=True", TypeError,
         "num_tokens must be an integer, got True",
         lambda c, mp: lambda: c.manager.offload(P(0), S(0), True)),
    Case("manager-layer-groups-over-layers", "KVCacheTransferManager",
         "layer_groups=2 over pools of one layer", ValueError,
         "layer_groups must be between 1 and the pools' fewest layers (1), got 2",
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.manager.pools, layer_groups=2)),
    Case("manager-layer-wise-blocking", "sync_transfers", "layer_wise=True with block=True",
         ValueError, "layer_wise=True needs block=False: a blocking sync waits for every layer "
         "already",
         lambda c, mp: lambda: c.manager.sync_transfers(layer_wise=True)),
    Case("manager-wait-for-no-layers", "wait_for_layers", "layers=0", ValueError,
         "layers must be at least 1, got 0",
         lambda c, mp: lambda: kvx.wait_for_layers(c.manager.pools[0].primary, 0)),
    Case("manager-num-tokens-str", "onboard", "num_tokens='2'", TypeError,
         "num_tokens must be an integer, got '2'",
         lambda c, mp: lambda: c.manager.onboard(S(0), P(0), "2")),
    Case("manager-batch-num-tokens-float", "offload_blocks", "num_tokens=1.5 for a batch",
         TypeError, TOKENS_TYPE + "1.5",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0))], 1.5)),
    Case("manager-batch-num-tokens-str", "onboard_blocks", "num_tokens='2' for a batch",
         TypeError, TOKENS_TYPE + "'2'",
         lambda c, mp: lambda: c.manager.onboard_blocks([(S(0), P(0))], "2")),
    Case("manager-num-tokens-float-jax-array", "offload_blocks",
         "num_tokens as a float jax.Array", TypeError,
         "num_tokens[0] must be an integer, got …1.5…",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0))], jnp.array([1.5]))),
    Case("manager-num-tokens-float-entry", "offload_blocks", "num_tokens=[1.0]", TypeError,
         "num_tokens[0] must be an integer, got 1.0",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0))], [1.0])),
    Case("manager-num-tokens-length", "offload_blocks", "two token counts for one pair",
         ValueError, "num_tokens has 2 entries for 1 pairs",
         lambda c, mp: lambda: c.manager.offload_blocks([(P(0), S(0))], [1, 2])),
    Case("manager-secondary-of-size-0", "offload",
         "an offload into pools with 0 secondary blocks", ValueError,
         "pairs[0] dst is a secondary block, but the pools have 0 secondary blocks",
         lambda c, mp: _no_secondary_manager(c, "offload")),
    Case("manager-onboard-from-size-0", "onboard",
         "an onboard from pools with 0 secondary blocks", ValueError,
         "pairs[0] src is a secondary block, but the pools have 0 secondary blocks",
         lambda c, mp: _no_secondary_manager(c, "onboard")),
    Case("manager-donated-primary", "offload",
         "pool.primary donated to the user's jitted step, result not assigned back", ValueError,
         "offload: pool.primary has been deleted — it was donated to a jitted function; "
         "assign the function's result back to pool.primary",
         lambda c, mp: _donated_primary(c)),
    Case("manager-deleted-secondary", "onboard", "pool.secondary deleted", ValueError,
         "onboard: pool.secondary has been deleted — it was donated to a jitted function; "
         "assign the function's result back to pool.secondary",
         lambda c, mp: _deleted_secondary(c)),
    Case("manager-sub-byte-odd-partial", "offload",
         "partial offload of an int4 pool with odd size_per_head (3)", ValueError,
         "partial copies of int4 need an even size_per_head (a token row must be a whole "
         "number of bytes), got size_per_head=3; copy whole blocks (num_tokens=None) instead",
         lambda c, mp: _odd_int4_manager(c)),
    Case("manager-pools-disagree-tokens", "KVCacheTransferManager",
         "pools with 4 and 8 tokens per block", ValueError,
         "pools[1].tokens_per_block is 8, but pools[0].tokens_per_block is 4: the pools of one "
         "manager must agree on it",
         lambda c, mp: _disagreeing_pools(c, tokens_per_block=8)),
    Case("manager-pools-disagree-primary", "KVCacheTransferManager",
         "pools with 6 and 5 primary blocks", ValueError,
         "pools[1].num_primary_blocks is 5, but pools[0].num_primary_blocks is 6: the pools of "
         "one manager must agree on it",
         lambda c, mp: _disagreeing_pools(c, num_primary_blocks=5)),
    Case("manager-pools-disagree-secondary", "KVCacheTransferManager",
         "pools with 8 and 0 secondary blocks", ValueError,
         "pools[1].num_secondary_blocks is 0, but pools[0].num_secondary_blocks is 8: the "
         "pools of one manager must agree on it",
         lambda c, mp: _disagreeing_pools(c, num_secondary_blocks=0)),
    Case("manager-same-pool-twice", "KVCacheTransferManager", "one pool passed twice",
         ValueError, "pools holds the same KVCacheBlockPool twice; pass each pool once",
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.pair[:1] * 2).offload(P(0), S(0))),
    Case("manager-no-pools", "KVCacheTransferManager", "an empty list", ValueError,
         "pools must hold at least one KVCacheBlockPool",
         lambda c, mp: lambda: kvx.KVCacheTransferManager([])),
    Case("manager-not-a-pool", "KVCacheTransferManager", "a string among the pools",
         TypeError, "pools[1] must be a KVCacheBlockPool, got str",
         lambda c, mp: lambda: kvx.KVCacheTransferManager([c.pair[0], "pool"])),
    Case("manager-dma-int", "KVCacheTransferManager", "dma=1", TypeError,
         'dma must be True, False or "auto", got 1',
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.pair, dma=1)),
    Case("manager-dma-not-a-choice", "KVCacheTransferManager", "dma='fast'", TypeError,
         'dma must be True, False or "auto", got \'fast\'',
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.pair, dma="fast")),
    Case("manager-dma-without-ring", "KVCacheTransferManager", "dma=True, plan_ring=False",
         ValueError, "dma=True needs plan_ring=True: the copy engines are handed the block "
         "indices from the plan ring's pinned_host arrays",
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.pair, dma=True, plan_ring=False)),
    Case("block-manager-events-not-a-publisher", "BlockManager", "events='tcp://*:5557'",
         TypeError, "events must be a jax_kvxfer.observe.events.KVEventPublisher or None, got str",
         lambda c, mp: lambda: kvx.BlockManager(c.pair, events="tcp://*:5557")),
    Case("block-manager-metrics-not-bool", "BlockManager", "metrics='yes'", TypeError,
         "metrics must be True, False or None (report once a metrics server runs), got 'yes'",
         lambda c, mp: lambda: kvx.BlockManager(c.pair, metrics="yes")),
    Case("manager-metrics-not-bool", "KVCacheTransferManager", "metrics=1", TypeError,
         "metrics must be True, False or None (report once a metrics server runs), got 1",
         lambda c, mp: lambda: kvx.KVCacheTransferManager(c.pair, metrics=1)),
    Case("events-endpoint-no-scheme", "events.KVEventPublisher", "endpoint='localhost:5557'",
         ValueError, "endpoint must be a ZMQ endpoint string such as 'tcp://*:5557' or "
         "'ipc:///tmp/kv-events', got 'localhost:5557'",
         lambda c, mp: lambda: kv_events.KVEventPublisher("localhost:5557")),
    Case("events-replay-endpoint", "events.KVEventPublisher", "replay_endpoint=5558",
         ValueError, "replay_endpoint must be a ZMQ endpoint string such as 'tcp://*:5557' or "
         "'ipc:///tmp/kv-events', got 5558",
         lambda c, mp: lambda: kv_events.KVEventPublisher("tcp://*:5557", replay_endpoint=5558)),
    Case("events-buffer-steps-zero", "events.KVEventPublisher", "buffer_steps=0", ValueError,
         "buffer_steps must be at least 1, got 0",
         lambda c, mp: lambda: kv_events.KVEventPublisher("tcp://*:5557", buffer_steps=0)),
    Case("events-hwm-float", "events.KVEventPublisher", "hwm=1.5", TypeError,
         "hwm must be an integer, got 1.5",
         lambda c, mp: lambda: kv_events.KVEventPublisher("tcp://*:5557", hwm=1.5)),
    Case("events-topic-bytes", "events.KVEventPublisher", "topic=b'kv'", TypeError,
         "topic must be a str, got b'kv'",
         lambda c, mp: lambda: kv_events.KVEventPublisher("tcp://*:5557", topic=b"kv")),
    Case("metrics-port-range", "metrics.start_metrics_server", "port=70000", ValueError,
         "port must be in 0..65535 (0: a free port), got 70000",
         lambda c, mp: lambda: kv_metrics.start_metrics_server(70000)),
    Case("metrics-port-str", "metrics.start_metrics_server", "port='9090'", TypeError,
         "port must be an integer, got '9090'",
         lambda c, mp: lambda: kv_metrics.start_metrics_server("9090")),
    Case("metrics-addr-none", "metrics.start_metrics_server", "addr=None", TypeError,
         "addr must be a non-empty str (an address to bind), got None",
         lambda c, mp: lambda: kv_metrics.start_metrics_server(9090, addr=None)),
]


def _params():
    for case in CASES:
        marks = []
        if case.id in KNOWN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case.id]))
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="module", autouse=True)
def _older_objects_frozen():
    """Each case collects garbage twice (to count the arrays a failed call left alive); what
    the tests before this module left on the heap is frozen out of those collections, which
    otherwise take most of this module's time in a whole run."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input(case: Case, monkeypatch: pytest.MonkeyPatch):
    ctx = Ctx(seed=sum(map(ord, case.id)))
    call = case.setup(ctx, monkeypatch)
    snap = ctx.snapshot()
    error: BaseException | None = None
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is asserted below
        error = e
    assert error is not None, f"{case.id}: no exception"
    got = f"{type(error).__name__}: {error}"
    del error  # drops the traceback and whatever its frames hold
    assert got.split(":", 1)[0] == case.error.__name__, f"{case.id}: got {got}"
    assert message_matches(got.split(": ", 1)[1], case.message), (
        f"{case.id}: message\n  {got}\ndoes not match\n  {case.message}")
    ctx.assert_unchanged(snap)


def test_case_ids_are_unique_and_known_bugs_exist():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert set(KNOWN_BUGS) <= set(ids)


def test_message_matcher():
    assert message_matches("a b c", "a b c")
    assert message_matches("a XX c", "a … c")
    assert not message_matches("a b c d", "a b c")
    assert not message_matches("x a b c", "a b c")


# ---------------------------------------------------------------------------------------------
# the doc table, generated from CASES


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table() -> str:
    lines = ["| id | called | bad input | exception | message (… varies) |",
             "| --- | --- | --- | --- | --- |"]
    for c in CASES:
        bug = " **(bug: fix proposed, test xfails)**" if c.id in KNOWN_BUGS else ""
        lines.append(f"| `{c.id}` | `{_cell(c.api)}` | {_cell(c.bad)}{bug} | "
                     f"`{c.error.__name__}` | `{_cell(c.message)}` |")
    return "\n".join(lines)


def render_doc(current: str) -> str:
    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"


def test_doc_table_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{DOC} lost its table markers"
    assert render_doc(text) == text, (
        f"{DOC.name} differs from CASES in tests/test_bad_inputs.py: run "
        "`python tests/test_bad_inputs.py` to regenerate it")


if __name__ == "__main__":
    DOC.write_text(render_doc(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {DOC} ({len(CASES)} cases)")
    sys.exit(0)
