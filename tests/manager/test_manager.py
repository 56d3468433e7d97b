"""KVCacheTransferManager: ordering guarantees, bookkeeping, validation, a model-based test."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_kvxfer as kvx
from jax_kvxfer import testing
from jax_kvxfer.transfer._engines import plan_tokens

T = 4  # tokens per block


def P(i: int) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(block_id=100 + i, memory_pool_block_index=i, is_primary=True)


def S(i: int) -> kvx.KVCacheBlock:
    return kvx.KVCacheBlock(block_id=200 + i, memory_pool_block_index=i, is_primary=False)


def make_pools(rng, num_primary=6, num_secondary=5):
    """Two pools of one manager with different head counts and dtypes, filled at random."""
    pools = [
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=3, size_per_head=4,
                                    tokens_per_block=T, dtype=jnp.float32,
                                    num_primary_blocks=num_primary,
                                    num_secondary_blocks=num_secondary),
        kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=1, size_per_head=2,
                                    tokens_per_block=T, dtype=jnp.bfloat16, kv_factor=1,
                                    num_primary_blocks=num_primary,
                                    num_secondary_blocks=num_secondary),
    ]
    for pool in pools:
        pool.primary = jax.device_put(random_like(rng, pool.primary), pool.primary.sharding)
        if pool.secondary is not None:
            pool.secondary = jax.device_put(random_like(rng, pool.secondary),
                                            pool.secondary.sharding)
    return pools


def random_like(rng, array) -> np.ndarray:
    return rng.standard_normal(array.shape).astype(array.dtype)


def snapshot(pools):
    # kvx.to_numpy, not np.asarray: a NumPy view would make the pools undonatable on GPUs, and
    # the tests would then exercise the copying fallback instead of the in-place path.
    return [(kvx.to_numpy(p.primary),
             None if p.secondary is None else kvx.to_numpy(p.secondary)) for p in pools]


def assert_same(actual, expected):
    for (ap, as_), (ep, es) in zip(actual, expected):
        np.testing.assert_array_equal(ap.view(np.uint8), ep.view(np.uint8))
        if es is not None:
            np.testing.assert_array_equal(as_.view(np.uint8), es.view(np.uint8))


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


# -- pools ----------------------------------------------------------------------------------


def test_create_allocates_primary_on_device_and_secondary_in_pinned_host():
    pool = kvx.KVCacheBlockPool.create(num_layers=3, num_kv_heads=2, size_per_head=8,
                                       tokens_per_block=16, dtype=jnp.bfloat16,
                                       num_primary_blocks=5, num_secondary_blocks=7)
    assert pool.primary.shape == (5, 3, 2, 2, 16, 8)
    assert pool.secondary.shape == (7, 3, 2, 2, 16, 8)
    assert pool.primary.sharding.memory_kind == "device"
    assert pool.secondary.sharding.memory_kind == "pinned_host"
    assert pool.block_nbytes == 3 * 2 * 2 * 16 * 8 * 2
    assert (pool.num_layers, pool.kv_factor, pool.num_kv_heads, pool.tokens_per_block,
            pool.size_per_head, pool.dtype) == (3, 2, 2, 16, 8, jnp.dtype(jnp.bfloat16))


def test_create_without_secondary_blocks_has_none():
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=2, dtype=jnp.float32,
                                       num_primary_blocks=2, num_secondary_blocks=0)
    assert pool.secondary is None
    assert kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=2, dtype=jnp.int4, num_primary_blocks=1,
                                       num_secondary_blocks=1).block_nbytes == 4  # packed


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 0}, "num_layers"),
    ({"tokens_per_block": -1}, "tokens_per_block"),
    ({"kv_factor": 3}, "kv_factor"),
    ({"num_secondary_blocks": -2}, "num_secondary_blocks"),
    ({"size_per_head": 1.5}, "size_per_head"),
])
def test_create_rejects_bad_geometry(kwargs, match):
    args = {"num_layers": 1, "num_kv_heads": 1, "size_per_head": 2, "tokens_per_block": 2,
                "dtype": jnp.float32, "num_primary_blocks": 2, "num_secondary_blocks": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        kvx.KVCacheBlockPool.create(**args)


def test_assigning_a_wrong_array_is_rejected(rng):
    pool = make_pools(rng)[0]
    before = snapshot([pool])
    with pytest.raises(ValueError, match="pool.primary must be float32"):
        pool.primary = jnp.zeros((2, 2), jnp.float32)
    with pytest.raises(ValueError, match="memory kind 'pinned_host'"):
        pool.secondary = jnp.zeros(pool.secondary.shape, pool.dtype)
    with pytest.raises(TypeError, match="pool.primary"):
        pool.primary = np.zeros(pool.primary.shape, np.float32)
    assert_same(snapshot([pool]), before)


# -- the ordering guarantees ------------------------------------------------------------------


def test_onboard_of_a_slot_being_offloaded_reads_the_offloaded_data(rng):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    m.offload(P(1), S(2))
    m.onboard(S(2), P(3))  # no sync in between
    m.sync_transfers()
    for pool, (prim, _) in zip(pools, old):
        np.testing.assert_array_equal(np.asarray(pool.primary)[3], prim[1])
        np.testing.assert_array_equal(np.asarray(pool.secondary)[2], prim[1])


def test_two_offloads_into_one_slot_the_later_wins(rng):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    m.offload(P(1), S(0))
    m.offload(P(2), S(0))
    assert m.pending_transfers[(0, False)].writes == 2
    m.sync_transfers()
    for pool, (prim, _) in zip(pools, old):
        np.testing.assert_array_equal(np.asarray(pool.secondary)[0], prim[2])


def test_partial_copy_reads_a_block_whose_onboard_is_in_flight(rng):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    m.onboard(S(1), P(2))
    m.onboard(P(2), P(3), num_tokens=2)  # intra-device partial copy of the onboarded block
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, old):
        got = np.asarray(pool.primary)
        np.testing.assert_array_equal(got[3][..., :2, :], sec[1][..., :2, :])
        np.testing.assert_array_equal(got[3][..., 2:, :], prim[3][..., 2:, :])


def test_user_may_overwrite_a_block_right_after_offloading_it(rng):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    overwrite = jax.jit(lambda a: a.at[1].set(jnp.full(a.shape[1:], 7, a.dtype)), donate_argnums=0)
    m.offload(P(1), S(4))
    for pool in pools:
        pool.primary = overwrite(pool.primary)  # at once, no sync
    m.sync_transfers()
    for pool, (prim, _) in zip(pools, old):
        np.testing.assert_array_equal(np.asarray(pool.secondary)[4], prim[1])
        assert np.all(np.asarray(pool.primary)[1] == 7)


def test_user_donating_primary_between_transfers(rng):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    step = jax.jit(lambda a: a * 2, donate_argnums=0)
    m.offload(P(0), S(0))
    old = snapshot(pools)
    for pool in pools:
        pool.primary = step(pool.primary)
    m.onboard(S(0), P(5))
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, old):
        got = np.asarray(pool.primary)
        np.testing.assert_array_equal(got[5], sec[0])
        np.testing.assert_array_equal(got[:5], (prim[:5].astype(np.float32) * 2).astype(prim.dtype))


def test_a_deleted_pool_array_is_a_clear_error_and_nothing_moves(rng):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    before = snapshot(pools)
    jax.jit(lambda a: a + 1, donate_argnums=0)(pools[1].primary)  # result not assigned back
    with pytest.raises(ValueError, match="pool.primary has been deleted"):
        m.offload(P(0), S(1))
    assert_same(snapshot(pools[:1]), before[:1])
    assert not m.pending_transfers


def test_methods_do_not_block_and_sync_clears_pending(rng, monkeypatch):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    # The first batch of a size allocates that bucket's plan ring (and waits for its zero
    # fill, once); the guarantee is about transfers, so warm both buckets first.
    m.offload_blocks([(P(3), S(3)), (P(4), S(4))])
    m.onboard(S(3), P(5))
    m.sync_transfers()
    calls = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: calls.append(1) or real(x))
    monkeypatch.setattr(jax.Array, "block_until_ready",
                        lambda self: pytest.fail("a transfer blocked"), raising=False)
    m.offload_blocks([(P(0), S(0)), (P(1), S(1))])
    m.onboard_blocks([(S(2), P(2))], num_tokens=[3])
    assert calls == []
    pending = m.pending_transfers
    assert set(pending) == {(0, True), (1, True), (0, False), (1, False), (2, False), (2, True)}
    assert pending[(2, True)] == kvx.PendingTransfer(reads=0, writes=1, ops=("onboard",))
    with pytest.raises(TypeError):
        pending[(9, True)] = None  # read-only view
    m.sync_transfers()
    assert calls == [1]
    assert not m.pending_transfers


# -- batching and statistics ------------------------------------------------------------------


def test_a_batch_is_one_copy_per_pool_and_matches_sequential_semantics(rng, monkeypatch):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    pairs = [(P(0), S(0)), (P(1), S(1)), (P(2), S(0)), (P(4), S(3))]
    # the lanes: the default wherever the plan ring is
    with testing.count_dispatches("LANE_ACROSS") as calls:
        m.offload_blocks(pairs, num_tokens=[0, 2, 1, 9])
    assert [c["pools"] for c in calls] == [len(pools)]  # one dispatch, one call per pool
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, old):
        expected = sec.copy()
        expected[0] = prim[0]
        expected[1][..., :2, :] = prim[1][..., :2, :]
        expected[0][..., :1, :] = prim[2][..., :1, :]  # later pair wins on the tokens it writes
        expected[3] = prim[4]
        np.testing.assert_array_equal(np.asarray(pool.secondary), expected)


def test_stats_count_blocks_and_bytes_by_direction(rng):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    m.offload_blocks([(P(0), S(0)), (P(1), S(1))])
    m.onboard(S(0), P(2), num_tokens=1)
    m.onboard(P(2), P(3))
    stats = m.get_and_reset_transfer_stats()
    block = sum(p.block_nbytes for p in pools)
    assert stats == kvx.TransferStats(onboarded_blocks=1, onboarded_bytes=block // T,
                                      offloaded_blocks=2, offloaded_bytes=2 * block,
                                      copied_blocks=1, copied_bytes=block)
    assert m.get_and_reset_transfer_stats() == kvx.TransferStats()


def test_batch_sizes_are_bucketed_so_they_do_not_recompile(rng):
    pools = make_pools(rng, num_primary=8, num_secondary=8)
    m = kvx.KVCacheTransferManager(pools)
    m.offload_blocks([(P(i), S(i)) for i in range(5)])
    size = testing.dispatcher("LANE_ACROSS")._cache_size()
    for n in (6, 7, 8):
        m.offload_blocks([(P(i), S(7 - i)) for i in range(n)])
    assert testing.dispatcher("LANE_ACROSS")._cache_size() == size


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.offload(P(6), S(0)), IndexError, "memory_pool_block_index 6"),
    (lambda m: m.offload(P(0), S(5)), IndexError, "secondary pool's 0..4"),
    (lambda m: m.offload(P(-1), S(0)), IndexError, "memory_pool_block_index -1"),
    (lambda m: m.offload(P(0), "S0"), TypeError, "KVCacheBlock"),
    (lambda m: m.offload(P(0), S(0), num_tokens=1.5), TypeError, "num_tokens"),
    (lambda m: m.offload_blocks([(P(0), S(0))], num_tokens=[1, 2]), ValueError, "num_tokens"),
    (lambda m: m.offload_blocks([(P(0), S(0)), (P(9), S(1))]), IndexError, r"pairs\[1\]"),
    (lambda m: m.offload_blocks([(P(0),)]), ValueError, r"pairs\[0\]"),
])
def test_bad_calls_raise_and_leave_pools_unchanged(rng, call, error, match):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    before = snapshot(pools)
    with pytest.raises(error, match=match):
        call(m)
    assert not m.pending_transfers
    m.sync_transfers()
    assert_same(snapshot(pools), before)


def test_offload_into_a_pool_without_secondary_blocks_is_an_error(rng):
    pool = make_pools(rng, num_secondary=0)[0]
    m = kvx.KVCacheTransferManager([pool])
    with pytest.raises(ValueError, match="0 secondary blocks"):
        m.offload(P(0), S(0))


def test_pools_of_one_manager_must_agree(rng):
    a = make_pools(rng)[0]
    b = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                    tokens_per_block=T * 2, dtype=jnp.float32,
                                    num_primary_blocks=6, num_secondary_blocks=5)
    with pytest.raises(ValueError, match="tokens_per_block"):
        kvx.KVCacheTransferManager([a, b])
    with pytest.raises(ValueError, match="at least one"):
        kvx.KVCacheTransferManager([])
    with pytest.raises(TypeError, match=r"pools\[1\]"):
        kvx.KVCacheTransferManager([a, "b"])


def test_partial_copy_of_odd_int4_rows_is_rejected():
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=3,
                                       tokens_per_block=2, dtype=jnp.int4,
                                       num_primary_blocks=2, num_secondary_blocks=2)
    m = kvx.KVCacheTransferManager([pool])
    with pytest.raises(ValueError, match="even size_per_head"):
        m.offload(P(0), S(0), num_tokens=1)
    m.offload(P(0), S(0))  # whole blocks are fine
    m.sync_transfers()


# -- a model-based randomized test --------------------------------------------------------------


def apply_to_shadow(shadow, pairs, tokens):
    for (src, dst), n in zip(pairs, tokens):
        for arrays in shadow:
            t = arrays[0].shape[4]
            n_eff = t if (n <= 0 or n >= t) else n
            src_arr = arrays[0] if src.is_primary else arrays[1]
            dst_arr = arrays[0] if dst.is_primary else arrays[1]
            dst_arr[dst.memory_pool_block_index][..., :n_eff, :] = (
                src_arr[src.memory_pool_block_index][..., :n_eff, :].copy())


def run_random_operations(seed: int, num_ops: int, manager=None, pools=None):
    rng = np.random.default_rng(seed)
    pools = pools or make_pools(rng)
    m = manager or kvx.KVCacheTransferManager(pools)
    shadow = [list(s) for s in snapshot(pools)]
    npri, nsec = pools[0].num_primary_blocks, pools[0].num_secondary_blocks

    def pair(offload: bool):
        """An offload's GPU -> host pair, or an onboard's host -> GPU or GPU -> GPU pair."""
        dst = S(int(rng.integers(nsec))) if offload else P(int(rng.integers(npri)))
        if offload or rng.random() < 0.7:
            src = P(int(rng.integers(npri))) if offload else S(int(rng.integers(nsec)))
        else:
            src = P(int(rng.integers(npri)))
        return src, dst

    def tokens():
        return int(rng.choice([-1, 0, 1, 2, 3, 4, 7]))

    for _ in range(num_ops):
        r = rng.random()
        offload = bool(rng.random() < 0.5)
        if r < 0.08:
            m.sync_transfers()
            assert_same(snapshot(pools), shadow)
            continue
        if r < 0.5:
            pairs, n = [pair(offload)], [tokens()]
            (m.offload if offload else m.onboard)(*pairs[0], num_tokens=n[0])
        else:
            pairs = [pair(offload) for _ in range(int(rng.integers(1, 9)))]
            n = [tokens() for _ in pairs]
            (m.offload_blocks if offload else m.onboard_blocks)(pairs, num_tokens=n)
        apply_to_shadow(shadow, pairs, n)
    m.sync_transfers()
    assert_same(snapshot(pools), shadow)


def test_random_operations_match_a_numpy_shadow():
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvx.DonationWarning)  # every transfer in place
        run_random_operations(seed=1234, num_ops=1500)


def test_a_pool_viewed_by_numpy_still_gets_the_transfer(rng):
    pools = make_pools(rng)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools)
    views = [np.asarray(p.secondary) for p in pools]  # on GPUs this pins the buffers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.offload(P(1), S(3))
        m.sync_transfers()
    for pool, (prim, _) in zip(pools, old):
        np.testing.assert_array_equal(kvx.to_numpy(pool.secondary)[3], prim[1])
    on_gpu = jax.devices()[0].platform == "gpu"
    assert any(w.category is kvx.DonationWarning for w in caught) == on_gpu
    del views


def test_two_threads_sharing_a_manager_keep_their_order(rng):
    # Each thread owns its own blocks, so the final state is independent of interleaving.
    pools = make_pools(rng, num_primary=8, num_secondary=8)
    m = kvx.KVCacheTransferManager(pools)
    old = snapshot(pools)
    errors = []

    def worker(base):
        try:
            for _ in range(40):
                m.offload(P(base), S(base))
                m.onboard(S(base), P(base + 1))
                m.offload_blocks([(P(base + 1), S(base + 1)), (P(base), S(base + 2))])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    m.sync_transfers()
    for pool, (prim, _) in zip(pools, old):
        got_p, got_s = np.asarray(pool.primary), np.asarray(pool.secondary)
        for b in (0, 4):
            for blk in (got_p[b + 1], got_s[b], got_s[b + 1], got_s[b + 2]):
                np.testing.assert_array_equal(blk, prim[b])


# -- plan ring --------------------------------------------------------------------------------


@pytest.mark.parametrize("plan_ring", [True, False])
def test_plans_come_round_again_only_after_their_dispatch(rng, plan_ring):
    """More dispatches of one bucket than the ring has slots, with no sync in between: each
    copy must still read its own plan (slots are rewritten only after their dispatch ran).
    Without the ring (NumPy plans) the result is the same."""
    pools = make_pools(rng, num_primary=6, num_secondary=5)
    old = snapshot(pools)
    m = kvx.KVCacheTransferManager(pools, plan_ring=plan_ring)
    assert (testing.plan_ring(m) is not None) == plan_ring
    order = [(int(rng.integers(0, 6)), int(rng.integers(0, 5))) for _ in range(40)]
    for s, d in order:  # 40 single-pair dispatches: bucket 1, 16 slots
        m.offload(P(s), S(d))
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, old):
        expected = sec.copy()
        for s, d in order:
            expected[d] = prim[s]
        np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), expected)


def _held_back(arrays: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
    """`arrays` again, as the outputs of one computation that keeps the device busy for about
    0.1 s first (a chain of matmuls whose result adds 0: 4096-square on a GPU, 512-square on a
    CPU), so that copies queue; and a probe, another output of it (ready when they are)."""
    n, steps = (4096, 300) if next(iter(arrays[0].devices())).platform == "gpu" else (512, 50)

    def slow(arrays):
        m = jnp.full((n, n), 1e-4, jnp.float32)
        x = lax.fori_loop(0, steps, lambda _, x: jnp.tanh(m @ x), m)
        zero = jnp.where(jnp.isnan(x.sum()), 1, 0)  # tanh: never NaN
        return [a + zero.astype(a.dtype) for a in arrays], zero
    return jax.jit(slow)(arrays)


@pytest.mark.parametrize("verb", ["offload", "offload_and_onboard"])
def test_plan_slots_wait_for_the_dispatch_that_read_them(rng, verb):
    """The copies queue behind a slow computation on the device while the host dispatches more of
    them than the ring has slots: a slot may be rewritten only once the dispatch that read it
    has run, which its token (handed back by that dispatch) must tell. A token that were ready
    too early would let a later plan overwrite one still to be read, and a copy go astray."""
    pools = make_pools(rng, num_primary=46, num_secondary=46)
    m = kvx.KVCacheTransferManager(pools)
    if testing.plan_ring(m) is None:
        pytest.skip("no pinned_host memory: no plan ring")
    m.offload_and_onboard([(P(0), S(0))], [(S(40), P(6))])  # compiles both verbs' copies
    m.offload(P(0), S(0))
    m.sync_transfers()
    old = snapshot(pools)
    primaries, probe = _held_back([p.primary for p in pools])
    for pool, primary in zip(pools, primaries):
        pool.primary = primary
    # Every dispatch writes slots of its own, so a copy done with another dispatch's plan
    # leaves a slot unwritten. Offloads read primary 0-5 and write secondary 0-39; onboards
    # read secondary 40-45 and write primary 6-45.
    offloads = list(zip(rng.integers(0, 6, 40).tolist(), rng.permutation(40).tolist()))
    onboards = list(zip(rng.integers(40, 46, 40).tolist(), (6 + rng.permutation(40)).tolist()))
    wraps_at = 16 if verb == "offload" else 8  # bucket 1 has 16 slots; both ways reads two
    for k, ((s, d), (os_, od)) in enumerate(zip(offloads, onboards)):
        if k == wraps_at:  # the ring wraps now: else the test would show nothing
            assert not probe.is_ready(), "the slow computation ended before the ring wrapped"
        if verb == "offload":
            m.offload(P(s), S(d))
        else:  # disjoint: one dispatch that offloads and onboards (two slots)
            m.offload_and_onboard([(P(s), S(d))], [(S(os_), P(od))])
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, old):
        prim, sec = prim.copy(), sec.copy()
        for (s, d), (os_, od) in zip(offloads, onboards):
            sec[d] = prim[s]
            if verb != "offload":
                prim[od] = sec[os_]
        np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), sec)
        np.testing.assert_array_equal(kvx.to_numpy(pool.primary), prim)


def test_plan_slot_gets_a_fresh_token_only_where_a_failed_dispatch_consumed_it(rng):
    """A dispatch retried after a failed donation (plan_tokens(..., retry=True)) must not
    pass a deleted token, nor replace one still live (its readiness is what the ring waits on)."""
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    if testing.plan_ring(m) is None:
        pytest.skip("no pinned_host memory: no plan ring")
    slot = testing.plan_ring(m).next_slot(2)
    live = slot.token
    assert plan_tokens((slot, None), retry=True) == (live, None)
    live.delete()
    (fresh,) = plan_tokens((slot,), retry=True)
    assert fresh is slot.token and fresh is not live and not fresh.is_deleted()
    assert fresh.sharding == live.sharding and np.asarray(fresh).tolist() == [0]


def test_a_plan_slot_holds_its_last_plan_and_minus_one_after_it(rng):
    """Whatever plans a slot held before, longer or shorter, and from its first (its arrays
    start as zeros), what the copy reads after a write of n pairs is those pairs, then -1 (pairs
    the kernel skips) to the end of the bucket: read back through JAX, not the views written."""
    m = kvx.KVCacheTransferManager(make_pools(rng))
    if testing.plan_ring(m) is None:
        pytest.skip("no pinned_host memory: no plan ring")
    slot = testing.plan_ring(m).next_slot(8)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for n in (3, 8, 5, 1, 7, 7, 2, 8):
        rows = rng.integers(0, 1000, (3, n))
        arrays = slot.write(tuple(rows))
        for got, row in zip(arrays, rows):
            want = np.concatenate([row, np.full(8 - n, -1)])
            np.testing.assert_array_equal(np.asarray(jax.device_put(got, device)), want)


def test_plan_slots_have_buffers_of_their_own(rng):
    pools = make_pools(rng)
    m = kvx.KVCacheTransferManager(pools)
    m.offload_blocks([(P(0), S(0)), (P(1), S(1))])
    m.sync_transfers()
    if testing.plan_ring(m) is None:
        pytest.skip("no pinned_host memory: plans go as NumPy arrays")
    arrays = [a for a in testing.plan_ring(m).arrays() if a.sharding.memory_kind == "pinned_host"]
    pointers = {s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards}
    assert len(pointers) == 16 * 3  # one bucket (2 pairs), 16 slots of 3 arrays


# -- both directions in one call ------------------------------------------------------------


def sequential_reference(rng_seed, offloads, onboards, off_tokens, on_tokens):
    """The pools after offload_blocks then onboard_blocks, on pools made from `rng_seed`."""
    pools = make_pools(np.random.default_rng(rng_seed), num_primary=8, num_secondary=8)
    tm = kvx.KVCacheTransferManager(pools)
    tm.offload_blocks(offloads, off_tokens)
    tm.onboard_blocks(onboards, on_tokens)
    tm.sync_transfers()
    return snapshot(pools), tm.get_and_reset_transfer_stats()


@pytest.mark.parametrize("case", ["disjoint", "reuse_evicted_block", "onboard_reads_new_slot",
                                  "mixed_directions", "one_side_empty"])
@pytest.mark.parametrize("plan_ring", [True, False])
@pytest.mark.parametrize("lanes", [True, False])
def test_offload_and_onboard_equals_one_after_the_other(case, plan_ring, lanes, monkeypatch):
    off_pairs = [(P(0), S(1)), (P(2), S(3)), (P(5), S(0))]
    on_pairs = [(S(4), P(6)), (S(5), P(7))]
    off_tokens, on_tokens = [0, 2, T], [1, 0]
    if case == "reuse_evicted_block":  # evict block 2 and bring another block into it at once
        on_pairs = [(S(4), P(2)), (S(5), P(7))]
    elif case == "onboard_reads_new_slot":  # onboard what this very call offloads: in order
        on_pairs = [(S(3), P(6)), (S(5), P(7))]
    elif case == "mixed_directions":  # a primary -> primary copy among the onboards
        on_pairs = [(S(4), P(6)), (P(1), P(7))]
    elif case == "one_side_empty":
        on_pairs, on_tokens = [], None
    seed = 1234
    expected, expected_stats = sequential_reference(seed, off_pairs, on_pairs, off_tokens,
                                                    on_tokens)
    pools = make_pools(np.random.default_rng(seed), num_primary=8, num_secondary=8)
    tm = kvx.KVCacheTransferManager(pools, plan_ring=plan_ring,
                                   dma="auto" if lanes else False)
    tm.offload_and_onboard(off_pairs, on_pairs, off_tokens, on_tokens)
    pending = tm.pending_transfers
    tm.sync_transfers()
    assert_same(snapshot(pools), expected)
    assert tm.get_and_reset_transfer_stats() == expected_stats
    assert pending[(2, True)].reads == 1 and pending[(1, False)].writes == 1


def test_offload_and_onboard_bad_onboard_leaves_everything_unchanged(rng):
    pools = make_pools(rng, num_primary=8, num_secondary=8)
    before = snapshot(pools)
    tm = kvx.KVCacheTransferManager(pools)
    with pytest.raises(IndexError):
        tm.offload_and_onboard([(P(0), S(1))], [(S(99), P(2))])
    assert not tm.pending_transfers
    assert tm.get_and_reset_transfer_stats() == kvx.TransferStats()
    tm.sync_transfers()
    assert_same(snapshot(pools), before)


# -- the copy engines (dma=True) --------------------------------------------------------------


def test_dma_manager_matches_the_kernel_manager(rng):
    """The same random offloads, onboards (whole, partial, duplicate destinations) and copies
    within the GPU pool through a manager with dma=True and one without: the pools must end
    bitwise equal, and on a GPU the copy engines must have done the host transfers."""
    seed = int(rng.integers(1 << 30))
    pools_dma, pools_ref = (make_pools(np.random.default_rng(seed)) for _ in range(2))
    initial = snapshot(pools_ref)
    with_dma = kvx.KVCacheTransferManager(pools_dma, dma=True)
    kernel = kvx.KVCacheTransferManager(pools_ref)
    t = pools_dma[0].tokens_per_block
    gpu = jax.default_backend() == "gpu"
    before = testing.dma_batches() if gpu else 0
    for _ in range(12):
        k = int(rng.integers(1, 5))
        src, dst = rng.integers(0, 5, k), rng.integers(0, 5, k)
        tokens = [int(x) for x in rng.integers(-1, t + 2, k)]
        verb = rng.choice(["offload_blocks", "onboard_blocks", "within", "both"])
        if verb == "both":  # offload_and_onboard: both directions at once where exact
            off = [(P(int(s)), S(int(d))) for s, d in zip(src, dst)]
            on = [(S(int(s)), P(int(d))) for s, d in zip(rng.integers(0, 5, k),
                                                        rng.integers(0, 5, k))]
            for m in (with_dma, kernel):
                m.offload_and_onboard(off, on, tokens, tokens[::-1])
            continue
        if verb == "offload_blocks":
            pairs = [(P(int(s)), S(int(d))) for s, d in zip(src, dst)]
        elif verb == "onboard_blocks":
            pairs = [(S(int(s)), P(int(d))) for s, d in zip(src, dst)]
        else:
            verb, pairs = "onboard_blocks", [(P(int(s)), P(int(d) + 1)) for s, d in zip(src, dst)]
        for m in (with_dma, kernel):
            getattr(m, verb)(pairs, tokens)
    with_dma.sync_transfers()
    kernel.sync_transfers()
    for a, b in zip(pools_dma, pools_ref):
        np.testing.assert_array_equal(kvx.to_numpy(a.primary), kvx.to_numpy(b.primary))
        np.testing.assert_array_equal(kvx.to_numpy(a.secondary), kvx.to_numpy(b.secondary))
    assert any(not np.array_equal(kvx.to_numpy(p.secondary), sec) or
               not np.array_equal(kvx.to_numpy(p.primary), prim)
               for p, (prim, sec) in zip(pools_dma, initial)), "nothing was copied"
    if gpu:
        assert testing.dma_batches() > before


def test_auto_dma_puts_every_transfer_with_a_gpu_side_on_the_lanes(rng):
    """dma="auto" (the default): on a GPU every offload, onboard and copy within the GPU pool,
    whole or partial, runs on the transfer lanes with the copy engines, one lane copy per pool
    per batch; the pools end bitwise equal to a dma=False manager's (the kernel, in line)."""
    def pools_of(seed):
        r = np.random.default_rng(seed)
        big = kvx.KVCacheBlockPool.create(  # 2 * 2 * 8 * 16 * 128 * 4 bytes = 256 KiB
            num_layers=2, num_kv_heads=8, size_per_head=128, tokens_per_block=16,
            dtype=jnp.float32, kv_factor=2, num_primary_blocks=4, num_secondary_blocks=4)
        small = kvx.KVCacheBlockPool.create(
            num_layers=1, num_kv_heads=2, size_per_head=8, tokens_per_block=16,
            dtype=jnp.float32, num_primary_blocks=4, num_secondary_blocks=4)
        for p in (big, small):
            p.primary = jax.device_put(random_like(r, p.primary), p.primary.sharding)
            p.secondary = jax.device_put(random_like(r, p.secondary), p.secondary.sharding)
        return [big, small]

    seed = int(rng.integers(1 << 30))
    auto_pools, ref_pools = pools_of(seed), pools_of(seed)
    auto = kvx.KVCacheTransferManager(auto_pools)
    ref = kvx.KVCacheTransferManager(ref_pools, dma=False)
    gpu = jax.default_backend() == "gpu"
    counter = testing.dma_batches if gpu else (lambda: 0)
    src, dst = rng.permutation(4)[:3], rng.permutation(4)[:3]
    steps = [  # (verb, pairs, num_tokens)
        ("offload_blocks", [(P(int(s)), S(int(d))) for s, d in zip(src, dst)], None),
        ("onboard_blocks", [(S(int(d)), P(int(s))) for s, d in zip(src, dst)], 5),
        ("onboard_blocks", [(S(int(s)), P(int(d))) for s, d in zip(dst, src)], [16, 0, -1]),
        ("onboard_blocks", [(P(int(s)), P(int(d))) for s, d in zip(dst, src)], [3, 0, 1]),
    ]
    for verb, pairs, tokens in steps:
        before = counter()
        for m in (auto, ref):
            getattr(m, verb)(pairs, tokens)
        auto.sync_transfers()
        assert (counter() - before >= len(auto_pools)) == gpu, verb
    before = counter()
    for m in (auto, ref):
        m.offload_and_onboard([(P(0), S(3))], [(S(1), P(2))])
    auto.sync_transfers()
    assert (counter() - before >= 2 * len(auto_pools)) == gpu
    ref.sync_transfers()
    assert_same(snapshot(auto_pools), snapshot(ref_pools))
    assert not np.array_equal(kvx.to_numpy(auto_pools[0].secondary),
                              kvx.to_numpy(pools_of(seed)[0].secondary)), "nothing was offloaded"
