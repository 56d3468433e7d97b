"""Pools sharded by KV heads over a mesh (tensor parallelism): each device copies its own shard.

On CPU the suite has 4 virtual devices (tests/conftest.py); on a GPU machine the multi-device
tests use up to 4 of its GPUs, and on a one-GPU machine they skip (the one-device mesh tests run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kvxfer as kvx
from jax_kvxfer import testing
from jax_kvxfer.ops._checks import IndexFacts
from jax_kvxfer.ops._lowering import CopyPlan, eager_copy

DEVICES = jax.devices()
multi_device = pytest.mark.skipif(len(DEVICES) < 2, reason="needs 2 or more devices")
# 4 virtual CPU devices in CI; on a GPU machine, its GPUs (2 on nvidia-h200-x2).
MULTI = min(len(DEVICES), 4)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
HEADS_SPEC = P(None, None, None, "tp", None, None)


def mesh_of(n: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(DEVICES[:n]), ("tp",))


def sharded_pool(mesh, heads=8, num_primary=6, num_secondary=5, dtype=jnp.float32, seed=0):
    pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=heads, size_per_head=4,
                                       tokens_per_block=4, dtype=dtype,
                                       num_primary_blocks=num_primary,
                                       num_secondary_blocks=num_secondary, mesh=mesh,
                                       kv_head_axis="tp")
    rng = np.random.default_rng(seed)
    pool.primary = jax.device_put(rng.standard_normal(pool.primary.shape).astype(dtype),
                                  pool.primary.sharding)
    pool.secondary = jax.device_put(rng.standard_normal(pool.secondary.shape).astype(dtype),
                                    pool.secondary.sharding)
    return pool


def reference(dst, src, si, di, nt):
    out, t = dst.copy(), dst.shape[4]
    for s, d, n in zip(si, di, nt):
        n = t if n <= 0 or n >= t else n
        out[d][..., :n, :] = src[s][..., :n, :]
    return out


@pytest.mark.parametrize("devices", [1, pytest.param(MULTI, marks=multi_device)])
def test_create_shards_both_pools_by_heads(devices):
    mesh = mesh_of(devices)
    pool = sharded_pool(mesh, heads=8)
    for array, kind in ((pool.primary, "device"), (pool.secondary, "pinned_host")):
        assert array.sharding.memory_kind == kind
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, HEADS_SPEC, memory_kind=kind), 6)
        assert {s.data.shape[3] for s in array.addressable_shards} == {8 // devices}
        assert {s.device for s in array.addressable_shards} == set(DEVICES[:devices])


@pytest.mark.parametrize("devices", [1, pytest.param(MULTI, marks=multi_device)])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_copy_blocks_on_sharded_pools(devices, direction):
    pool = sharded_pool(mesh_of(devices), seed=devices)
    dst, src = {"d2h": (pool.secondary, pool.primary), "h2d": (pool.primary, pool.secondary),
                "d2d": (pool.primary, pool.primary)}[direction]
    dst_np, src_np = np.asarray(dst), np.asarray(src)
    si, di, nt = [0, 3, 1], [4, 1, 2], [0, 2, 3]
    out = kvx.copy_blocks(dst, src, si, di, nt)
    assert out.sharding == dst.sharding
    np.testing.assert_array_equal(np.asarray(out), reference(dst_np, src_np, si, di, nt))


@multi_device
def test_sharded_copy_compiles_without_collectives():
    pool = sharded_pool(mesh_of(MULTI))
    facts = IndexFacts(hazard_free=True, unique_dst=True)
    plan = np.zeros((3, 4), np.int32)
    # the plan ring slot's token, replicated as the ring makes it
    token = (jnp.zeros((1,), jnp.int32, device=NamedSharding(pool.mesh, P())),)
    for fn, args in ((testing.dispatcher("COPY_ACROSS"),
                      ((pool.secondary,), (pool.primary,), plan, token)),
                     (testing.dispatcher("COPY_WITHIN"), ((pool.primary,), plan, token))):
        hlo = fn.lower(*args, facts=facts, mesh=pool.mesh,
                       storages=(pool.storage,)).compile().as_text()
        assert "jax_kvxfer_block_copy" in hlo
        assert not [c for c in COLLECTIVES if c in hlo], "a sharded copy moved data between devices"
    eager = eager_copy(CopyPlan(facts), pool.secondary.sharding)
    idx = np.zeros(4, np.int32)
    hlo = eager.lower(pool.secondary, pool.primary, idx, idx, idx).compile().as_text()
    assert not [c for c in COLLECTIVES if c in hlo]


@multi_device
def test_manager_on_sharded_pools_with_different_head_counts():
    mesh = mesh_of(MULTI)
    pools = [sharded_pool(mesh, heads=8, seed=1), sharded_pool(mesh, heads=4, seed=2)]
    before = [(kvx.to_numpy(p.primary), kvx.to_numpy(p.secondary)) for p in pools]
    m = kvx.KVCacheTransferManager(pools)
    blk = kvx.KVCacheBlock
    m.offload_blocks([(blk(0, 1, True), blk(0, 2, False)), (blk(1, 3, True), blk(1, 0, False))])
    m.onboard(blk(2, 2, False), blk(2, 5, True))  # reads the slot just offloaded
    m.onboard(blk(3, 5, True), blk(3, 4, True), num_tokens=2)  # partial, within the device pool
    m.sync_transfers()
    for pool, (prim, sec) in zip(pools, before):
        sec_expected = sec.copy()
        sec_expected[2], sec_expected[0] = prim[1], prim[3]
        prim_expected = prim.copy()
        prim_expected[5] = prim[1]
        prim_expected[4][..., :2, :] = prim[1][..., :2, :]
        np.testing.assert_array_equal(kvx.to_numpy(pool.secondary), sec_expected)
        np.testing.assert_array_equal(kvx.to_numpy(pool.primary), prim_expected)
        assert pool.primary.sharding.is_equivalent_to(pool.sharding("device"), 6)
        assert pool.secondary.sharding.memory_kind == "pinned_host"


@multi_device
@pytest.mark.parametrize("kwargs, match", [
    ({"num_kv_heads": 2 * MULTI + 1}, f"divisible by the {MULTI} devices"),
    ({"kv_head_axis": "dp"}, "kv_head_axis must name an axis"),
    ({"device": DEVICES[0]}, "device or mesh, not both"),
])
def test_bad_sharded_pools(kwargs, match):
    args = {"num_layers": 1, "num_kv_heads": 8, "size_per_head": 2, "tokens_per_block": 2,
            "dtype": jnp.float32, "num_primary_blocks": 2, "num_secondary_blocks": 2,
            "mesh": mesh_of(MULTI), "kv_head_axis": "tp"} | kwargs
    with pytest.raises(ValueError, match=match):
        kvx.KVCacheBlockPool.create(**args)


@multi_device
def test_sharded_copy_rejects_mismatched_or_token_splits():
    mesh = mesh_of(MULTI)
    pool = sharded_pool(mesh)
    unsharded = jax.device_put(np.asarray(pool.primary), DEVICES[0])
    with pytest.raises(ValueError, match="src_pool must be split over the devices like"):
        kvx.copy_blocks(pool.secondary, unsharded, [0], [0])
    by_tokens = NamedSharding(mesh, P(None, None, None, None, "tp", None))
    split = jax.device_put(np.asarray(pool.primary), by_tokens)
    with pytest.raises(ValueError, match="not along blocks or tokens"):
        kvx.copy_blocks(split, split, [0], [1])
    manager = kvx.KVCacheTransferManager([pool])
    with pytest.raises(ValueError, match="pool.primary must have the pool's sharding"):
        pool.primary = unsharded
    with pytest.raises(ValueError, match="mesh"):
        kvx.KVCacheTransferManager([pool, kvx.KVCacheBlockPool.create(
            num_layers=2, num_kv_heads=8, size_per_head=4, tokens_per_block=4,
            dtype=jnp.float32, num_primary_blocks=6, num_secondary_blocks=5)])
    assert manager.pools == (pool,)
