"""`KVCacheBlockPool.from_layers`: pools over an engine's per-layer arrays in the layouts JAX
engines use, offloaded into contiguous host rows and onboarded back through the manager (pairs
and index arrays), against a NumPy model of the arrays and the rows on fresh random data; and
the errors of arrays that do not fit, with the pools unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer import testing

# name: (one array's shape with the block axis None, block_axis, token_axis, arrays per pool)
LAYOUTS = {
    "trtllm 6-D, one array": ((None, 3, 2, 2, 4, 8), 0, 4, 1),
    "NHD, K and V apart": ((None, 4, 3, 8), 0, 1, 6),
    "HND": ((None, 3, 4, 8), 0, 2, 4),
    "K/V first": ((2, None, 4, 3, 8), 1, 2, 3),
    "fused K/V heads": ((None, 4, 6, 8), 0, 1, 3),
    "MLA": ((None, 4, 24), 0, 1, 5),
    "odd sizes": ((None, 5, 3, 7), 0, 1, 3),
}
DTYPES = (np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)


class Model:
    """The arrays and the host rows as NumPy: each array's block b is
    `np.moveaxis(a, block_axis, 0)[b]`, and a host row is every array's block ravelled, in
    order."""

    def __init__(self, arrays: list[np.ndarray], num_rows: int, block_axis: int,
                 token_axis: int) -> None:
        self.arrays = [np.moveaxis(a, block_axis, 0).copy() for a in arrays]
        self.block_axis, self.token_axis = block_axis, token_axis
        self.rows = [np.zeros((num_rows, *a.shape[1:]), a.dtype) for a in self.arrays]

    def _copy(self, dst: list[np.ndarray], src: list[np.ndarray], pairs, tokens) -> None:
        snapshot = [s.copy() for s in src]
        for (s, d), n in zip(pairs, tokens):
            for out, a in zip(dst, snapshot):
                t = out.shape[self.token_axis]  # the token axis of a block (the block axis gone)
                index = [slice(None)] * (out.ndim - 1)
                if 0 < n < t:
                    index[self.token_axis - 1] = slice(0, n)
                out[(d, *index)] = a[(s, *index)]

    def offload(self, pairs, tokens) -> None:
        self._copy(self.rows, self.arrays, pairs, tokens)

    def onboard(self, pairs, tokens) -> None:
        self._copy(self.arrays, self.rows, pairs, tokens)

    def host_rows(self) -> np.ndarray:
        return np.concatenate([r.reshape(r.shape[0], -1) for r in self.rows], axis=1)

    def device_arrays(self) -> list[np.ndarray]:
        return [np.moveaxis(a, 0, self.block_axis) for a in self.arrays]


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _make(rng, layout, dtype, num_blocks=7, num_rows=5):
    shape, block_axis, token_axis, count = layout
    shape = tuple(num_blocks if d is None else d for d in shape)
    host = [_random(rng, shape, dtype) for _ in range(count)]
    arrays = [jnp.asarray(a) for a in host]
    pool = kvx.KVCacheBlockPool.from_layers(arrays, token_axis=token_axis, block_axis=block_axis,
                                            num_secondary_blocks=num_rows)
    return pool, Model(host, num_rows, block_axis, token_axis)


def _check(pool, model, what):
    got = kvx.to_numpy(pool.secondary)
    want = model.host_rows()
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)
    for k, (g, w) in enumerate(zip(pool.primary, model.device_arrays())):
        np.testing.assert_array_equal(kvx.to_numpy(g).view(np.uint8), w.view(np.uint8),
                                      err_msg=f"{what}: array {k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_and_onboard_through_the_manager_match_the_model(name, dtype, rng):
    pool, model = _make(rng, LAYOUTS[name], dtype)
    _offload_and_onboard(kvx.KVCacheTransferManager(pool), pool, model, rng)


@pytest.mark.parametrize("dma", ["auto", False], ids=["lanes", "in line"])
def test_both_paths_of_the_manager(dma, rng):
    """The transfer lanes (the default) and the copies on XLA's stream (dma=False)."""
    pool, model = _make(rng, LAYOUTS["K/V first"], ml_dtypes.bfloat16)
    mgr = kvx.KVCacheTransferManager(pool, dma=dma)
    assert testing.copy_engine(mgr) == ("lanes" if dma == "auto" else "in line")
    _offload_and_onboard(mgr, pool, model, rng)


