"""BlockManager bookkeeping: free lists, LRU order, priorities, hash and partial matching,
offload/onboard through the transfer manager, secondary eviction, errors.

Most tests drive a fake transfer manager that applies the batched copies to token-id shadows
of the pools, so every test can check that a reused prefix holds exactly the right tokens.
One randomized test runs the same checks through the real KVCacheTransferManager.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer.cache import BlockManager, PoolExhaustedError

T = 4  # tokens per block


class DoneFence:
    def done(self):
        return True

    def wait(self):
        pass


class FakeTransferManager:
    """Applies batched copies, in call order, to shadows holding token ids (None: empty)."""

    metrics_report = None  # it reports no metrics of its own

    def __init__(self, num_primary: int, num_secondary: int, pool=None) -> None:
        self.pools = (pool,)  # the pools it moves, as the connector's worker checks
        self.mem = {True: [[None] * T for _ in range(num_primary)],
                    False: [[None] * T for _ in range(num_secondary)]}
        self.calls: list[tuple[str, list, list[int]]] = []
        self.syncs = 0

    def offload_blocks(self, pairs, num_tokens=None):
        self._apply("offload", pairs, num_tokens)

    def onboard_blocks(self, pairs, num_tokens=None):
        self._apply("onboard", pairs, num_tokens)

    def offload_indices(self, src, dst, num_tokens=None):  # the connector's worker's verbs
        self._apply("offload", _index_pairs(src, True, dst, False), num_tokens)

    def onboard_indices(self, src, dst, num_tokens=None):
        self._apply("onboard", _index_pairs(src, False, dst, True), num_tokens)

    def fence(self):  # every copy is applied when called
        return DoneFence()

    def offload_and_onboard(self, offload_pairs, onboard_pairs, offload_tokens=None,
                            onboard_tokens=None):  # the manager's documented meaning
        if offload_pairs:
            self.offload_blocks(offload_pairs, offload_tokens)
        if onboard_pairs:
            self.onboard_blocks(onboard_pairs, onboard_tokens)

    def _apply(self, op, pairs, num_tokens):
        pairs = list(pairs)
        if num_tokens is None or isinstance(num_tokens, int):
            num_tokens = [num_tokens or 0] * len(pairs)
        self.calls.append((op, pairs, list(num_tokens)))
        for (src, dst), n in zip(pairs, num_tokens):  # as if one after another
            n = T if n <= 0 or n >= T else n
            data = self.mem[src.is_primary][src.memory_pool_block_index][:n]
            self.mem[dst.is_primary][dst.memory_pool_block_index][:n] = data

    def sync_transfers(self, block=True, layer_wise=False):
        self.syncs += 1

    def ops(self, op):
        return [c for c in self.calls if c[0] == op]


def _index_pairs(src, src_primary, dst, dst_primary):
    return [(kvx.KVCacheBlock(0, int(s), src_primary), kvx.KVCacheBlock(0, int(d), dst_primary))
            for s, d in zip(src, dst)]


def make(num_primary=4, num_secondary=4, **kwargs):
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=1,
                                       tokens_per_block=T, dtype="float32",
                                       num_primary_blocks=num_primary,
                                       num_secondary_blocks=num_secondary, kv_factor=1)
    fake = FakeTransferManager(num_primary, num_secondary, pool)
    return BlockManager(pool, transfer_manager=fake, **kwargs), fake


def check_and_compute(bm, fake, sid, tokens, reused):
    """After the step's sync: the reused prefix holds the right tokens; 'compute' the rest."""
    table = bm.block_table(sid)
    for pos in range(len(tokens)):
        cell = fake.mem[True][table[pos // T]]
        if pos < reused:
            assert cell[pos % T] == tokens[pos], f"{sid}: position {pos} holds a wrong token"
        else:
            cell[pos % T] = tokens[pos]


def serve(bm, fake, sid, tokens, priority=35, release=True):
    """add_sequence, sync, check the reused prefix's tokens, 'compute' the rest, release."""
    reused = bm.add_sequence(sid, tokens, priority=priority)
    bm.sync_transfers()
    assert len(bm.block_table(sid)) == -(-len(tokens) // T)
    check_and_compute(bm, fake, sid, tokens, reused)
    if release:
        bm.release_sequence(sid)
    return reused


def check_slots(bm):
    """Every primary/secondary slot is free, cached-reusable or in use: exactly one of them."""
    in_use = {b.slot for s in bm._seqs.values() for b in s.blocks}
    slots = list(bm._free) + [b.slot for b in bm._reusable] + sorted(in_use)
    assert len(slots) == len(set(slots)), "a primary slot twice"
    assert len(slots) == bm.num_primary_blocks
    # the host pool's rows are the connector's: free, or holding a reusable block
    rows = [bm._host.host_slot(key) for key in bm._host.eviction_order()] if bm._host else []
    assert len(rows) == len(set(rows)), "a secondary slot twice"
    assert len(rows) + bm.num_free_secondary_blocks == bm.num_secondary_blocks


def test_free_lists_and_release():
    bm, _ = make(4, 2)
    assert (bm.num_free_primary_blocks, bm.num_free_secondary_blocks) == (4, 2)
    bm.add_sequence("a", list(range(6)))
    assert bm.num_free_primary_blocks == 2
    bm.release_sequence("a")  # cached: reusable, not free
    assert bm.num_free_primary_blocks == 2 and len(bm.reusable_blocks()) == 2
    assert bm.num_cached_blocks == 2
    bm.add_sequence("b", [50, 51, 52])
    bm.release_sequence("b", store_for_reuse=False)
    assert bm.num_free_primary_blocks == 2 and bm.num_cached_blocks == 2
    check_slots(bm)


def test_chained_hash_matching():
    bm, fake = make(8, 0)
    assert serve(bm, fake, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    table_a = bm.reusable_blocks()
    assert serve(bm, fake, "b", [1, 2, 3, 4, 5, 6, 7, 8, 100, 101]) == 8
    assert bm.stats.reused_blocks == 2
    # The same second block after a different first block is a different prefix.
    assert bm.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 1]).num_tokens == 0
    assert len(table_a) == 3
    check_slots(bm)


def test_full_blocks_are_shared_in_place():
    bm, fake = make(8, 0)
    serve(bm, fake, "a", [1, 2, 3, 4, 5])
    bm.add_sequence("b", [1, 2, 3, 4, 6, 7])
    bm.add_sequence("c", [1, 2, 3, 4, 8])
    assert bm.block_table("b")[0] == bm.block_table("c")[0]
    assert bm.block_table("b")[1] != bm.block_table("c")[1]


def test_partial_match_is_copied_into_a_fresh_block():
    bm, fake = make(8, 0)
    serve(bm, fake, "a", [1, 2, 3, 4, 5, 6])
    src = bm.reusable_blocks()
    fake.calls.clear()
    assert serve(bm, fake, "b", [1, 2, 3, 4, 5, 7, 8], release=False) == 5
    (op, pairs, tokens), = fake.calls
    assert op == "onboard" and tokens == [1] and pairs[0][0].is_primary  # intra-device copy
    assert bm.stats.partial_copies == 1 and bm.stats.reused_blocks == 1
    assert len(src) == 2 and (5, 6) in src  # the partially filled last block was stored


def test_last_token_is_always_computed():
    bm, fake = make(8, 0)
    serve(bm, fake, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    fake.calls.clear()
    # The whole prompt is cached, but its last token must be recomputed for its logits, and
    # the block it sits in is written: its first 3 tokens are copied (copy-on-partial-reuse).
    assert serve(bm, fake, "b", [1, 2, 3, 4, 5, 6, 7, 8]) == 7
    assert fake.calls[0][2] == [3]
    assert bm.add_sequence("c", [1]) == 0


def test_lru_order_and_offload_then_onboard():
    bm, fake = make(4, 3)
    for sid, first in (("a", 10), ("b", 20), ("c", 30)):
        serve(bm, fake, sid, [first, first + 1, first + 2, first + 3])
    assert bm.reusable_blocks() == [(10, 11, 12, 13), (20, 21, 22, 23), (30, 31, 32, 33)]
    serve(bm, fake, "b2", [20, 21, 22, 23, 99])  # reuse moves b to most recently used
    assert bm.reusable_blocks() == [(10, 11, 12, 13), (30, 31, 32, 33), (99,), (20, 21, 22, 23)]
    fake.calls.clear()
    serve(bm, fake, "d", [40, 41, 42])  # evicts a, the LRU block: offloaded, still findable
    assert fake.ops("offload") and bm.reusable_blocks(primary=False)[0] == (10, 11, 12, 13)
    assert bm.match_prefix([10, 11, 12, 13, 0]).secondary_blocks == 1
    fake.calls.clear()
    assert serve(bm, fake, "a2", [10, 11, 12, 13, 14, 15]) == 4  # onboarded back
    onboards = fake.ops("onboard")
    assert onboards and not onboards[0][1][0][0].is_primary
    assert bm.stats.onboarded_blocks == 1 and bm.stats.offloaded_blocks >= 1
    assert (10, 11, 12, 13) not in bm.reusable_blocks(primary=False)
    check_slots(bm)


def test_priorities_order_eviction_and_gate_offload():
    bm, fake = make(3, 4)
    serve(bm, fake, "hi", [1, 2, 3, 4], priority=80)
    serve(bm, fake, "mid", [5, 6, 7, 8], priority=35)
    serve(bm, fake, "low", [9, 10, 11, 12], priority=10)
    assert bm.reusable_blocks() == [(9, 10, 11, 12), (5, 6, 7, 8), (1, 2, 3, 4)]
    serve(bm, fake, "x", [20, 21, 22, 23, 24], priority=35)  # needs 2 blocks
    s = bm.stats
    assert s.dropped_primary_blocks == 1 and s.offloaded_blocks == 1  # low dropped, mid offloaded
    assert bm.reusable_blocks(primary=False) == [(5, 6, 7, 8)]
    assert bm.match_prefix([9, 10, 11, 12, 0]).num_tokens == 0
    assert bm.match_prefix([1, 2, 3, 4, 0]).primary_blocks == 1


def test_no_offload_below_min_priority_or_when_disabled():
    for kwargs, priority in (({}, 29), ({"enable_offload": False}, 50),
                             ({"secondary_offload_min_priority": 60}, 50)):
        bm, fake = make(1, 4, **kwargs)
        serve(bm, fake, "a", [1, 2, 3, 4], priority=priority)
        serve(bm, fake, "b", [5, 6, 7])
        assert not fake.ops("offload") and bm.stats.dropped_primary_blocks == 1


def test_secondary_eviction_drops_lru_host_block():
    bm, fake = make(1, 2)
    for i in range(4):  # each new block evicts the previous one to the host
        serve(bm, fake, f"s{i}", [i * 10 + k for k in range(4)])
    s = bm.stats
    assert s.offloaded_blocks == 3 and s.dropped_secondary_blocks == 1
    assert bm.reusable_blocks(primary=False) == [(10, 11, 12, 13), (20, 21, 22, 23)]
    assert bm.match_prefix([0, 1, 2, 3, 9]).num_tokens == 0
    assert bm.match_prefix([10, 11, 12, 13, 9]).num_tokens == 4
    check_slots(bm)


def test_host_keeps_higher_priority_blocks():
    bm, fake = make(1, 1)
    serve(bm, fake, "keep", [1, 2, 3, 4], priority=90)
    serve(bm, fake, "x", [5, 6, 7, 8], priority=40)  # keep -> host
    serve(bm, fake, "y", [9, 10, 11])  # x must go, but the host's block outranks it: dropped
    s = bm.stats
    assert s.offloaded_blocks == 1 and s.dropped_primary_blocks == 1
    assert s.dropped_secondary_blocks == 0
    assert bm.reusable_blocks(primary=False) == [(1, 2, 3, 4)]


def test_partial_reuse_from_secondary_and_batched_onboard():
    bm, fake = make(3, 8)
    serve(bm, fake, "a", list(range(1, 11)))  # blocks [1-4] [5-8] [9,10]
    serve(bm, fake, "evict", [50, 51, 52, 53, 54, 55, 56, 57, 58])  # pushes a to the host
    assert len(bm.reusable_blocks(primary=False)) == 3
    fake.calls.clear()
    assert serve(bm, fake, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 77]) == 9
    onboards = fake.ops("onboard")
    assert len(onboards) == 1, "one batched onboard call"
    (_, pairs, tokens), = onboards
    assert [p[0].is_primary for p in pairs] == [False, False, False] and tokens == [0, 0, 1]
    s = bm.stats
    assert s.onboarded_blocks == 2 and s.partial_onboards == 1
    assert len(fake.ops("offload")) <= 1, "offloads of one allocation are one batch"
    check_slots(bm)


def test_transfers_issued_and_synced_at_step_boundary():
    bm, fake = make(2, 4)
    serve(bm, fake, "a", [1, 2, 3, 4, 5])
    fake.calls.clear()
    syncs = fake.syncs
    bm.add_sequence("b", [7, 8, 9, 10, 11])  # evicts both of a's blocks
    assert not fake.calls, "queued during allocation"
    bm.sync_transfers()
    assert len(fake.ops("offload")) == 1 and len(fake.ops("offload")[0][1]) == 2
    assert fake.syncs == syncs + 1


def test_cancelled_sequence_block_evicted_before_its_onboard_is_issued():
    """An onboarded block freed and evicted in the same step is offloaded with its new data."""
    bm, fake = make(2, 3)
    serve(bm, fake, "a", [1, 2, 3, 4, 5])
    serve(bm, fake, "x", [7, 8, 9, 10, 11])  # a's blocks go to the host
    assert bm.match_prefix([1, 2, 3, 4, 6]).secondary_blocks == 1
    bm.add_sequence("b", [1, 2, 3, 4, 6])  # queues the onboard of [1, 2, 3, 4]
    bm.release_sequence("b", store_for_reuse=False)  # cancelled before its step ran
    bm.add_sequence("c", [20, 21, 22, 23, 24, 25])  # evicts [1, 2, 3, 4] again
    bm.sync_transfers()
    bm.release_sequence("c", store_for_reuse=False)
    assert serve(bm, fake, "d", [1, 2, 3, 4, 9]) == 4  # checks the onboarded tokens
    check_slots(bm)


def test_append_tokens_allocates_blocks():
    bm, _ = make(4, 0)
    bm.add_sequence("a", [1, 2, 3])
    bm.append_tokens("a", [4])
    assert len(bm.block_table("a")) == 1
    bm.append_tokens("a", [5, 6, 7, 8, 9])
    assert len(bm.block_table("a")) == 3 and bm.num_tokens("a") == 9
    with pytest.raises(PoolExhaustedError):
        bm.append_tokens("a", list(range(20)))
    assert bm.num_tokens("a") == 9 and bm.num_free_primary_blocks == 1


def test_errors():
    bm, _ = make(2, 0)
    for bad in (101, -1, True, 1.5):
        with pytest.raises(ValueError, match="priority"):
            bm.add_sequence("x", [1], priority=bad)
    with pytest.raises(ValueError, match="at least one"):
        bm.add_sequence("x", [])
    with pytest.raises(ValueError, match="non-negative"):
        bm.add_sequence("x", [1, -2])
    with pytest.raises(TypeError, match="integers"):
        bm.add_sequence("x", [1.5])
    with pytest.raises(TypeError):
        bm.add_sequence("x", "abc")
    with pytest.raises(TypeError, match="hashable"):
        bm.add_sequence(["x"], [1])
    bm.add_sequence("x", [1])
    with pytest.raises(KeyError, match="in use"):
        bm.add_sequence("x", [2])
    with pytest.raises(KeyError, match="unknown"):
        bm.release_sequence("nope")
    free = bm.num_free_primary_blocks
    with pytest.raises(PoolExhaustedError, match="primary"):
        bm.add_sequence("big", list(range(3 * T)))
    assert bm.num_free_primary_blocks == free and "big" not in bm._seqs
    with pytest.raises(TypeError, match="KVCacheBlockPool"):
        BlockManager([object()])
    with pytest.raises(ValueError, match="at least one"):
        BlockManager([])


def _random_workload(rng, n):
    """Sequences sharing prefixes: a few roots, extended and branched at random points."""
    done = [list(rng.integers(0, 5, rng.integers(1, 9))) for _ in range(3)]
    for _ in range(n):
        base = done[rng.integers(len(done))]
        cut = int(rng.integers(0, len(base) + 1))
        seq = base[:cut] + list(rng.integers(0, 5, rng.integers(1, 7)))
        done.append(seq)
        yield [int(t) for t in seq], int(rng.choice([10, 35, 35, 60]))


@pytest.mark.parametrize("seed", range(6))
def test_randomized_against_token_shadow(seed):
    """Steps of several allocations, releases and cancellations, then one sync."""
    rng = np.random.default_rng(seed)
    num_primary, num_secondary = int(rng.integers(8, 14)), int(rng.choice([0, 4, 8]))
    bm, fake = make(num_primary, num_secondary)
    workload = _random_workload(rng, 300)
    computed, i = [], 0
    for _ in range(100):
        added = []
        for _ in range(int(rng.integers(1, 4))):
            tokens, priority = next(workload)
            tokens, i = tokens[:2 * T], i + 1
            try:
                reused = bm.add_sequence(i, tokens, priority=priority)
            except PoolExhaustedError:
                continue
            if rng.random() < 0.15:  # cancelled before its step ran: nothing stored
                bm.release_sequence(i, store_for_reuse=False)
            else:
                added.append((i, tokens, reused))
            if computed and rng.random() < 0.5:  # finished sequences leave mid-allocation
                bm.release_sequence(computed.pop(int(rng.integers(len(computed)))))
        bm.sync_transfers()
        for sid, tokens, reused in added:
            check_and_compute(bm, fake, sid, tokens, reused)
            computed.append(sid)
        while len(computed) > 3:
            bm.release_sequence(computed.pop(0))
        check_slots(bm)
    s = bm.stats
    assert s.reused_tokens > 0 and s.reused_blocks > 0 and s.partial_copies > 0
    if num_secondary:
        assert s.offloaded_blocks > 0 and s.onboarded_blocks + s.partial_onboards > 0


def test_randomized_with_real_transfer_manager():
    """The same bookkeeping through real pools: reused prefixes hold the right values."""
    rng = np.random.default_rng(7)
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=1,
                                       tokens_per_block=T, dtype="float32", num_primary_blocks=6,
                                       num_secondary_blocks=5, kv_factor=1)
    bm = BlockManager(pool)
    max_len = 2 * T

    @jax.jit
    def write(primary, blocks, offsets, values):
        return primary.at[blocks, 0, 0, 0, offsets, 0].set(values, mode="drop")

    for i, (tokens, priority) in enumerate(_random_workload(rng, 40)):
        tokens = tokens[:max_len]
        reused = bm.add_sequence(i, tokens, priority=priority)
        bm.sync_transfers()
        table = bm.block_table(i)
        primary = np.asarray(pool.primary)[:, 0, 0, 0, :, 0]
        for pos in range(reused):
            assert primary[table[pos // T], pos % T] == tokens[pos] + 1, (i, pos)
        pool.primary = write(pool.primary, *_new_token_writes(pool, table, tokens, reused,
                                                              max_len))
        bm.release_sequence(i)
    s, t = bm.stats, bm.transfer_manager.get_and_reset_transfer_stats()
    assert s.offloaded_blocks and s.onboarded_blocks and s.reused_tokens
    assert t.offloaded_blocks == s.offloaded_blocks
    assert t.onboarded_blocks == s.onboarded_blocks + s.partial_onboards
    assert t.copied_blocks == s.partial_copies


def _new_token_writes(pool, table, tokens, reused, max_len):
    """(blocks, offsets, values) writing token value + 1 at each position after the reused
    prefix, padded to max_len with an out-of-range block (dropped by the scatter)."""
    blocks = np.full(max_len, pool.num_primary_blocks, np.int32)
    offsets = np.zeros(max_len, np.int32)
    values = np.zeros(max_len, np.float32)
    for j, pos in enumerate(range(reused, len(tokens))):
        blocks[j], offsets[j], values[j] = table[pos // T], pos % T, tokens[pos] + 1
    return blocks, offsets, values


def test_randomized_with_a_pool_over_an_engines_arrays():
    """The same through a pool over per-layer NHD arrays (`from_layers`): K and V of two layers,
    each token's value in every array; reused prefixes hold the right values in all of them."""
    rng = np.random.default_rng(7)  # the workload above: offloads, onboards, partial reuse
    arrays = [jax.numpy.zeros((6, T, 2, 3), jax.numpy.float32) for _ in range(4)]
    pool = kvx.KVCacheBlockPool.from_layers(arrays, token_axis=1, num_secondary_blocks=5)
    bm = BlockManager(pool)
    max_len = 2 * T

    @jax.jit
    def write(arrays, blocks, offsets, values):
        return [a.at[blocks, offsets].set((values + k)[:, None, None], mode="drop")
                for k, a in enumerate(arrays)]

    for i, (tokens, priority) in enumerate(_random_workload(rng, 40)):
        tokens = tokens[:max_len]
        reused = bm.add_sequence(i, tokens, priority=priority)
        bm.sync_transfers()
        table = bm.block_table(i)
        for k, a in enumerate(pool.primary):
            got = kvx.to_numpy(a)
            for pos in range(reused):
                np.testing.assert_array_equal(got[table[pos // T], pos % T],
                                              tokens[pos] + 1 + k, err_msg=f"{i} {pos} {k}")
        pool.primary = write(pool.primary, *_new_token_writes(pool, table, tokens, reused,
                                                              max_len))
        bm.release_sequence(i)
    s = bm.stats
    assert s.offloaded_blocks and s.onboarded_blocks and s.reused_tokens


def test_a_burst_of_evictions_keeps_the_latest_blocks_on_a_small_host():
    """More blocks evicted at once than the host pool holds: each offloaded block may evict
    an earlier one, so the host keeps the last ones, as one eviction at a time would."""
    bm, fake = make(5, 2)
    serve(bm, fake, "a", list(range(20)))  # five full blocks
    serve(bm, fake, "b", list(range(100, 120)))  # evicts all five, last block first
    s = bm.stats
    assert (s.offloaded_blocks, s.dropped_secondary_blocks, s.dropped_primary_blocks) == (5, 3, 0)
    assert bm.reusable_blocks(primary=False) == [(4, 5, 6, 7), (0, 1, 2, 3)]
    assert bm.match_prefix(list(range(20))).secondary_blocks == 2
    check_slots(bm)


@pytest.mark.parametrize("seed", range(4))
def test_a_prompts_host_rows_ascend_along_it_both_ways(seed):
    """A prompt's blocks evicted together get host rows that ascend from its first block to its
    last, whichever rows were free or freed (other prompts came and went before), so that its
    offload and its later onboard each move runs of consecutive rows in one copy; and the host
    pool still evicts its last block first."""
    rng = np.random.default_rng(seed)
    bm, fake = make(12, 24)
    for k in range(int(rng.integers(3, 8))):  # rows taken and freed in some order first
        serve(bm, fake, f"other{k}", [int(x) for x in rng.integers(1000, 2000, 4 * T)])
    prompt = [int(x) for x in rng.integers(0, 1000, 8 * T)]
    serve(bm, fake, "long", prompt)
    fake.calls.clear()
    serve(bm, fake, "evictor", [int(x) for x in rng.integers(2000, 3000, 12 * T)])
    keys = bm._host.eviction_order()
    rows = {bm._host.host_slot(k): k for k in keys}
    ours = [p for op, pairs, _ in fake.ops("offload") for p in pairs
            if tuple(fake.mem[False][p[1].memory_pool_block_index]) in
            {tuple(prompt[i:i + T]) for i in range(0, len(prompt), T)}]
    assert len(ours) == 8
    by_position = sorted(ours, key=lambda p: prompt.index(
        fake.mem[False][p[1].memory_pool_block_index][0]))
    host_rows = [p[1].memory_pool_block_index for p in by_position]
    assert host_rows == sorted(host_rows), host_rows  # ascending from the first block
    assert [p[1].memory_pool_block_index for p in ours] == host_rows  # in that order
    # the host pool evicts the prompt's last block before its first
    order = [rows[r] for r in host_rows]
    assert keys.index(order[-1]) < keys.index(order[0])
    fake.calls.clear()
    assert serve(bm, fake, "long again", prompt + [1]) == len(prompt)
    loads = [p for op, pairs, _ in fake.ops("onboard") for p in pairs if not p[0].is_primary]
    assert [p[0].memory_pool_block_index for p in loads] == host_rows
    check_slots(bm)
