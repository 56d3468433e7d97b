"""Onboards that land in groups of layers, and a step that waits for its layers group by group.

A manager with `layer_groups` enqueues an onboard's copies group by group on the onboard lane,
each group's event marked (ffi/lanes_cuda.cu, `SplitLayerGroups` of ffi/dma_plan.h); a step
synced with `sync_transfers(block=False, layer_wise=True)` waits inside itself for the first
layers it reads (`wait_for_layers`). The CPU module runs the same split, so these tests check
its bytes on the CPU too; every check compares with a NumPy shadow of the pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer import testing

LAYERS, TOKENS, NB = 5, 4, 12


def fresh_pool(rng, dtype=jnp.float32):
    pool = kvx.KVCacheBlockPool.create(num_layers=LAYERS, num_kv_heads=2, size_per_head=8,
                                       tokens_per_block=TOKENS, dtype=dtype,
                                       num_primary_blocks=NB, num_secondary_blocks=NB)
    shape = pool.primary.shape
    pool.primary = jax.device_put(rng.standard_normal(shape).astype(dtype),
                                  pool.sharding("device"))
    pool.secondary = jax.device_put(rng.standard_normal(shape).astype(dtype),
                                    pool.sharding("pinned_host"))
    return pool


def apply(shadow_dst, shadow_src, src, dst, tokens):
    """The pairs in order on NumPy copies: the reference."""
    for s, d, n in zip(src, dst, tokens):
        n = TOKENS if n <= 0 or n >= TOKENS else n
        shadow_dst[d, ..., :n, :] = shadow_src[s, ..., :n, :]


def random_pairs(rng, n):
    """n pairs with random slots (some destination written twice) and token counts."""
    return (rng.integers(0, NB, n).tolist(), rng.integers(0, NB, n).tolist(),
            rng.integers(0, TOKENS + 1, n).tolist())


@pytest.mark.parametrize("groups", [2, 3, LAYERS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_onboards_in_layer_groups_copy_what_the_pairs_say(rng, groups, dtype):
    """Onboards and offloads in turn, each onboard split into `groups` groups of layers, then a
    step that waits for every layer group by group: the step reads what the pairs in order
    give, and the host pool holds what the offloads copied."""
    pool = fresh_pool(rng, dtype)
    mgr = kvx.KVCacheTransferManager([pool], layer_groups=groups)
    primary, secondary = kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)
    for _ in range(3):
        src, dst, tokens = random_pairs(rng, int(rng.integers(1, 20)))
        mgr.onboard_indices(src, dst, tokens)
        apply(primary, secondary, src, dst, tokens)
        src, dst, tokens = random_pairs(rng, int(rng.integers(1, 6)))
        mgr.offload_indices(src, dst, tokens)
        apply(secondary, primary, src, dst, tokens)
    src, dst, tokens = random_pairs(rng, 9)
    mgr.onboard_indices(src, dst, tokens)
    apply(primary, secondary, src, dst, tokens)

    @jax.jit
    def step(pool_array):
        parts = []
        for g in range(groups):  # each group's layers read after its wait
            lo, hi = kvx.layer_group_bounds(g, groups, LAYERS)
            pool_array = kvx.wait_for_layers(pool_array, hi)
            parts.append(pool_array[:, lo:hi] * 1)
        return jnp.concatenate(parts, axis=1), pool_array

    with testing.count_dispatches("JOIN") as joins:
        mgr.sync_transfers(block=False, layer_wise=True)
    assert not joins and not mgr.pending_transfers  # the step joins, not the sync
    read, pool.primary = step(pool.primary)
    np.testing.assert_array_equal(np.asarray(read), primary)
    mgr.sync_transfers()
    np.testing.assert_array_equal(kvx.to_numpy(pool.primary), primary)
    np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), secondary)


def test_layer_groups_over_an_engine_s_arrays(rng):
    """A pool over per-layer arrays (K and V apart): a load in groups of arrays lands each
    array's pages as the pairs say, whole and partial."""
    arrays = [jnp.asarray(rng.standard_normal((NB, TOKENS, 2, 8)), jnp.float32)
              for _ in range(6)]
    pool = kvx.KVCacheBlockPool.from_layers(arrays, token_axis=1, num_secondary_blocks=NB)
    rows = rng.standard_normal(pool.secondary.shape).astype(np.float32)
    pool.secondary = jax.device_put(rows, pool.sharding("pinned_host"))
    mgr = kvx.KVCacheTransferManager([pool], layer_groups=4)
    want = [kvx.to_numpy(a) for a in pool.primary]
    src, dst, tokens = random_pairs(rng, 10)
    per_array = rows.reshape(NB, 6, TOKENS, 2, 8)  # a row: each array's block in order
    for i, w in enumerate(want):
        for s, d, n in zip(src, dst, tokens):
            n = TOKENS if n <= 0 or n >= TOKENS else n
            w[d, :n] = per_array[s, i, :n]
    mgr.onboard_indices(src, dst, tokens)
    mgr.sync_transfers(block=False, layer_wise=True)
    step = jax.jit(lambda xs: [kvx.wait_for_layers(x, i + 1) + 0 for i, x in enumerate(xs)])
    for i, (got, w) in enumerate(zip(step(pool.primary), want)):
        np.testing.assert_array_equal(np.asarray(got), w, err_msg=f"array {i}")


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, r"layer_groups must be between 1 and the pools' fewest layers \(5\), got 0"),
    (LAYERS + 1, ValueError, "got 6"),
    (True, TypeError, "layer_groups must be an integer"),
    (2.0, TypeError, "layer_groups must be an integer"),
])
def test_bad_layer_groups_are_named(rng, value, error, match):
    with pytest.raises(error, match=match):
        kvx.KVCacheTransferManager([fresh_pool(rng)], layer_groups=value)


def test_bad_layer_waits_are_named(rng):
    pool = fresh_pool(rng)
    mgr = kvx.KVCacheTransferManager([pool], layer_groups=2)
    before = kvx.to_numpy(pool.primary)
    mgr.onboard_indices([1], [2])
    with pytest.raises(ValueError, match="layer_wise=True needs block=False"):
        mgr.sync_transfers(layer_wise=True)
    assert mgr.pending_transfers  # nothing synced
    for layers, error in ((0, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="layers must be"):
            kvx.wait_for_layers(pool.primary, layers)
    mgr.sync_transfers()
    before[2] = kvx.to_numpy(pool.secondary)[1]
    np.testing.assert_array_equal(kvx.to_numpy(pool.primary), before)