@pytest.mark.parametrize("dma", ["auto", False], ids=["lanes", "in line"])
@pytest.mark.parametrize("name,count", [("K/V first", 3), ("NHD, K and V apart", 6),
                                        ("MLA", 70)], ids=["slabs", "pairs of arrays",
                                                           "more arrays than one launch takes"])
def test_repeated_destinations_the_later_pair_wins(name, count, dma, rng):
    """Batches that write a block twice, partly and wholly, through every path of the layered
    copy: the later pair wins for the tokens it writes (on the GPU one duplicate scan serves
    every layer; 70 arrays take two kernel launches of a layered copy)."""
    shape, block_axis, token_axis, _ = LAYOUTS[name]
    pool, model = _make(rng, (shape, block_axis, token_axis, count), np.float32)
    mgr = kvx.KVCacheTransferManager(pool, dma=dma)
    t = pool.tokens_per_block
    for _ in range(2):
        src = rng.choice(pool.num_primary_blocks, 6, replace=False)
        dst = rng.choice(pool.num_secondary_blocks, 6)
        dst[3] = dst[1]  # at least one block written twice
        tokens = rng.integers(-1, t + 1, 6)
        mgr.offload_indices(src, dst, tokens)
        model.offload(zip(src, dst), tokens)
        mgr.sync_transfers()
        _check(pool, model, "offload")
        src = rng.choice(pool.num_secondary_blocks, 6)
        dst = rng.choice(pool.num_primary_blocks, 6)
        dst[4] = dst[0]
        tokens = rng.integers(-1, t + 1, 6)
        mgr.onboard_indices(src, dst, tokens)
        model.onboard(zip(src, dst), tokens)
        mgr.sync_transfers()
        _check(pool, model, "onboard")


def _offload_and_onboard(mgr, pool, model, rng):
    t = pool.tokens_per_block
    blk = lambda i, primary: kvx.KVCacheBlock(i, i, primary)
    for step in range(3):
        src = rng.choice(pool.num_primary_blocks, 3, replace=False)
        dst = rng.choice(pool.num_secondary_blocks, 3, replace=False)
        tokens = rng.integers(-1, t + 1, 3)
        if step == 0:  # whole blocks by pairs, then partial by index arrays
            mgr.offload_blocks([(blk(int(s), True), blk(int(d), False)) for s, d in zip(src, dst)])
            model.offload(zip(src, dst), [0] * 3)
        else:
            mgr.offload_indices(src, dst, tokens)
            model.offload(zip(src, dst), tokens)
        mgr.sync_transfers()
        _check(pool, model, f"offload {step}")
        back_src = rng.choice(pool.num_secondary_blocks, 2, replace=False)
        back_dst = rng.choice(pool.num_primary_blocks, 2, replace=False)
        if step == 0:  # whole blocks (the host's hint that lets every path skip token counts)
            mgr.onboard_indices(back_src, back_dst)
            model.onboard(zip(back_src, back_dst), [0] * 2)
        else:
            back_tokens = rng.integers(-1, t + 1, 2)
            mgr.onboard_indices(back_src, back_dst, back_tokens)
            model.onboard(zip(back_src, back_dst), back_tokens)
        mgr.sync_transfers()
        _check(pool, model, f"onboard {step}")
    stats = mgr.get_and_reset_transfer_stats()
    assert stats.offloaded_blocks == 9 and stats.onboarded_blocks == 6


def test_host_rows_are_every_layers_block_in_order(rng):
    """One offloaded row is the concatenation of the layers' blocks, slab by slab for K/V-first
    arrays: what the model computes, spelled out here on one row."""
    pool, _ = _make(rng, LAYOUTS["K/V first"], np.float32)
    before = [np.asarray(a) for a in pool.primary]
    mgr = kvx.KVCacheTransferManager(pool)
    mgr.offload_indices([4], [2])
    mgr.sync_transfers()
    row = kvx.to_numpy(pool.secondary)[2]
    want = np.concatenate([np.concatenate([a[0, 4].ravel(), a[1, 4].ravel()]) for a in before])
    np.testing.assert_array_equal(row, want)
    assert pool.secondary.shape == (pool.num_secondary_blocks, want.size)
    assert pool.block_nbytes == want.nbytes


