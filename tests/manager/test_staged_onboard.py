"""Onboards of small host rows in runs, through a staging buffer in device memory.

On a GPU the lanes copy each run of consecutive host rows into staging in one copy, then the
copy kernel moves each block to its GPU slot (ffi/lanes_cuda.cu, StageOnboard). The tests check
that it is taken where it should be, and that what it copies is what one copy per pair copies:
back to back without a sync (the kernel reads its own copy of the indices, not the plan ring's
slot, which a later call may be writing), right after an offload that writes the rows it
reads, beside a step that reads what it wrote, and over an engine's per-layer arrays. On the CPU
the same calls check the semantics. Every check compares with a NumPy shadow of the pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer import testing
from jax_kvxfer.bench.peers import rows_in_runs

ON_GPU = jax.default_backend() == "gpu"
# 16 KiB blocks of float32: small rows, where staging pays
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "size_per_head": 128, "tokens_per_block": 4}
NB = 256


@pytest.fixture
def pool(rng):
    pool = kvx.KVCacheBlockPool.create(**GEOMETRY, dtype=jnp.float32, num_primary_blocks=NB,
                                       num_secondary_blocks=NB)
    shape = pool.primary.shape
    pool.primary = jax.device_put(rng.standard_normal(shape, np.float32), pool.sharding("device"))
    pool.secondary = jax.device_put(rng.standard_normal(shape, np.float32),
                                    pool.sharding("pinned_host"))
    return pool


def runs_of_rows(rng, n, run=8):
    """n distinct host rows in runs of `run` consecutive rows, runs in random order."""
    return rows_in_runs(rng, n, NB, run)


def staged_count() -> int:
    return testing.staged_onboards() or 0


def assert_pools(pool, primary, secondary):
    np.testing.assert_array_equal(kvx.to_numpy(pool.primary), primary)
    np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), secondary)


def test_onboards_in_runs_back_to_back_are_staged_and_exact(pool, rng):
    prim, sec = kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)
    mgr = kvx.KVCacheTransferManager([pool])
    before = staged_count()
    # one batch size bucket (64), more calls than the plan ring has slots for it (16): its
    # slots are written again while the lane's kernels of earlier calls may still be pending
    calls = 40
    for _ in range(calls):
        n = int(rng.integers(33, 65))
        rows, pages = runs_of_rows(rng, n), rng.permutation(NB)[:n]
        mgr.onboard_indices(rows, pages)  # no sync between
        prim[pages] = sec[rows]
    mgr.sync_transfers()
    assert_pools(pool, prim, sec)
    if ON_GPU:
        assert staged_count() - before == calls


def test_scattered_rows_and_a_block_written_twice_are_not_staged(pool, rng):
    prim, sec = kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)
    mgr = kvx.KVCacheTransferManager([pool])
    before = staged_count()
    rows = np.arange(0, NB, 2)[rng.permutation(NB // 2)[:64]]  # no two rows follow each other
    pages = rng.permutation(NB)[:64]
    mgr.onboard_indices(rows, pages)
    prim[pages] = sec[rows]
    rows, pages = runs_of_rows(rng, 32), rng.permutation(NB)[:32]
    pages[5] = pages[20]  # written twice: the later pair wins
    mgr.onboard_indices(rows, pages)
    prim[pages] = sec[rows]
    mgr.sync_transfers()
    assert_pools(pool, prim, sec)
    assert staged_count() == before


def test_staging_off_copies_the_same(pool, rng):
    prim, sec = kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)
    mgr = kvx.KVCacheTransferManager([pool])
    with testing.onboard_staging(0):
        before = staged_count()
        rows, pages = runs_of_rows(rng, 80), rng.permutation(NB)[:80]
        mgr.onboard_indices(rows, pages)
        mgr.sync_transfers()
        prim[pages] = sec[rows]
        assert_pools(pool, prim, sec)
        assert staged_count() == before


def test_a_staged_onboard_reads_what_a_pending_offload_wrote(pool, rng):
    prim, sec = kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)
    mgr = kvx.KVCacheTransferManager([pool])
    rows = runs_of_rows(rng, 96)
    mgr.offload_indices(np.arange(96), rows)
    sec[rows] = prim[:96]
    pages = np.arange(96, 192)[rng.permutation(96)]
    mgr.onboard_indices(rows, pages)  # lane 1 waits for lane 0
    prim[pages] = sec[rows]
    # a step reads what the onboard wrote, after a non-blocking sync (XLA's stream waits)
    mgr.sync_transfers(block=False)
    got = jax.jit(lambda a, i: a[i] * 1.0)(pool.primary, jnp.asarray(pages))
    np.testing.assert_array_equal(np.asarray(got), prim[pages])
    mgr.sync_transfers()
    assert_pools(pool, prim, sec)


def test_per_layer_arrays_are_staged_whole_rows(rng):
    """An engine's per-layer arrays (K/V first): a host row holds every layer's part of a block;
    the staged copy moves whole rows and the kernel scatters each layer's part."""
    layers, shape = 4, (2, NB, 4, 2, 64)  # [K/V, blocks, tokens, heads, head_dim] of float32
    host = [rng.standard_normal(shape, np.float32) for _ in range(layers)]
    pool = kvx.KVCacheBlockPool.from_layers([jnp.asarray(a) for a in host], token_axis=2,
                                            block_axis=1, num_secondary_blocks=NB)
    mgr = kvx.KVCacheTransferManager(pool)
    # fill the host rows from the layers, then onboard them in runs to other blocks
    src = rng.permutation(NB)[:64]
    rows = runs_of_rows(rng, 64)
    mgr.offload_indices(src, rows)
    pages = np.setdiff1d(np.arange(NB), src)[rng.permutation(NB - 64)[:64]]
    before = staged_count()
    mgr.onboard_indices(rows, pages)
    mgr.sync_transfers()
    for k, (got, want) in enumerate(zip(pool.primary, host)):
        want = want.copy()
        want[:, pages] = want[:, src]
        np.testing.assert_array_equal(kvx.to_numpy(got), want, err_msg=f"layer {k}")
    if ON_GPU:
        assert staged_count() - before == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_the_staging_limit_is_checked(bad):
    with pytest.raises(ValueError, match="below_bytes must be an integer >= 0"), \
            testing.onboard_staging(bad):
        pass
