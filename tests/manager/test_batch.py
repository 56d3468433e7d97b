"""check_batch and PairBatch.take (the manager's per-call batch checks) against plain Python on
random batches: indices, memories, token counts, direction and duplicate destinations."""

import collections

import numpy as np
import pytest

from jax_kvxfer.ops._native import slot_columns
from jax_kvxfer.transfer._batch import check_batch, split_runs
from jax_kvxfer.transfer.pool import KVCacheBlock

NUM_PRIMARY, NUM_SECONDARY, TOKENS = 7, 5, 8


def random_pairs(rng, n, mixed):
    """n pairs over small pools, so that destinations repeat; one direction unless mixed."""
    src_primary = bool(rng.integers(2))
    pairs = []
    for k in range(n):
        sp = bool(rng.integers(2)) if mixed else src_primary
        dp = bool(rng.integers(2)) if mixed else not src_primary
        s = int(rng.integers(NUM_PRIMARY if sp else NUM_SECONDARY))
        d = int(rng.integers(NUM_PRIMARY if dp else NUM_SECONDARY))
        pairs.append((KVCacheBlock(k, s, sp), KVCacheBlock(100 + k, d, dp)))
    return pairs


def reference(pairs, rows=None):
    rows = range(len(pairs)) if rows is None else rows
    picked = [pairs[i] for i in rows]
    dst_slots = [(d.memory_pool_block_index, d.is_primary) for _, d in picked]
    memories = {(s.is_primary, d.is_primary) for s, d in picked}
    return {"src": [s.memory_pool_block_index for s, _ in picked],
            "dst": [d.memory_pool_block_index for _, d in picked],
            "src_primary": [s.is_primary for s, _ in picked],
            "dst_primary": [d.is_primary for _, d in picked],
            "unique_dst": len(set(dst_slots)) == len(dst_slots),
            "direction": memories.pop() if len(memories) == 1 else None}


def check_against(batch, want):
    assert batch.src.tolist() == want["src"]
    assert batch.dst.tolist() == want["dst"]
    assert batch.src_primary.tolist() == want["src_primary"]
    assert batch.dst_primary.tolist() == want["dst_primary"]
    assert batch.unique_dst == want["unique_dst"]
    assert batch.direction == want["direction"]