@pytest.mark.parametrize("dma", ["auto", False], ids=["lanes", "in line"])
def test_copies_within_the_gpu_arrays(dma, rng):
    pool, model = _make(rng, LAYOUTS["HND"], ml_dtypes.bfloat16)
    mgr = kvx.KVCacheTransferManager(pool, dma=dma)
    mgr.offload_indices([0, 1], [3, 4])
    model.offload([(0, 3), (1, 4)], [0, 0])
    # a chain 2 -> 5 -> 6, applied in order as the manager's pairs are (the second reads what
    # the first wrote), partial too
    mgr.onboard_blocks([(kvx.KVCacheBlock(0, 2, True), kvx.KVCacheBlock(1, 5, True)),
                        (kvx.KVCacheBlock(2, 5, True), kvx.KVCacheBlock(3, 6, True))], [0, 3])
    model._copy(model.arrays, model.arrays, [(2, 5)], [0])
    model._copy(model.arrays, model.arrays, [(5, 6)], [3])
    mgr.sync_transfers()
    _check(pool, model, "within")


def test_the_engine_reads_and_donates_the_arrays_and_assigns_them_back(rng):
    pool, model = _make(rng, LAYOUTS["NHD, K and V apart"], np.float32)
    mgr = kvx.KVCacheTransferManager(pool)

    @jax.jit
    def attend(arrays):  # an engine's step reads them ...
        return sum(a[1].sum() for a in arrays)

    @jax.jit
    def write(arrays):  # ... and writes token 0 of block 1 in every array, in place
        return [a.at[1, 0].add(1.0) for a in arrays]

    total = float(attend(pool.primary))
    np.testing.assert_allclose(total, sum(a[1].sum() for a in model.arrays), rtol=1e-5)
    pool.primary = jax.jit(write.__wrapped__, donate_argnums=0)(pool.primary)
    for a in model.arrays:
        a[1, 0] += 1.0
    mgr.offload_indices([1], [0])
    model.offload([(1, 0)], [0])
    mgr.sync_transfers()
    _check(pool, model, "after the engine's step")
    assert isinstance(pool.primary, list) and len(pool.primary) == 6


@pytest.mark.parametrize("bad", ["count", "dtype", "block_count", "tokens", "axis", "order",
                                 "empty", "not_arrays", "device", "split", "host_memory"])
def test_arrays_that_do_not_fit_raise_clear_errors(bad, rng):
    ok = [jnp.asarray(_random(rng, (6, 4, 2, 8), np.float32)) for _ in range(2)]
    kwargs = {"token_axis": 1, "num_secondary_blocks": 3}
    if bad in ("device", "split") and len(jax.devices()) < 2:
        pytest.skip("one device")
    two = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]) if bad == "split" else None
    arrays = {
        "count": lambda: ok,
        "dtype": lambda: [ok[0], ok[1].astype(jnp.bfloat16)],
        "block_count": lambda: [ok[0], jnp.zeros((5, 4, 2, 8), jnp.float32)],
        "tokens": lambda: [ok[0], jnp.zeros((6, 3, 2, 8), jnp.float32)],
        "axis": lambda: ok,
        "order": lambda: ok,
        "empty": list,
        "not_arrays": lambda: [np.zeros((6, 4, 2, 8), np.float32)],
        "device": lambda: [ok[0], jax.device_put(ok[1], jax.devices()[-1])],
        "split": lambda: [jax.device_put(ok[0], jax.sharding.NamedSharding(
            two, jax.sharding.PartitionSpec("x")))],  # by blocks, not by heads
        "host_memory": lambda: [ok[0], jax.device_put(
            ok[1], ok[1].sharding.with_memory_kind("pinned_host"))],
    }[bad]()
    if bad == "count":
        kwargs["num_secondary_blocks"] = -1
    if bad == "axis":
        kwargs["token_axis"] = 4
    if bad == "order":
        kwargs.update(token_axis=0, block_axis=1)
    message = {"count": "num_secondary_blocks", "dtype": "dtype", "block_count": "blocks",
               "tokens": "tokens", "axis": "token_axis", "order": "must come after",
               "empty": "at least one", "not_arrays": "jax.Array", "device": "arrays\\[1\\]",
               "split": "one head axis", "host_memory": "device memory"}[bad]
    with pytest.raises((TypeError, ValueError), match=message):
        kvx.KVCacheBlockPool.from_layers(arrays, **kwargs)


