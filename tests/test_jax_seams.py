"""Canaries for what the library relies on in JAX beyond its documented behaviour
(`jax_kvxfer/ops/_jax_seams.py`): each fails loudly when a JAX version changes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu

import jax_kvxfer as kvx
from jax_kvxfer.ops import _jax_seams as seams


def _sharding(memory_kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)


def test_a_host_buffer_view_writes_what_the_next_computation_reads():
    rng = np.random.default_rng(0)
    array = jax.block_until_ready(jax.device_put(np.zeros(64, np.int32), _sharding("pinned_host")))
    values = rng.integers(-2**31, 2**31 - 1, 64, dtype=np.int64).astype(np.int32)
    (view,) = seams.host_byte_views(array)
    view.view(np.int32)[:] = values
    moved = jax.device_put(array, _sharding("device"))  # a computation that reads the buffer
    np.testing.assert_array_equal(np.asarray(moved), values)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.uint8])
def test_a_host_buffer_view_holds_the_rows_in_order_without_padding(dtype):
    """What a copy into a pinned_host array wrote is what the byte view shows, row by row:
    the stores read and write a pool's host rows through it."""
    rng = np.random.default_rng(1)
    values = rng.integers(0, 100, (6, 5, 3)).astype(dtype)
    array = jax.block_until_ready(jax.device_put(values, _sharding("pinned_host")))
    (view,) = seams.host_byte_views(array)
    assert view.nbytes == values.nbytes
    np.testing.assert_array_equal(view, np.frombuffer(values.tobytes(), np.uint8))
    row = values.nbytes // 6
    view[2 * row:3 * row] = np.frombuffer(values[5].tobytes(), np.uint8)  # row 2 := row 5
    moved = np.asarray(jax.device_put(array, _sharding("device")))
    expected = values.copy()
    expected[2] = values[5]
    np.testing.assert_array_equal(moved, expected)


@pytest.mark.parametrize("kind, space", [("device", "Device"), ("pinned_host", "Host")])
def test_the_memory_space_is_in_the_type_inside_and_outside_jit(kind, space):
    array = jax.device_put(np.arange(4.0, dtype=np.float32), _sharding(kind))
    assert seams.memory_space(array) == getattr(jax.memory.Space, space)
    seen = []
    jax.jit(lambda a: seen.append(seams.memory_space(a)) or a)(array)
    assert seen == [getattr(jax.memory.Space, space)]
    assert seams.memory_space(np.zeros(2)) is None


@requires_gpu
def test_donating_a_buffer_that_numpy_views_fails_with_the_text_we_match():
    rng = np.random.default_rng(1)
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=8,
                                       tokens_per_block=4, dtype="float32", num_primary_blocks=2,
                                       num_secondary_blocks=2)
    pool.primary = jax.device_put(rng.standard_normal(pool.primary.shape, np.float32),
                                  pool.primary.sharding)
    view = np.asarray(pool.secondary)  # on a GPU, a view of the pinned host buffer
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as caught:
        kvx.copy_blocks(pool.secondary, pool.primary, [0], [1], donate=True, dma=False)
    assert seams.pinned_by_external_reference(caught.value), str(caught.value)
    del view


def test_other_errors_are_not_taken_for_a_pinned_buffer():
    assert not seams.pinned_by_external_reference(ValueError("shapes do not match"))
    assert not seams.pinned_by_external_reference(KeyError("external reference"))
