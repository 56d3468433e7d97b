"""Tests of `copy_blocks(..., dma=True)`: the copy on the GPU's copy engines, against the NumPy
reference on fresh random data.

On a GPU the handler reads the indices on the host and enqueues copies (whole runs merged, a
strided copy per partial block, one copy at a time in pair order when two pairs write one
block); `dma_batches` counts the batches it copied that way, so each GPU test also checks that
the DMA path, not the kernel, did the work. On CPU `dma` changes nothing but the checks of its
arguments, and the copies must still be exact.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    assert_bitwise_equal,
    assert_unchanged,
    make_pools,
    put,
    reference_copy_blocks,
)

import jax_kvxfer as kvx
from jax_kvxfer import testing
from jax_kvxfer.ops._plan import DMA_AUTO_MIN_BLOCK_BYTES

SHAPE = (24, 2, 2, 4, 16, 64)  # 24 blocks of 64 KiB (float32)
T = SHAPE[4]
DIRECTIONS = [("pinned_host", "device"), ("device", "pinned_host")]  # (dst, src): offload, onboard


def dma_batches() -> int | None:
    """Batches the CUDA handler has copied on the copy engines (None without a GPU)."""
    return testing.dma_batches() if ON_GPU else None


def check_dma_used(before: int | None, calls: int) -> None:
    if before is not None:
        assert dma_batches() - before == calls, "the copy did not take the DMA path"


def pinned(x: np.ndarray) -> jax.Array:
    return jax.block_until_ready(put(np.asarray(x, np.int32), "pinned_host"))


@pytest.mark.parametrize("dst_kind, src_kind", DIRECTIONS)
@pytest.mark.parametrize("case", ["whole_runs", "partial", "duplicates"])
def test_dma_copies_exactly(dst_kind, src_kind, case, rng):
    dst, src = make_pools(rng, SHAPE, jnp.float32)
    if case == "whole_runs":  # adjacent in both pools (merged into one copy), then scattered
        si = np.array([4, 5, 6, 7, 20, 2, -1], np.int32)
        di = np.array([10, 11, 12, 13, 0, 3, 5], np.int32)
        nt = None
    else:
        si = rng.permutation(SHAPE[0])[:12].astype(np.int32)
        di = rng.permutation(SHAPE[0])[:12].astype(np.int32)
        si[3] = -1  # padding
        nt = rng.integers(-1, T + 2, 12).astype(np.int32)  # whole, partial and n = 1
        if case == "duplicates":  # three later pairs write block di[0]: the last wins per token
            di[5:8] = di[0]
            nt[0], nt[5:8] = T, [T // 2, 1, T - 3]
    expected = reference_copy_blocks(dst, src, si, di, nt)

    before = dma_batches()
    eager = kvx.copy_blocks(put(dst, dst_kind), put(src, src_kind), si, di, nt, dma=True)
    assert eager.sharding.memory_kind == dst_kind
    assert_bitwise_equal(eager, expected, f"eager, {case}")
    check_dma_used(before, 1)

    # inside jit: the indices are jit arguments in pinned_host memory
    tokens = () if nt is None else (pinned(nt),)
    fn = jax.jit(lambda d, s, a, b, *n: kvx.copy_blocks(d, s, a, b, *n, dma=True),
                 donate_argnums=0)
    before = dma_batches()
    out = fn(put(dst, dst_kind), put(src, src_kind), pinned(si), pinned(di), *tokens)
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, expected, f"jit, {case}")
    check_dma_used(before, 1)


def test_dma_offload_and_compute_in_one_jit(rng):
    """An offload on the copy engines in the jit of a step, both exact."""
    host, dev = make_pools(rng, SHAPE, jnp.bfloat16)
    si = rng.permutation(SHAPE[0])[:16].astype(np.int32)
    di = rng.permutation(SHAPE[0])[:16].astype(np.int32)
    x = rng.integers(-50, 50, (64, 64)).astype(np.int32)

    def step(h, d, a, b, x):
        y = jnp.cumsum(x @ x, axis=0)
        return kvx.copy_blocks(h, d, a, b, dma=True), y

    before = dma_batches()
    out, y = jax.jit(step, donate_argnums=0)(put(host, "pinned_host"), put(dev), pinned(si),
                                              pinned(di), jnp.asarray(x))
    assert_bitwise_equal(out, reference_copy_blocks(host, dev, si, di, None), "offload")
    np.testing.assert_array_equal(np.asarray(y), np.cumsum(x @ x, axis=0))
    check_dma_used(before, 1)


@pytest.mark.parametrize("what", ["device_indices", "same_kind_pools", "constant_indices",
                                  "device_tokens"])
def test_dma_bad_arguments_raise_and_leave_pools_unchanged(what, rng):
    dst, src = make_pools(rng, SHAPE, jnp.float32)
    d, s = put(dst, "pinned_host"), put(src)
    si, di = np.array([0, 1], np.int32), np.array([2, 3], np.int32)
    if what == "device_indices":
        call = lambda: jax.jit(lambda d, s, a, b: kvx.copy_blocks(d, s, a, b, dma=True))(
            d, s, jnp.asarray(si), jnp.asarray(di))
        error, match = ValueError, "dma=True needs src_indices in pinned_host memory"
    elif what == "same_kind_pools":
        d = put(dst)
        call = lambda: kvx.copy_blocks(d, s, si, di, dma=True)
        error, match = ValueError, "dma=True copies between device and pinned_host memory"
    elif what == "constant_indices":
        call = lambda: jax.jit(lambda d, s: kvx.copy_blocks(d, s, si, di, dma=True))(d, s)
        error, match = ValueError, "dma=True inside jax.jit needs src_indices in pinned_host"
    elif what == "device_tokens":
        call = lambda: jax.jit(lambda d, s, a, b, n: kvx.copy_blocks(d, s, a, b, n, dma=True))(
            d, s, pinned(si), pinned(di), jnp.asarray([1, 2], jnp.int32))
        error, match = ValueError, "dma=True needs num_tokens in pinned_host memory"
    with pytest.raises(error, match=match):
        call()
    assert_unchanged(d, dst, "dst_pool")
    assert_unchanged(s, src, "src_pool")


BIG = (8, 2, 2, 4, 16, 512)  # 8 blocks of 256 KiB (float32): DMA_AUTO_MIN_BLOCK_BYTES


@pytest.mark.parametrize("case, engines", [
    ("eager_whole_offload", True), ("eager_whole_onboard", True),
    ("eager_partial", False), ("eager_small_blocks", False), ("eager_max_ctas", False),
    ("eager_device_to_device", False), ("jit_whole", False)])
def test_dma_auto_picks_copy_engines_for_large_whole_blocks_outside_jit(case, engines, rng):
    """The default dma="auto": the copy engines exactly for eager whole-block copies of
    >= DMA_AUTO_MIN_BLOCK_BYTES between device and pinned_host memory (on a GPU), the kernel
    otherwise; exact either way."""
    shape = SHAPE if case == "eager_small_blocks" else BIG
    assert (math.prod(shape[1:]) * 4 >= DMA_AUTO_MIN_BLOCK_BYTES) == (shape == BIG)
    dst, src = make_pools(rng, shape, jnp.float32)
    dst_kind, src_kind = {"eager_whole_onboard": ("device", "pinned_host"),
                          "eager_device_to_device": ("device", "device")}.get(
                              case, ("pinned_host", "device"))
    si = rng.permutation(shape[0])[:5].astype(np.int32)
    di = rng.permutation(shape[0])[:5].astype(np.int32)
    nt = np.array([3, T, 0, 1, T - 1], np.int32) if case == "eager_partial" else None
    kwargs = {"max_ctas": 4} if case == "eager_max_ctas" else {}
    expected = reference_copy_blocks(dst, src, si, di, nt)
    d, s = put(dst, dst_kind), put(src, src_kind)
    before = dma_batches()
    if case == "jit_whole":
        out = jax.jit(kvx.copy_blocks, donate_argnums=0)(d, s, jnp.asarray(si), jnp.asarray(di))
    else:
        out = kvx.copy_blocks(d, s, si, di, nt, **kwargs)
    assert_bitwise_equal(out, expected, case)
    if before is not None:
        assert dma_batches() - before == int(engines), case
