"""Tests of kvx.copy_blocks_both_ways: an offload and an onboard between the same two pools at
once, against the NumPy reference (both directions computed from the pools as they were), on
fresh random data; and of the plan that keeps the GPU's concurrent version exact.
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
from jax_kvxfer import testing
from jax_kvxfer.testing import BLOCK_COPY_FORK_TARGET as FORK_TARGET
from jax_kvxfer.testing import BothWaysPlan, both_ways_call, both_ways_plan
from jax_kvxfer.testing import IndexFacts as Facts

SHAPE = (16, 2, 2, 2, 8, 16)  # [blocks, layers, kv, heads, tokens, size_per_head]
T = SHAPE[4]
KINDS = ("device", "pinned_host")


def reference(a, b, ab, ba):
    """(new a, new b): each direction reads the pools as they were."""
    return (reference_copy_blocks(a, b, ba[0], ba[1], ba[2]),
            reference_copy_blocks(b, a, ab[0], ab[1], ab[2]))


def random_direction(rng, batch):
    src = rng.permutation(SHAPE[0])[:batch].astype(np.int32)
    dst = rng.permutation(SHAPE[0])[:batch].astype(np.int32)
    src[-1] = -1  # padding
    tokens = rng.integers(-1, T + 2, batch).astype(np.int32)
    return src, dst, tokens


def disjoint_directions(rng, n_ab, n_ba):
    """a->b and b->a with no block written by one and read by the other."""
    a_perm, b_perm = rng.permutation(SHAPE[0]), rng.permutation(SHAPE[0])
    ab = (a_perm[:n_ab], b_perm[:n_ab], rng.integers(-1, T + 2, n_ab))
    ba = (b_perm[n_ab:n_ab + n_ba], a_perm[n_ab:n_ab + n_ba], rng.integers(-1, T + 2, n_ba))
    return tuple(x.astype(np.int32) for x in ab), tuple(x.astype(np.int32) for x in ba)


both_ways_jit = jax.jit(
    lambda a, b, s1, d1, n1, s2, d2, n2: kvx.copy_blocks_both_ways(
        a, b, s1, d1, s2, d2, a_to_b_tokens=n1, b_to_a_tokens=n2),
    donate_argnums=(0, 1))


@pytest.mark.parametrize("b_kind", KINDS)
@pytest.mark.parametrize("a_kind", KINDS)
@pytest.mark.parametrize("hazards", ["none", "a", "b", "both"])
def test_both_ways_matches_the_reference(a_kind, b_kind, hazards, rng):
    a, b = make_pools(rng, SHAPE, jnp.bfloat16)
    ab, ba = disjoint_directions(rng, 7, 6)
    if hazards in ("a", "both"):  # b->a writes an `a` block that a->b reads
        ba[1][0] = ab[0][2]
    if hazards in ("b", "both"):  # a->b writes a `b` block that b->a reads
        ab[1][1] = ba[0][3]
    expected_a, expected_b = reference(a, b, ab, ba)
    # traced indices (the GPU then assumes every hazard)
    new_a, new_b = both_ways_jit(put(a, a_kind), put(b, b_kind), *ab, *ba)
    assert (new_a.sharding.memory_kind, new_b.sharding.memory_kind) == (a_kind, b_kind)
    assert_bitwise_equal(new_a, expected_a, "pool a (jit)")
    assert_bitwise_equal(new_b, expected_b, "pool b (jit)")
    # known indices (the plan follows the actual hazards)
    for donate in (False, True):
        new_a, new_b = kvx.copy_blocks_both_ways(
            put(a, a_kind), put(b, b_kind), ab[0], ab[1], ba[0], ba[1], a_to_b_tokens=ab[2],
            b_to_a_tokens=ba[2], donate=donate)
        assert_bitwise_equal(new_a, expected_a, f"pool a (eager, donate={donate})")
        assert_bitwise_equal(new_b, expected_b, f"pool b (eager, donate={donate})")


def test_duplicate_destinations_in_each_direction(rng):
    a, b = make_pools(rng, SHAPE, jnp.float32)
    ab = (np.array([0, 1, 2], np.int32), np.array([5, 5, 6], np.int32),
          np.array([T, 3, 0], np.int32))
    ba = (np.array([7, 8, 9, 10], np.int32), np.array([4, 4, 4, 2], np.int32),
          np.array([2, T - 1, 1, -1], np.int32))
    expected_a, expected_b = reference(a, b, ab, ba)
    new_a, new_b = both_ways_jit(put(a), put(b, "pinned_host"), *ab, *ba)
    assert_bitwise_equal(new_a, expected_a, "pool a")
    assert_bitwise_equal(new_b, expected_b, "pool b")


def test_one_direction_empty(rng):
    a, b = make_pools(rng, SHAPE, jnp.float32)
    ab = random_direction(rng, 5)
    empty = tuple(np.zeros(0, np.int32) for _ in range(3))
    expected_a, expected_b = reference(a, b, ab, empty)
    new_a, new_b = kvx.copy_blocks_both_ways(put(a), put(b, "pinned_host"), ab[0], ab[1],
                                             [], [], a_to_b_tokens=ab[2])
    assert_bitwise_equal(new_a, expected_a, "pool a")
    assert_bitwise_equal(new_b, expected_b, "pool b")


@pytest.mark.parametrize("mode", ["together", "a_to_b_first", "b_to_a_first", "staged"])
def test_donated_pools_are_not_copied(mode, rng):
    """Both pools updated in place in every plan: no whole-pool copy in the compiled program
    (two copy_blocks calls that each read the pool the other writes make XLA copy both)."""
    a, b = make_pools(rng, SHAPE, jnp.float32)
    ab, ba = disjoint_directions(rng, 4, 4)
    fn = jax.jit(lambda a, b, *idx: both_ways_call(
        a, b, idx[:3], idx[3:], (Facts(), Facts()), BothWaysPlan(mode), None,
        False), donate_argnums=(0, 1))
    hlo = fn.lower(put(a), put(b, "pinned_host"), *ab, *ba).compile().as_text()
    copies = [line for line in hlo.splitlines()
              if " copy(" in line and "f32[16,2,2,2,8,16]" in line.split("copy(")[0]]
    assert not copies, "\n".join(copies)
    assert (FORK_TARGET in hlo) == (mode == "together")
    new_a, new_b = fn(put(a), put(b, "pinned_host"), *ab, *ba)
    expected_a, expected_b = reference(a, b, ab, ba)
    assert_bitwise_equal(new_a, expected_a, f"pool a ({mode})")
    assert_bitwise_equal(new_b, expected_b, f"pool b ({mode})")


def test_plan_follows_the_clashes():
    """A direction whose reads the other direction's writes would spoil runs first; with both
    directions spoilt (or traced indices) one is staged."""
    cases = {  # (ab_src, ab_dst, ba_src, ba_dst) over 8 blocks each
        "together": ([0, 1], [2, 3], [4, 5], [6, 7]),
        "a_to_b_first": ([0, 1], [2, 3], [4, 5], [1, 7]),   # b->a writes a-block 1, read by a->b
        "b_to_a_first": ([0, 1], [2, 3], [3, 5], [6, 7]),   # a->b writes b-block 3, read by b->a
        "staged": ([0, 1], [2, 3], [3, 5], [1, 7]),
    }
    for mode, lists in cases.items():
        plan = both_ways_plan(*(np.array(x, np.int32) for x in lists), 8, 8)
        assert plan == BothWaysPlan(mode), (mode, plan)
    # padding and out-of-range pairs clash with nothing
    plan = both_ways_plan(np.array([0, -1], np.int32), np.array([2, 1], np.int32),
                          np.array([9, 5], np.int32), np.array([1, 7], np.int32), 8, 8)
    assert plan == BothWaysPlan("together")
    assert both_ways_plan(None, None, None, None, 8, 8) == BothWaysPlan("staged")


@pytest.mark.parametrize("call, error, message", [
    (lambda a, b: kvx.copy_blocks_both_ways(a, a, [0], [1], [2], [3]), ValueError,
     "pool_a and pool_b must be two different arrays"),
    (lambda a, b: kvx.copy_blocks_both_ways(a, b, [0], [16], [2], [3]), IndexError,
     "a_to_b_dst holds block index 16, but pool_b has 16 blocks"),
    (lambda a, b: kvx.copy_blocks_both_ways(a, b, [0], [1], [2, 3], [3]), ValueError,
     "b_to_a_src has length 2 but b_to_a_dst has length 1"),
    (lambda a, b: kvx.copy_blocks_both_ways(a, b, [0], [1], [2], [3], b_to_a_tokens=[1, 2]),
     ValueError, "b_to_a_tokens has length 2, expected 1"),
    (lambda a, b: kvx.copy_blocks_both_ways(a, b, [0], [1], [2], [3], max_ctas=0), ValueError,
     "max_ctas must be None or a positive int, got 0"),
])
def test_bad_input_raises_and_leaves_pools_unchanged(call, error, message, rng):
    a, b = make_pools(rng, SHAPE, jnp.float32)
    pa, pb = put(a), put(b, "pinned_host")
    with pytest.raises(error, match=message):
        call(pa, pb)
    assert_unchanged(pa, a, "pool_a")
    assert_unchanged(pb, b, "pool_b")


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 or more devices")
def test_pools_split_by_heads_copy_both_ways_per_device(rng):
    """Pools sharded by KV heads: each device runs both directions on its own shard."""
    n = min(len(jax.devices()), 4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("tp",))
    spec = jax.sharding.PartitionSpec(None, None, None, "tp", None, None)
    shape = (10, 2, 2, 2 * n, 4, 8)
    a, b = make_pools(rng, shape, jnp.float32)
    pa = jax.device_put(a, jax.sharding.NamedSharding(mesh, spec, memory_kind="device"))
    pb = jax.device_put(b, jax.sharding.NamedSharding(mesh, spec, memory_kind="pinned_host"))
    ab = (np.array([0, 3, 4], np.int32), np.array([9, 2, 3], np.int32),
          np.array([0, 2, -1], np.int32))
    ba = (np.array([3, 5], np.int32), np.array([4, 1], np.int32), np.array([1, 0], np.int32))
    new_a, new_b = kvx.copy_blocks_both_ways(pa, pb, ab[0], ab[1], ba[0], ba[1],
                                             a_to_b_tokens=ab[2], b_to_a_tokens=ba[2])
    assert new_a.sharding.is_equivalent_to(pa.sharding, 6)
    assert new_b.sharding.is_equivalent_to(pb.sharding, 6)
    expected_a, expected_b = reference(a, b, ab, ba)
    assert_bitwise_equal(new_a, expected_a, "pool a")
    assert_bitwise_equal(new_b, expected_b, "pool b")


def test_copy_engines_with_traced_disjoint_indices(rng):
    """The serving form: indices as pinned_host jit arguments (dma=True needs them there), the
    caller promising no clash, so the two directions run together on the copy engines."""
    a, b = make_pools(rng, SHAPE, jnp.bfloat16)
    ab, ba = disjoint_directions(rng, 6, 5)
    pinned = tuple(jax.block_until_ready(put(x, "pinned_host")) for x in (*ab, *ba))
    fn = jax.jit(lambda a, b, *i: kvx.copy_blocks_both_ways(
        a, b, i[0], i[1], i[3], i[4], a_to_b_tokens=i[2], b_to_a_tokens=i[5], dma=True,
        disjoint=True), donate_argnums=(0, 1))
    assert FORK_TARGET in fn.lower(put(a), put(b, "pinned_host"), *pinned).as_text()
    gpu = jax.default_backend() == "gpu"
    before = testing.dma_batches() if gpu else 0
    new_a, new_b = fn(put(a), put(b, "pinned_host"), *pinned)
    expected_a, expected_b = reference(a, b, ab, ba)
    assert_bitwise_equal(new_a, expected_a, "pool a")
    assert_bitwise_equal(new_b, expected_b, "pool b")
    if gpu:
        assert testing.dma_batches() - before == 2  # the fork and the join


def test_disjoint_is_checked_where_indices_are_known(rng):
    a, b = make_pools(rng, SHAPE, jnp.float32)
    pa, pb = put(a), put(b, "pinned_host")
    with pytest.raises(ValueError, match="plan 'b_to_a_first'"):
        kvx.copy_blocks_both_ways(pa, pb, [0], [3], [3], [5], disjoint=True)
    assert_unchanged(pa, a, "pool_a")
    assert_unchanged(pb, b, "pool_b")