@pytest.mark.parametrize("seed", range(40))
def test_check_batch_and_take_match_plain_python(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    pairs = random_pairs(rng, n, mixed=seed % 2 == 1)
    tokens = rng.integers(-1, TOKENS + 2, n).tolist()
    batch = check_batch(pairs, tokens, NUM_PRIMARY, NUM_SECONDARY, TOKENS)
    check_against(batch, reference(pairs))
    assert batch.tokens.tolist() == tokens
    assert batch.whole == all(not 0 < t < TOKENS for t in tokens)
    # parts of the batch: random subsets, and the runs the manager dispatches
    rows = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
    check_against(batch.take(rows), reference(pairs, rows.tolist()))
    for run in split_runs(batch):
        part = batch.take(run)
        check_against(part, reference(pairs, run.tolist()))
        assert part.direction is not None


def test_one_index_in_both_memories_is_two_slots():
    pairs = [(KVCacheBlock(0, 1, True), KVCacheBlock(1, 2, False)),
             (KVCacheBlock(2, 3, False), KVCacheBlock(3, 2, True))]
    assert check_batch(pairs, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS).unique_dst
    pairs.append((KVCacheBlock(4, 0, True), KVCacheBlock(5, 2, False)))
    batch = check_batch(pairs, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS)
    assert not batch.unique_dst
    assert batch.take(np.array([0, 1])).unique_dst  # the repeat is left out
    assert not batch.take(np.array([0, 2])).unique_dst


@pytest.mark.parametrize("seed", range(30))
def test_out_of_range_indices_are_caught_as_plain_python_finds_them(seed):
    """Indices from -1 to past the larger pool, with pools of unequal size (7 primary, 5
    secondary): 5 and 6 are valid in one memory only. check_batch raises IndexError naming the
    first bad pair exactly when plain Python finds one."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 10))
    pairs = []
    for k in range(n):
        sp, dp = bool(rng.integers(2)), bool(rng.integers(2))
        # mostly valid indices, so that batches with no bad pair come up too
        s, d = (int(rng.integers(-1, 9)) if rng.random() < 0.15 else
                int(rng.integers(NUM_PRIMARY if p else NUM_SECONDARY)) for p in (sp, dp))
        pairs.append((KVCacheBlock(k, s, sp), KVCacheBlock(100 + k, d, dp)))
    bad = [(i, role) for i, pair in enumerate(pairs) for role, b in zip(("src", "dst"), pair)
           if not 0 <= b.memory_pool_block_index < (NUM_PRIMARY if b.is_primary else NUM_SECONDARY)]
    if not bad:
        check_against(check_batch(pairs, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS),
                      reference(pairs))
        return
    i, role = bad[0]
    with pytest.raises(IndexError, match=rf"^pairs\[{i}\] {role} has memory_pool_block_index"):
        check_batch(pairs, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS)


def test_pairs_as_lists_and_named_tuples_read_like_tuples():
    """The native reader (ffi/slot_columns.cc) takes any tuple or list of two blocks."""
    Pair = collections.namedtuple("Pair", "src dst")
    rng = np.random.default_rng(7)
    pairs = random_pairs(rng, 9, mixed=True)
    mixed = [list(p) if k % 3 == 0 else Pair(*p) if k % 3 == 1 else p for k, p in enumerate(pairs)]
    check_against(check_batch(mixed, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS), reference(pairs))


def test_slot_columns_rejects_columns_of_the_wrong_shape():
    pairs = random_pairs(np.random.default_rng(8), 3, mixed=False)
    with pytest.raises(ValueError, match=r"shape \(2, len\(pairs\)\)"):
        slot_columns(pairs, KVCacheBlock, NUM_PRIMARY, NUM_SECONDARY,
                     np.empty((2, 2), np.int64), np.empty((2, 3), np.bool_))
    for index in (np.empty((2, 3), np.int32), np.empty((3, 2), np.int64).T):
        with pytest.raises(TypeError):  # converting it would fill a copy
            slot_columns(pairs, KVCacheBlock, NUM_PRIMARY, NUM_SECONDARY, index,
                         np.empty((2, 3), np.bool_))


def test_an_attribute_that_raises_is_reported_as_a_bad_block():
    class Evil:
        @property
        def _slot_code(self):
            raise RuntimeError("no")

    pairs = [(KVCacheBlock(0, 1, True), Evil())]
    with pytest.raises(TypeError, match=r"^pairs\[0\] dst must be a KVCacheBlock"):
        check_batch(pairs, None, NUM_PRIMARY, NUM_SECONDARY, TOKENS)


def test_a_getter_that_empties_the_list_of_pairs_is_survived():
    """Python code run while the native pass reads a block may change the list it walks."""
    pairs = random_pairs(np.random.default_rng(9), 4, mixed=False)

    class Emptying(KVCacheBlock):
        @property
        def _slot_code(self):
            pairs.clear()
            return 2

        @_slot_code.setter
        def _slot_code(self, value):
            pass

    pairs[0] = (Emptying(0, 1, False), pairs[0][1])
    found = slot_columns(pairs, KVCacheBlock, NUM_PRIMARY, NUM_SECONDARY,
                         np.empty((2, 4), np.int64), np.empty((2, 4), np.bool_))
    assert found is None and pairs == []


def test_only_kv_cache_blocks_are_read_natively():
    class LooksLikeABlock:
        _slot_code = 3

    with pytest.raises(TypeError, match=r"^pairs\[0\] src must be a KVCacheBlock"):
        check_batch([(LooksLikeABlock(), KVCacheBlock(0, 1, True))], None, NUM_PRIMARY,
                    NUM_SECONDARY, TOKENS)


def test_keyboard_interrupt_while_reading_a_block_propagates():
    class Interrupted(KVCacheBlock):
        @property
        def _slot_code(self):
            raise KeyboardInterrupt

        @_slot_code.setter
        def _slot_code(self, value):
            pass

    with pytest.raises(KeyboardInterrupt):
        check_batch([(Interrupted(0, 1, True), KVCacheBlock(1, 2, False))], None, NUM_PRIMARY,
                    NUM_SECONDARY, TOKENS)

