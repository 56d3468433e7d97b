"""A logical block (`KVCacheBlock`), and how pool arrays are made (`local_zeros`) and read
(`to_numpy`) without keeping them from being donated. `pool.py` holds the pools themselves."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..ops._checks import check_memory_space
from ._lanes import wait_lanes


@dataclasses.dataclass(frozen=True)
class KVCacheBlock:
    """A logical block: `memory_pool_block_index` indexes `primary` or `secondary` of every pool.

    TensorRT-LLM: `KVCacheBlock` + `computeBlockPointer` (the `is_primary` flag picks the pool).
    """

    block_id: int
    memory_pool_block_index: int
    is_primary: bool

    def __post_init__(self) -> None:
        for name in ("block_id", "memory_pool_block_index"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"KVCacheBlock.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.is_primary, (bool, np.bool_)):
            raise TypeError(f"KVCacheBlock.is_primary must be a bool, got {self.is_primary!r}")
        object.__setattr__(self, "is_primary", bool(self.is_primary))
        # The slot as one integer, so a batch of blocks is read into NumPy in one pass.
        object.__setattr__(self, "_slot_code", 2 * self.memory_pool_block_index + self.is_primary)

    @property
    def slot(self) -> tuple[int, bool]:
        """The memory slot this block occupies: `(memory_pool_block_index, is_primary)`."""
        return (self.memory_pool_block_index, self.is_primary)


def to_numpy(array: jax.Array, *, local: bool = False) -> Any:
    """A NumPy copy of a pool array that leaves the array donatable.

    `np.asarray` on a `pinned_host` array makes JAX keep a NumPy view of it (on GPUs), and a
    viewed array cannot be donated, so the next transfer into it would copy the whole pool.
    Reading through a fresh device copy avoids that. Waits for the transfers in flight.

    Args:
      array: a pool array (or any jax.Array).
      local: return this process's shards instead, as a list of `(index, ndarray)`, `index`
        the shard's tuple of slices into the whole array (one per distinct shard). An array
        that spans devices of other processes (`jax.distributed`) needs it.

    Raises:
      TypeError: `array` is not a jax.Array.
      ValueError: the array has been deleted (donated), or it spans devices of other
        processes and `local` is False.
    """
    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        raise TypeError(f"to_numpy: array must be a concrete jax.Array (a pool's primary or "
                        f"secondary array), got {type(array).__name__}")
    if array.is_deleted():
        raise ValueError(
            "to_numpy: the array has been deleted — it was donated to a jitted function or a "
            "transfer; read the pool's current array (pool.primary / pool.secondary) instead")
    if not local and not array.is_fully_addressable:
        raise ValueError(
            "to_numpy: the array spans devices of other processes, whose shards this process "
            "cannot read; to_numpy(array, local=True) returns this process's shards")
    # The transfer lanes write pools behind XLA's back (_lanes.py): wait for the copies that the
    # dispatches making `array` enqueued.
    jax.block_until_ready(array)
    wait_lanes()
    if local:
        shards = {}
        for shard in array.addressable_shards:
            key = tuple((s.start, s.stop, s.step) for s in shard.index)
            if key not in shards:
                shards[key] = (shard.index, _fresh_numpy(shard.data))
        return list(shards.values())
    return _fresh_numpy(array)


def _fresh_numpy(array: jax.Array) -> np.ndarray:
    fresh = jax.device_put(array, array.sharding.with_memory_kind("device"), may_alias=False)
    return np.array(fresh)  # writable, and no view of the fresh copy outlives this call


def local_zeros(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zero array in a fresh buffer (on CPU, `device_put` may keep a NumPy buffer as the
    array's own). Where the sharding spans other processes, made shard by shard on this
    process's devices: `jax.device_put` of one NumPy array there would first check, with a
    cross-process all-gather, that every process passed the same data."""
    if sharding.is_fully_addressable:
        return jax.device_put(np.zeros(shape, dtype), sharding)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        return np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype)
    array = jax.make_array_from_callback(shape, sharding, shard)
    check_memory_space("a pool array made from local shards", array)  # an error, not an abort
    return array
