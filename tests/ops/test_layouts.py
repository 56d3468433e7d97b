"""`copy_blocks` and `partial_block_copy` on the layouts engines keep their caches in
(`token_axis=`, `block_axis=`), against a NumPy reference on fresh random data: whole and
partial copies, skipped and repeated pairs, eager, donated and inside jit; and the errors of
a geometry that does not fit, with the pools unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kvxfer as kvx

# name: (shape with the block axis of size None, block_axis, token_axis)
LAYOUTS = {
    "trtllm 6-D": ((None, 3, 2, 2, 5, 8), 0, 4),
    "NHD": ((None, 5, 3, 8), 0, 1),
    "HND": ((None, 3, 5, 8), 0, 2),
    "K/V first": ((2, None, 5, 3, 8), 1, 2),
    "fused K/V heads": ((None, 5, 6, 8), 0, 1),
    "MLA": ((None, 5, 24), 0, 1),
    "odd sizes": ((None, 7, 3, 5), 0, 1),
}


def _shape(layout, num_blocks):
    return tuple(num_blocks if d is None else d for d in layout[0])


def _random(rng, shape, dtype):
    if np.dtype(dtype) == np.float32:
        return rng.standard_normal(shape).astype(np.float32)
    return rng.standard_normal(shape).astype(dtype)  # bf16 / fp8 through ml_dtypes


def reference(dst, src, src_idx, dst_idx, tokens, block_axis, token_axis):
    """Pair by pair, in order, reading the source as it was: the documented semantics."""
    out, snapshot = dst.copy(), src.copy()
    for s, d, n in zip(src_idx, dst_idx, tokens):
        if s < 0 or d < 0:
            continue
        t_len = dst.shape[token_axis]
        sl = [slice(None)] * dst.ndim
        if 0 < n < t_len:
            sl[token_axis] = slice(0, n)
        sl_d, sl_s = list(sl), list(sl)
        sl_d[block_axis], sl_s[block_axis] = d, s
        out[tuple(sl_d)] = snapshot[tuple(sl_s)]
    return out


def _pairs(rng, n_src, n_dst, batch, t_len):
    src_idx = rng.integers(-1, n_src, batch)
    dst_idx = rng.integers(-1, n_dst, batch)  # repeats: the later pair wins
    tokens = rng.integers(-1, t_len + 2, batch)  # whole (<= 0, >= T) and partial
    return src_idx, dst_idx, tokens


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_copy_blocks_in_a_layout_matches_the_reference(name, dtype):
    layout = LAYOUTS[name]
    block_axis, token_axis = layout[1], layout[2]
    rng = np.random.default_rng(abs(hash((name, np.dtype(dtype).name))) % 2**32)
    dst = _random(rng, _shape(layout, 6), dtype)
    src = _random(rng, _shape(layout, 9), dtype)
    si, di, nt = _pairs(rng, 9, 6, 12, dst.shape[token_axis])
    out = kvx.copy_blocks(jnp.asarray(dst), jnp.asarray(src), si, di, nt,
                          token_axis=token_axis, block_axis=block_axis)
    expected = reference(dst, src, si, di, nt, block_axis, token_axis)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("name", ["NHD", "K/V first"])
def test_inside_jit_with_traced_indices_and_donation(name):
    layout = LAYOUTS[name]
    block_axis, token_axis = layout[1], layout[2]
    rng = np.random.default_rng(3)
    dst = _random(rng, _shape(layout, 6), np.float32)
    src = _random(rng, _shape(layout, 6), np.float32)
    si, di, nt = _pairs(rng, 6, 6, 9, dst.shape[token_axis])
    si[0] = 6  # traced and out of range: skipped
    step = jax.jit(lambda d, s, a, b, n: kvx.copy_blocks(d, s, a, b, n, token_axis=token_axis,
                                                         block_axis=block_axis),
                   donate_argnums=0)
    out = step(jnp.asarray(dst), jnp.asarray(src), si, di, nt)
    si_ref = np.where(si >= 6, -1, si)
    np.testing.assert_array_equal(np.asarray(out),
                                  reference(dst, src, si_ref, di, nt, block_axis, token_axis))


def test_within_one_pool_and_donated_eager_calls():
    layout = LAYOUTS["HND"]
    rng = np.random.default_rng(4)
    pool = _random(rng, _shape(layout, 8), np.float32)
    si, di, nt = _pairs(rng, 8, 8, 10, pool.shape[2])
    arr = jnp.asarray(pool)
    out = kvx.copy_blocks(arr, arr, si, di, nt, token_axis=2)
    np.testing.assert_array_equal(np.asarray(out), reference(pool, pool, si, di, nt, 0, 2))
    other = _random(rng, _shape(layout, 8), np.float32)
    donated = jnp.asarray(pool)
    out = kvx.copy_blocks(donated, jnp.asarray(other), si, di, nt, token_axis=2, donate=True)
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(out), reference(pool, other, si, di, nt, 0, 2))


def test_host_and_device_pools_in_a_layout():
    rng = np.random.default_rng(5)
    layout = LAYOUTS["NHD"]
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    primary = _random(rng, _shape(layout, 5), np.float32)
    secondary = _random(rng, _shape(layout, 7), np.float32)
    si, di, nt = _pairs(rng, 5, 7, 8, primary.shape[1])
    out = kvx.copy_blocks(jax.device_put(secondary, host), jnp.asarray(primary), si, di, nt,
                          token_axis=1)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), reference(secondary, primary, si, di, nt, 0, 1))


@pytest.mark.parametrize("token_axis, shape", [(0, (5, 3, 8)), (1, (3, 5, 8)), (-1, (4, 6))])
def test_partial_block_copy_along_a_token_axis(token_axis, shape):
    rng = np.random.default_rng(6)
    dst, src = _random(rng, shape, np.float32), _random(rng, shape, np.float32)
    n = 2
    out = kvx.partial_block_copy(jnp.asarray(dst), jnp.asarray(src), n, token_axis=token_axis)
    expected = dst.copy()
    sl = [slice(None)] * dst.ndim
    sl[token_axis] = slice(0, n)
    expected[tuple(sl)] = src[tuple(sl)]
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"token_axis": 4}, ValueError, "token_axis=4 is out of range"),
    ({"token_axis": 0}, ValueError, "must come after block_axis"),
    ({"token_axis": 2, "block_axis": 3}, ValueError, "must come after block_axis"),
    ({"token_axis": 1.0}, TypeError, "token_axis must be an int"),
    ({"token_axis": True}, TypeError, "token_axis must be an int"),
    ({"block_axis": 1}, TypeError, "block_axis needs token_axis"),
])
def test_a_geometry_that_does_not_fit_names_the_axis(kwargs, error, message):
    rng = np.random.default_rng(7)
    dst = jnp.asarray(_random(rng, (4, 5, 3, 8), np.float32))
    before = np.asarray(dst).copy()
    with pytest.raises(error, match=message):
        kvx.copy_blocks(dst, dst, [0], [1], **kwargs)
    np.testing.assert_array_equal(np.asarray(dst), before)


def test_a_donated_pool_is_named():
    dst = jnp.zeros((4, 5, 3, 8), jnp.float32)
    src = jnp.zeros((4, 5, 3, 8), jnp.float32)
    kvx.copy_blocks(dst, src, [0], [1], token_axis=1, donate=True)  # consumes dst
    with pytest.raises(ValueError, match="dst_pool has been deleted"):
        kvx.copy_blocks(dst, src, [0], [1], token_axis=1)
    with pytest.raises(TypeError, match="dst_pool must be a jax.Array"):
        kvx.copy_blocks(np.zeros((4, 5, 3, 8), np.float32), src, [0], [1], token_axis=1)


def test_mismatched_pools_and_indices_raise_clear_errors():
    rng = np.random.default_rng(8)
    dst = jnp.asarray(_random(rng, (4, 5, 3, 8), np.float32))
    before = np.asarray(dst).copy()
    cases = [
        (jnp.zeros((4, 5, 2, 8), jnp.float32), [0], [0], ValueError, "except along block_axis"),
        (jnp.zeros((4, 5, 3, 8), jnp.bfloat16), [0], [0], TypeError, "dtype"),
        (jnp.zeros((6, 5, 3, 8), jnp.float32), [6], [0], IndexError, "src_indices"),
        (jnp.zeros((6, 5, 3, 8), jnp.float32), [0], [4], IndexError, "dst_indices"),
        (jnp.zeros((6, 5, 3, 8), jnp.float32), [0, 1], [0], ValueError, "length"),
    ]
    for src, si, di, error, message in cases:
        with pytest.raises(error, match=message):
            kvx.copy_blocks(dst, src, si, di, token_axis=1)
    np.testing.assert_array_equal(np.asarray(dst), before)