def test_a_bad_assignment_to_primary_leaves_the_pool_unchanged(rng):
    pool, model = _make(rng, LAYOUTS["MLA"], np.float32)
    before = pool.primary
    with pytest.raises(ValueError, match="must hold 5 arrays"):
        pool.primary = before[:4]
    with pytest.raises(ValueError, match=r"pool.primary\[2\] must be float32"):
        pool.primary = before[:2] + [before[2][:, :2]] + before[3:]
    with pytest.raises(TypeError, match="list of jax.Arrays"):
        pool.primary = before[0]
    assert all(a is b for a, b in zip(pool.primary, before))
    _check(pool, model, "unchanged")


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("name", ["NHD, K and V apart", "K/V first"])
def test_arrays_split_by_heads_move_shard_by_shard(name, devices, rng):
    """Arrays split by heads over a mesh: each device's host row part holds its heads of every
    array's block (`pool.secondary` is `[rows, devices, part]`), and every copy stays on the
    device that holds the shard."""
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices")
    shape, block_axis, token_axis, count = LAYOUTS[name]
    head_axis = token_axis + 1  # NHD [nb, T, H, D] and K/V first [2, nb, T, H, D]
    shape = tuple(7 if d is None else d for d in shape)
    shape = shape[:head_axis] + (4,) + shape[head_axis + 1:]
    mesh = jax.make_mesh((devices,), ("tp",), devices=jax.devices()[:devices])
    spec = jax.sharding.PartitionSpec(*[("tp" if k == head_axis else None)
                                        for k in range(len(shape))])
    host = [_random(rng, shape, np.float32) for _ in range(count)]
    arrays = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in host]
    pool = kvx.KVCacheBlockPool.from_layers(arrays, token_axis=token_axis, block_axis=block_axis,
                                            num_secondary_blocks=4)
    assert pool.secondary.shape[:2] == (4, devices)
    # one model per device: its heads of every array
    part = 4 // devices
    models = [Model([np.take(a, range(j * part, (j + 1) * part), axis=head_axis) for a in host],
                    4, block_axis, token_axis) for j in range(devices)]
    mgr = kvx.KVCacheTransferManager(pool)
    mgr.offload_indices([1, 5, 6], [0, 3, 2], [0, 2, 0])
    mgr.onboard_indices([3, 0], [4, 0], [3, 0])
    for m in models:
        m.offload([(1, 0), (5, 3), (6, 2)], [0, 2, 0])
        m.onboard([(3, 4), (0, 0)], [3, 0])
    mgr.sync_transfers()
    got = kvx.to_numpy(pool.secondary)
    for j, m in enumerate(models):
        np.testing.assert_array_equal(got[:, j], m.host_rows(), err_msg=f"device {j}'s rows")
    for k, a in enumerate(pool.primary):
        want = np.concatenate([m.device_arrays()[k] for m in models], axis=head_axis)
        np.testing.assert_array_equal(kvx.to_numpy(a), want, err_msg=f"array {k}")
        assert a.sharding.is_equivalent_to(arrays[0].sharding, a.ndim)


def test_a_join_over_many_arrays_waits_once_and_hands_every_array_on(rng):
    """The step boundary's join over an engine's per-layer arrays (dozens of them) is one wait
    on XLA's stream, not one per array: its program holds one join custom call (and one for
    the host rows where it takes them), and every array comes back with its contents, the
    others ordered after the wait by a barrier."""
    from jax_kvxfer.ops._native import JOIN_LANES_TARGET

    pool, _ = _make(rng, LAYOUTS["K/V first"], ml_dtypes.bfloat16, num_blocks=6)
    arrays = tuple(pool.primary)
    assert len(arrays) == 3
    join = testing.dispatcher("JOIN")
    text = join.lower(arrays, None, lanes=(1,)).as_text()
    assert text.count(JOIN_LANES_TARGET) == 1, text
    # with the host rows too (a join of both lanes): one more, for the pinned_host array, which
    # goes only where custom calls take it
    text = join.lower((*arrays, pool.secondary), None, lanes=(0, 1)).as_text()
    assert text.count(JOIN_LANES_TARGET) == 2, text
    before = [kvx.to_numpy(a) for a in arrays]
    buffers = [a.unsafe_buffer_pointer() for a in arrays]
    out, _ = join(arrays, None, lanes=(1,))
    assert len(out) == len(arrays)
    # handed on in place (donated): the barrier copies nothing
    assert [a.unsafe_buffer_pointer() for a in out] == buffers
    for got, want in zip(out, before):
        np.testing.assert_array_equal(kvx.to_numpy(got).view(np.uint8), want.view(np.uint8))
