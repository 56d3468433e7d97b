"""The manager's transfers beside compute (the lanes): who keeps which hazard away.

On a GPU the lanes run the copies on streams of the library's own while XLA's stream goes on;
the blocks here are large enough (1 MiB, tens of them) that a copy is still in flight when the
next step runs, so a missing wait shows as wrong data. On the CPU a lane copy is done when its
call is: the same tests then check the manager's bookkeeping and the semantics.
Every check compares with a NumPy shadow of the pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx

ON_GPU = jax.default_backend() == "gpu"
# 1 MiB blocks on a GPU (a batch of 64 takes ~1.2 ms over PCIe), small ones on the CPU
GEOMETRY = ({"num_layers": 4, "num_kv_heads": 8, "size_per_head": 128, "tokens_per_block": 64}
            if ON_GPU else
            {"num_layers": 2, "num_kv_heads": 2, "size_per_head": 8, "tokens_per_block": 8})
NB = 64
T = GEOMETRY["tokens_per_block"]


def P(i: int) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(i, i, True)


def S(i: int) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(i, i, False)


@pytest.fixture
def pool(rng):
    pool = kvx.KVCacheBlockPool.create(**GEOMETRY, dtype=jnp.float32, num_primary_blocks=2 * NB,
                                       num_secondary_blocks=2 * NB)
    shape = pool.primary.shape
    pool.primary = jax.device_put(rng.standard_normal(shape, np.float32), pool.sharding("device"))
    pool.secondary = jax.device_put(rng.standard_normal(shape, np.float32),
                                    pool.sharding("pinned_host"))
    return pool


def shadow(pool):
    return kvx.to_numpy(pool.primary), kvx.to_numpy(pool.secondary)


def assert_pools(pool, primary, secondary):
    """Both of the pool's arrays, bitwise, against their shadows."""
    got_primary, got_secondary = shadow(pool)
    np.testing.assert_array_equal(got_primary, primary)
    np.testing.assert_array_equal(got_secondary, secondary)


# A step that writes every primary block in place, as a model step writes its new tokens.
overwrite = jax.jit(lambda a: a * 2.0 + 1.0, donate_argnums=0)
# A step that reads primary blocks, as attention does.
read_blocks = jax.jit(lambda a, i: a[i] * 1.0)


