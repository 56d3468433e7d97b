"""Tests of copy_blocks' launch option `max_ctas` (the GPU grid cap), and of copies beside other
work in one jit, against the NumPy reference on fresh random data.

On CPU `max_ctas` changes nothing but the copy must still be exact; on a GPU the capped grid
walks many work units per CTA, so these tests then exercise that path. (Copies beside compute
on streams of their own are the manager's transfer lanes: tests/manager.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_bitwise_equal,
    assert_unchanged,
    make_pools,
    put,
    reference_copy_blocks,
)

import jax_kvxfer as kvx

# 24 blocks of 2 x 2 x 4 x 16 x 64 float32 = 64 KiB: four 16 KiB work units per pair on the GPU,
# so a grid of 1-3 CTAs loops over many units and pairs.
SHAPE = (24, 2, 2, 4, 16, 64)
T = SHAPE[4]
KINDS = ("device", "pinned_host")


def random_batch(rng: np.random.Generator, batch: int, blocks: int, duplicates: bool):
    src = rng.permutation(blocks)[:batch].astype(np.int32)
    dst = rng.permutation(blocks)[:batch].astype(np.int32)
    if duplicates:  # a few pairs write one block: the later pair wins per token
        dst[batch // 2:batch // 2 + 3] = dst[0]
    src[1] = -1  # padding
    tokens = rng.integers(-1, T + 2, batch).astype(np.int32)  # whole, partial and n=1 copies
    return src, dst, tokens


@pytest.mark.parametrize("max_ctas", [1, 3, 2**40, None])
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_max_ctas_copies_exactly(dst_kind, src_kind, max_ctas, rng):
    dst, src = make_pools(rng, SHAPE, jnp.float32)
    si, di, nt = random_batch(rng, 16, SHAPE[0], duplicates=True)
    fn = jax.jit(lambda d, s, a, b, n: kvx.copy_blocks(d, s, a, b, n, max_ctas=max_ctas),
                 donate_argnums=0)
    expected = reference_copy_blocks(dst, src, si, di, nt)
    out = fn(put(dst, dst_kind), put(src, src_kind), si, di, nt)
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, expected, f"max_ctas={max_ctas}")
    # eagerly, with known indices (the duplicate scan is then skipped only if unique)
    eager = kvx.copy_blocks(put(dst, dst_kind), put(src, src_kind), si, di, nt, max_ctas=max_ctas)
    assert_bitwise_equal(eager, expected, "eager")


@pytest.mark.parametrize("max_ctas", [1, 2])
def test_max_ctas_within_one_pool_reads_the_old_blocks(max_ctas, rng):
    pool, _ = make_pools(rng, SHAPE, jnp.bfloat16)
    # block 3 is read by one pair and written by another: the copy must stage its sources
    si, di = np.array([3, 5, 7, 9], np.int32), np.array([5, 3, 11, 7], np.int32)
    nt = np.array([0, T // 2, 1, T - 1], np.int32)
    fn = jax.jit(lambda p, a, b, n: kvx.copy_blocks(p, p, a, b, n, max_ctas=max_ctas),
                 donate_argnums=0)
    out = fn(put(pool), si, di, nt)
    assert_bitwise_equal(out, reference_copy_blocks(pool, pool, si, di, nt))


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_copy_beside_other_work_in_one_jit(dst_kind, src_kind, rng):
    dst, src = make_pools(rng, SHAPE, jnp.float32)
    si, di, nt = random_batch(rng, 12, SHAPE[0], duplicates=False)

    def step(d, s, a, b, n, x):
        y = jnp.tanh(x @ x)  # other work in the same jit
        return kvx.copy_blocks(d, s, a, b, n), y

    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    out, y = jax.jit(step, donate_argnums=0)(put(dst, dst_kind), put(src, src_kind), si, di, nt, x)
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, nt))
    np.testing.assert_allclose(np.asarray(y), np.tanh(np.asarray(x) @ np.asarray(x)),
                               rtol=2e-2, atol=2e-2)


def test_offload_and_onboard_then_used(rng):
    """Both directions in one jit, then a read of each result in the same jit: XLA must make
    the reads wait for their copies."""
    dev, host_src = make_pools(rng, SHAPE, jnp.int32)
    host, dev_src = make_pools(rng, SHAPE, jnp.int32)
    off_s, off_d, off_n = random_batch(rng, 10, SHAPE[0], duplicates=False)
    on_s, on_d, on_n = random_batch(rng, 10, SHAPE[0], duplicates=True)

    def both(host, dev, dev_src, host_src):
        host = kvx.copy_blocks(host, dev_src, off_s, off_d, off_n)
        dev = kvx.copy_blocks(dev, host_src, on_s, on_d, on_n)
        return host, dev, dev.astype(jnp.uint32).sum(dtype=jnp.uint32)  # wraps like NumPy

    host_out, dev_out, total = jax.jit(both, donate_argnums=(0, 1))(
        put(host, "pinned_host"), put(dev), put(dev_src), put(host_src, "pinned_host"))
    expected_host = reference_copy_blocks(host, dev_src, off_s, off_d, off_n)
    expected_dev = reference_copy_blocks(dev, host_src, on_s, on_d, on_n)
    assert_bitwise_equal(host_out, expected_host, "offload")
    assert_bitwise_equal(dev_out, expected_dev, "onboard")
    assert int(total) == int(expected_dev.astype(np.uint32).sum(dtype=np.uint32))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                        (True, TypeError), ("1", TypeError)])
def test_bad_max_ctas_raise_and_leave_pools_unchanged(bad, error, rng):
    dst, src = make_pools(rng, SHAPE, jnp.float32)
    d, s = put(dst), put(src)
    with pytest.raises(error, match=f"max_ctas must be None or a positive int, got {bad!r}"):
        kvx.copy_blocks(d, s, [0, 1], [2, 3], max_ctas=bad)
    assert_unchanged(d, dst, "dst_pool")
    assert_unchanged(s, src, "src_pool")


def test_offload_and_onboard_between_the_same_two_pools(rng):
    """The serving pattern in one jit: evict GPU blocks to the host pool and bring other host
    blocks back into the GPU pool. Each copy reads the pool the other one writes, so XLA must
    order (or copy) them: every read sees the pools as they were before the call."""
    gpu, host = make_pools(rng, SHAPE, jnp.bfloat16)
    evict_from = np.array([0, 5, 9, 13], np.int32)   # GPU blocks to save
    evict_to = np.array([2, 3, 4, 6], np.int32)      # host slots they go to
    reuse_from = np.array([3, 7, 8], np.int32)       # host blocks to bring back (slot 3 is
    reuse_to = np.array([5, 1, 20], np.int32)        # also written by the eviction above)

    def serve(host, gpu):
        new_host = kvx.copy_blocks(host, gpu, evict_from, evict_to)
        new_gpu = kvx.copy_blocks(gpu, host, reuse_from, reuse_to)
        return new_host, new_gpu

    new_host, new_gpu = jax.jit(serve, donate_argnums=(0, 1))(put(host, "pinned_host"), put(gpu))
    assert_bitwise_equal(new_host, reference_copy_blocks(host, gpu, evict_from, evict_to),
                         "host pool")
    assert_bitwise_equal(new_gpu, reference_copy_blocks(gpu, host, reuse_from, reuse_to),
                         "GPU pool")