def test_offload_sources_may_be_overwritten_at_once(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    src, dst = rng.permutation(NB), rng.permutation(NB)
    mgr.offload_indices(src, dst)
    pool.primary = overwrite(pool.primary)  # beside the offload, no sync
    mgr.sync_transfers(block=False)
    sec[dst] = prim[src]  # the offload saw the blocks as they were
    assert_pools(pool, prim * 2.0 + 1.0, sec)


def test_a_step_after_sync_reads_the_onboarded_blocks(pool, rng):
    _, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    src, dst = rng.permutation(NB), rng.permutation(NB) + NB
    mgr.onboard_indices(src, dst)
    mgr.sync_transfers(block=False)  # on the GPU: XLA's stream waits for the lane
    got = read_blocks(pool.primary, jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(got), sec[src])


def test_onboard_reads_what_a_pending_offload_wrote(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    slots = rng.permutation(2 * NB)[:NB]
    mgr.offload_indices(np.arange(NB), slots)
    mgr.onboard_indices(slots, np.arange(NB) + NB)  # lane 1 waits for lane 0
    mgr.sync_transfers()
    sec[slots] = prim[:NB]
    prim[NB:] = prim[:NB]
    assert_pools(pool, prim, sec)


def test_offload_waits_for_the_onboard_reading_its_destination(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    slots = rng.permutation(2 * NB)[:NB]
    mgr.onboard_indices(slots, np.arange(NB))
    mgr.offload_indices(np.arange(NB) + NB, slots)  # overwrites what the onboard reads
    mgr.sync_transfers()
    prim[:NB] = sec[slots]
    sec[slots] = prim[NB:]
    assert_pools(pool, prim, sec)


def test_offload_snapshots_after_the_onboard_writing_its_source(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    mgr.onboard_indices(np.arange(NB), np.arange(NB))
    mgr.offload_indices(np.arange(NB), np.arange(NB) + NB)  # evicts the blocks just onboarded
    mgr.sync_transfers()
    prim[:NB] = sec[:NB]
    sec[NB:] = sec[:NB]
    assert_pools(pool, prim, sec)


def test_partial_copy_reads_the_pending_onboard(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    mgr.onboard_indices(np.arange(NB), np.arange(NB))
    n = T // 2
    for i in range(4):  # copy-on-partial-reuse of blocks still being onboarded
        mgr.onboard(P(i), P(NB + i), num_tokens=n)
    mgr.sync_transfers()
    prim[:NB] = sec[:NB]
    prim[NB:NB + 4, :, :, :, :n] = sec[:4, :, :, :, :n]
    np.testing.assert_array_equal(shadow(pool)[0], prim)


def test_partial_offloads_and_onboards_on_the_lanes(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    tokens = rng.integers(-1, T + 2, NB)
    src, dst = rng.permutation(NB), rng.permutation(2 * NB)[:NB]
    mgr.offload_indices(src, dst, tokens)
    mgr.onboard_indices(dst[::-1].copy(), src + NB, tokens[::-1].copy())
    mgr.sync_transfers()
    for s, d, n in zip(src, dst, tokens):
        n = T if n <= 0 or n >= T else n
        sec[d, :, :, :, :n] = prim[s, :, :, :, :n]
    for s, d, n in zip(dst[::-1], src + NB, tokens[::-1]):
        n = T if n <= 0 or n >= T else n
        prim[d, :, :, :, :n] = sec[s, :, :, :, :n]
    assert_pools(pool, prim, sec)


def test_unsynced_transfers_are_complete_for_to_numpy(pool, rng):
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    mgr.offload_indices(np.arange(NB), np.arange(NB))
    sec[:NB] = prim[:NB]
    np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), sec)  # no sync at all


@pytest.mark.parametrize("dma", [True, False], ids=["lanes", "in line"])
def test_an_ordinary_update_right_after_an_onboard_keeps_the_onboard(pool, rng, dma):
    """`pool.primary = pool.primary.at[i].set(x)` (a new buffer, not donated) with onboards in
    flight: reading pool.primary orders the update after them, so the new array holds them."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool], dma=dma)
    mgr.onboard_indices(np.arange(NB), np.arange(NB))
    mgr.offload_indices(np.arange(NB, 2 * NB), np.arange(NB, 2 * NB))
    value = rng.standard_normal(prim.shape[1:], np.float32)
    pool.primary = pool.primary.at[2].set(value)  # block 2 is being onboarded
    pool.primary = pool.primary.at[NB + 3].set(value + 1)  # block NB + 3 is being offloaded
    prim[:NB] = sec[:NB]
    sec[NB:] = prim[NB:]
    prim[2], prim[NB + 3] = value, value + 1
    mgr.sync_transfers()
    assert_pools(pool, prim, sec)


def test_assigning_a_fresh_array_while_transfers_are_in_flight(pool, rng):
    """A new array not made from the pool replaces it at once; the transfers in flight land
    in the old buffers, which outlive them, and the new secondary is not touched."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    mgr.offload_indices(np.arange(NB), np.arange(NB))
    mgr.onboard_indices(np.arange(NB, 2 * NB), np.arange(NB, 2 * NB))
    fresh_prim = rng.standard_normal(prim.shape, np.float32)
    fresh_sec = rng.standard_normal(sec.shape, np.float32)
    pool.primary = jax.device_put(fresh_prim, pool.sharding("device"))
    pool.secondary = jax.device_put(fresh_sec, pool.sharding("pinned_host"))
    mgr.sync_transfers()
    assert_pools(pool, fresh_prim, fresh_sec)


def test_reading_the_secondary_leaves_a_held_primary_live(pool, rng):
    """Reading pool.secondary while an offload writes it joins the lanes through the secondary
    array only: a reference the step holds to pool.primary stays usable."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    held = pool.primary
    mgr.offload_indices(np.arange(NB), np.arange(NB))
    sec[:NB] = prim[:NB]
    np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), sec)
    assert not held.is_deleted()
    np.testing.assert_array_equal(kvx.to_numpy(held), prim)


def test_in_line_manager_is_exact_too(pool, rng):
    """dma=False keeps every copy on XLA's stream (no lanes): same results."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool], dma=False)
    src, dst = rng.permutation(NB), rng.permutation(NB)
    mgr.offload_indices(src, dst)
    pool.primary = overwrite(pool.primary)
    mgr.onboard_indices(dst, src + NB)
    mgr.sync_transfers()
    sec[dst] = prim[src]
    prim = prim * 2.0 + 1.0
    prim[src + NB] = sec[dst]
    assert_pools(pool, prim, sec)


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.offload_indices([0, 1], [0]), ValueError, "src has 2 entries but dst has 1"),
    (lambda m: m.offload_indices([0, 2 * NB], [0, 1]), IndexError, r"src\[1\] is"),
    (lambda m: m.onboard_indices([0, -1], [0, 1]), IndexError, r"src\[1\] is -1"),
    (lambda m: m.onboard_indices([0, 1], [0.5, 1]), TypeError, "dst must hold integers"),
    (lambda m: m.onboard_indices([[0]], [[1]]), ValueError, "src must be 1-D"),
    (lambda m: m.offload_indices("01", [0, 1]), TypeError, "src must be a 1-D array"),
    (lambda m: m.offload_indices([0, 1], [0, 1], [1]), ValueError, "num_tokens has 1 entries"),
    (lambda m: m.offload_indices([0, 1], [0, 1], [1, 1.5]), TypeError, r"num_tokens\[1\]"),
])
def test_index_api_bad_input_names_the_argument_and_changes_nothing(pool, call, error, match):
    before = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    with pytest.raises(error, match=match):
        call(mgr)
    assert not mgr.pending_transfers
    mgr.sync_transfers()
    for got, want in zip(shadow(pool), before):
        np.testing.assert_array_equal(got, want)


def test_index_api_matches_the_pair_verbs(rng):
    """offload_indices / onboard_indices against offload_blocks / onboard_blocks on twin pools:
    same data, statistics and pending records."""
    twins = []
    for _ in range(2):
        p = kvx.KVCacheBlockPool.create(**GEOMETRY, dtype=jnp.float32, num_primary_blocks=16,
                                        num_secondary_blocks=16)
        twins.append(p)
    data = np.random.default_rng(7).standard_normal(twins[0].primary.shape, np.float32)
    for p in twins:
        p.primary = jax.device_put(data, p.sharding("device"))
    src, dst, tokens = rng.permutation(16)[:8], rng.permutation(16)[:8], rng.integers(0, T, 8)
    a, b = (kvx.KVCacheTransferManager([p]) for p in twins)
    a.offload_indices(src, dst, tokens)
    a.onboard_indices(dst, src[::-1].copy())
    b.offload_blocks([(P(s), S(d)) for s, d in zip(src, dst)], [int(n) for n in tokens])
    b.onboard_blocks([(S(s), P(d)) for s, d in zip(dst, src[::-1])])
    assert a.pending_transfers == b.pending_transfers
    assert a.get_and_reset_transfer_stats() == b.get_and_reset_transfer_stats()
    a.sync_transfers()
    b.sync_transfers()
    for x, y in zip(shadow(twins[0]), shadow(twins[1])):
        np.testing.assert_array_equal(x, y)


def test_a_non_blocking_sync_leaves_offloads_running_and_later_onboards_wait(pool, rng):
    """sync_transfers(block=False) joins what compute reads; an offload may still run after it,
    and an onboard of its slots issued after the sync still reads the offloaded data."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    slots = rng.permutation(2 * NB)[:NB]
    mgr.offload_indices(np.arange(NB), slots)
    mgr.sync_transfers(block=False)
    assert not mgr.pending_transfers
    pool.primary = overwrite(pool.primary)  # compute goes on at once
    mgr.onboard_indices(slots, np.arange(NB) + NB)
    mgr.sync_transfers(block=False)
    sec[slots] = prim[:NB]
    prim = prim * 2.0 + 1.0
    prim[NB:] = sec[slots]
    assert_pools(pool, prim, sec)
    stats = mgr.get_and_reset_transfer_stats()
    assert stats.exposed_seconds >= 0.0 and (stats.exposed_seconds > 0.0) == mgr.on_lanes


# A step that keeps XLA's stream busy for tens of milliseconds on the GPU (a few on the CPU).
busy_step = jax.jit(lambda x: jax.lax.fori_loop(0, 40 if ON_GPU else 2,
                                                lambda _, y: jnp.tanh(y @ y), x))


def test_an_onboard_after_a_sync_reads_an_offload_xla_had_not_run_yet(pool, rng):
    """The offload is dispatched behind a long step, so at the non-blocking sync XLA has not
    run it: its lane copy is not enqueued, and idle lanes must not count it as done. The
    onboard of its slots issued next must still wait for it."""
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    x = jnp.asarray(rng.standard_normal((4096, 4096) if ON_GPU else (64, 64), np.float32) / 64)
    y = busy_step(x)  # not waited for
    mgr.offload_indices(np.arange(NB), np.arange(NB))
    mgr.sync_transfers(block=False)
    mgr.onboard_indices(np.arange(NB), np.arange(NB) + NB)
    mgr.sync_transfers()
    y.block_until_ready()
    sec[:NB] = prim[:NB]
    prim[NB:] = prim[:NB]
    assert_pools(pool, prim, sec)


def test_a_fence_waits_for_the_transfers_issued_before_it(pool, rng):
    """fence.wait() from another thread: afterwards the host sees the offloaded rows, with no
    sync on the serving side."""
    import threading
    prim, sec = shadow(pool)
    mgr = kvx.KVCacheTransferManager([pool])
    x = jnp.asarray(rng.standard_normal((4096, 4096) if ON_GPU else (64, 64), np.float32) / 64)
    y = busy_step(x)
    mgr.offload_indices(np.arange(NB), np.arange(NB))
    fence = mgr.fence()
    waited = threading.Thread(target=fence.wait)
    waited.start()
    waited.join(timeout=60)
    assert not waited.is_alive() and fence.done()
    y.block_until_ready()
    sec[:NB] = prim[:NB]
    np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), sec)
