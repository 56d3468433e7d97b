"""Block pools: a primary pool in GPU (`device`) memory and a secondary pool in `pinned_host`
memory. `KVCacheBlock` and `to_numpy` (block.py) are part of its API too."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops._checks import check_byte_rows, check_memory_space, dtype_bits
from ..ops._jax_seams import host_byte_views
from ._layers import check_layers, layer_views
from ._storage import LayerArrays, PoolArrays, PoolStorage
from .block import KVCacheBlock, local_zeros, to_numpy
from .limits import check_fits

__all__ = ["KVCacheBlock", "KVCacheBlockPool", "to_numpy"]


def _process_devices(mesh: jax.sharding.Mesh) -> list[jax.Device]:
    """The mesh's devices that belong to this process."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _check_positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class KVCacheBlockPool:
    """One KV-cache pool: `primary` on the GPU, `secondary` in pinned host memory (or None).

    TensorRT-LLM: `KVCacheBlockPool` (`primaryPtr`, `secondaryPtr`). Both are
    `[num_blocks, num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head]`.

    The pool is a mutable holder: transfers replace `primary` / `secondary` with new arrays
    (the old ones are donated), and user code may assign an array of the same shape, dtype and
    memory kind to either, e.g. the output of an attention step that wrote new tokens.
    """

    def __init__(self, storage: PoolStorage, *, num_layers: int, tokens_per_block: int,
                 dtype: Any, num_primary_blocks: int, num_secondary_blocks: int,
                 device: jax.Device, mesh: jax.sharding.Mesh | None = None,
                 kv_head_axis: str | None = None) -> None:
        """A pool of `storage` without its arrays; use `KVCacheBlockPool.create` or
        `KVCacheBlockPool.from_layers`, which check their arguments and allocate."""
        self.storage = storage  # how the blocks are held (_storage.py)
        self.num_layers = num_layers
        self.tokens_per_block = tokens_per_block
        self.num_primary_blocks = num_primary_blocks
        self.num_secondary_blocks = num_secondary_blocks
        self.dtype = jnp.dtype(dtype)
        self.mesh, self.kv_head_axis, self.device = mesh, kv_head_axis, device
        self._primary: Any = None
        self._secondary: jax.Array | None = None
        self._lane_joins: dict[str, Any] = {}  # see hold_for_lanes

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, size_per_head: int,
               tokens_per_block: int, dtype: Any, num_primary_blocks: int,
               num_secondary_blocks: int, kv_factor: int = 2,
               device: jax.Device | None = None, mesh: jax.sharding.Mesh | None = None,
               kv_head_axis: str | None = None) -> KVCacheBlockPool:
        """Allocates a zero-filled pool.

        Args:
          num_layers, num_kv_heads, size_per_head, tokens_per_block: the block geometry.
          dtype: element type (any JAX dtype; 4-bit types need whole-byte blocks).
          num_primary_blocks: blocks in `device` memory (>= 1).
          num_secondary_blocks: blocks in `pinned_host` memory (0: no secondary pool).
          kv_factor: 2 for K and V, 1 for K-only (MLA) caches.
          device: the device (default: the first one).
          mesh, kv_head_axis: shard both pools along the KV-head dimension over this mesh axis
            (tensor parallelism): each device holds its heads in its own `device` and
            `pinned_host` memory, and every copy stays on the device that holds the shard.

        Raises:
          ValueError, TypeError: a bad geometry or dtype, named in the message.
          MemoryError: the pool does not fit the device or the pinned-host limit.
        """
        num_layers = _check_positive("num_layers", num_layers)
        kv_factor = _check_positive("kv_factor", kv_factor)
        if kv_factor not in (1, 2):
            raise ValueError(f"kv_factor must be 1 (K only / MLA) or 2 (K and V), got {kv_factor}")
        num_kv_heads = _check_positive("num_kv_heads", num_kv_heads)
        tokens_per_block = _check_positive("tokens_per_block", tokens_per_block)
        size_per_head = _check_positive("size_per_head", size_per_head)
        num_primary_blocks = _check_positive("num_primary_blocks", num_primary_blocks)
        num_secondary_blocks = _check_positive("num_secondary_blocks", num_secondary_blocks, 0)
        try:
            dtype = jnp.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"dtype must be a JAX dtype, got {dtype!r}") from e
        dtype_bits(dtype)
        block_shape = (num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head)
        check_byte_rows(block_shape, dtype, partial_possible=False)
        if device is not None and not isinstance(device, jax.Device):
            raise TypeError(f"device must be a jax.Device (for example jax.devices()[0]), "
                            f"got {device!r}")
        if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        spec = None
        if mesh is not None:
            if device is not None:
                raise ValueError("give device or mesh, not both")
            if kv_head_axis not in mesh.axis_names:
                raise ValueError(f"kv_head_axis must name an axis of the mesh "
                                 f"{tuple(mesh.axis_names)}, got {kv_head_axis!r}")
            shards = mesh.shape[kv_head_axis]
            if num_kv_heads % shards:
                raise ValueError(f"num_kv_heads ({num_kv_heads}) must be divisible by the "
                                 f"{shards} devices of mesh axis {kv_head_axis!r}")
            local = _process_devices(mesh)
            if not local:
                raise ValueError(f"mesh has no device of this process (process "
                                 f"{jax.process_index()}); every process must hold a part "
                                 "of the pool")
            device = local[0]  # this process's first device: where its own checks look
            spec = jax.sharding.PartitionSpec(None, None, None, kv_head_axis, None, None)
        elif kv_head_axis is not None:
            raise ValueError("kv_head_axis needs a mesh")
        pool = cls(PoolArrays(block_shape, spec), num_layers=num_layers,
                   tokens_per_block=tokens_per_block, dtype=dtype,
                   num_primary_blocks=num_primary_blocks,
                   num_secondary_blocks=num_secondary_blocks,
                   device=device if device is not None else jax.devices()[0], mesh=mesh,
                   kv_head_axis=kv_head_axis)
        pool.kv_factor, pool.num_kv_heads, pool.size_per_head = kv_factor, num_kv_heads, size_per_head
        pool._primary = pool._allocate(pool.num_primary_blocks, "device")
        pool._allocate_secondary()
        return pool

    @classmethod
    def from_layers(cls, arrays: Any, *, token_axis: int, block_axis: int = 0,
                    num_secondary_blocks: int) -> KVCacheBlockPool:
        """A pool over an engine's own per-layer arrays, which it uses as they are (no copy).

        `primary` is then the list of those arrays, readable and donatable by the engine's own
        step, and assignable (a list of arrays of the same shapes); `secondary` one
        `pinned_host` array `[num_secondary_blocks, row]` whose row holds one block of every
        array, in order (K/V-first arrays slab by slab), so that a block offloads into one
        contiguous row. Every array moves in one custom call per batch.

        Args:
          arrays: device arrays on one device (or split by heads: along one axis after
            `block_axis` other than `token_axis`, by one mesh axis, the same for all; the host
            array is then `[num_secondary_blocks, devices, part]`, one part per device), one
            per layer (or per layer and K/V), of one dtype of whole bytes, each with its blocks
            along `block_axis` (all the same number) and its tokens along `token_axis` (all the
            same number): NHD `[nb, T, H, D]`: token_axis=1; HND `[nb, H, T, D]`: 2; K/V
            first `[2, nb, T, H, D]`: block_axis=1, token_axis=2; fused `[nb, T, 2H, D]`: 1;
            MLA `[nb, T, D]`: 1.
          token_axis, block_axis: as for `copy_blocks`.
          num_secondary_blocks: rows of the host array (0: none).

        Raises:
          TypeError, ValueError: arrays that are not such arrays, or that disagree, named in
            the message.
          MemoryError: the host array does not fit the pinned-host limit.
        """
        views = layer_views(arrays, token_axis, block_axis)
        arrays = check_layers("arrays", arrays, arrays)
        for i, a in enumerate(arrays):
            check_memory_space(f"arrays[{i}]", a)
            if not a.sharding.is_equivalent_to(arrays[0].sharding, a.ndim) and \
                    views.specs is None:
                raise ValueError(f"arrays[{i}] lives on {a.sharding}, expected arrays[0]'s "
                                 f"{arrays[0].sharding}")
        num_blocks = _check_positive("the arrays' number of blocks", views.num_blocks)
        num_secondary_blocks = _check_positive("num_secondary_blocks", num_secondary_blocks, 0)
        if views.specs is None:
            mesh, axis, device, devices = None, None, next(iter(arrays[0].devices())), 1
        else:
            mesh, axis = arrays[0].sharding.mesh, views.host_spec[1]
            device, devices = _process_devices(mesh)[0], mesh.shape[axis]
        pool = cls(LayerArrays(views, devices), num_layers=len(arrays),
                   tokens_per_block=views.tokens_per_block, dtype=arrays[0].dtype,
                   num_primary_blocks=num_blocks, num_secondary_blocks=num_secondary_blocks,
                   device=device, mesh=mesh, kv_head_axis=axis)
        pool._primary = list(arrays)
        pool._allocate_secondary()
        return pool

    @property
    def block_shape(self) -> tuple[int, ...]:
        """`(num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head)`; for a pool
        over an engine's arrays, `(row,)`: the elements of a host row."""
        return self.storage.block_shape

    @property
    def partition_spec(self) -> jax.sharding.PartitionSpec | None:
        """How a pool array is split over the mesh (KV heads, dimension 3; for a pool over an
        engine's arrays, the host array's), None if unsharded."""
        return self.storage.spec

    def sharding(self, memory_kind: str) -> jax.sharding.Sharding:
        """The sharding of the primary (`device`) or secondary (`pinned_host`) array."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device, memory_kind=memory_kind)
        return jax.sharding.NamedSharding(self.mesh, self.partition_spec, memory_kind=memory_kind)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block as the copy kernels see it (4-bit types packed two per byte)."""
        return math.prod(self.block_shape) * dtype_bits(self.dtype) // 8

    def token_run_nbytes(self, num_tokens: int) -> int:
        """Bytes a copy of the first `num_tokens` tokens moves (whole block when out of (0, T))."""
        if num_tokens <= 0 or num_tokens >= self.tokens_per_block:
            return self.block_nbytes
        return self.block_nbytes // self.tokens_per_block * num_tokens

    @property
    def host_row_layout(self) -> tuple:
        """What a host row (one block of the secondary array) holds, as a hashable, repr-stable
        description: the stores keep blocks under it, so that a row is read back only into a
        pool that lays it out the same way."""
        return (self.block_shape, self.dtype.name, self.block_nbytes, self.storage.host_row_parts)

    def host_rows(self) -> np.ndarray:
        """The secondary array's rows as a writable byte view `[num_secondary_blocks,
        block_nbytes]` of its pinned host buffer, which the stores read and write in place.

        The view stays valid while transfers replace the array, since they update it in place
        (not after a transfer that copied the pool with a `DonationWarning`: take the view
        anew after each batch of transfers, as the block manager does). Write into a row only
        while no transfer touches it (`manager.fence()`), and never into a row a transfer may
        still read.

        Raises:
          ValueError: the pool has no secondary blocks, or is split over several devices.
        """
        array = self.current(False, "host_rows")
        views = host_byte_views(array)
        if len(views) != 1:
            raise ValueError(f"host_rows: the pool is split over {len(views)} devices; the "
                             "stores take pools on one device")
        if views[0].nbytes != self.num_secondary_blocks * self.block_nbytes:
            raise ValueError(f"host_rows: the host buffer holds {views[0].nbytes} bytes, not "
                             f"{self.num_secondary_blocks} rows of {self.block_nbytes}")
        return views[0].reshape(self.num_secondary_blocks, self.block_nbytes)

    def check_partial(self) -> None:
        """Raises where a partial copy cannot be made (rows that are not whole bytes)."""
        self.storage.check_partial(self.dtype)

    def _allocate_secondary(self) -> None:
        if self.num_secondary_blocks:
            self._secondary = self._allocate(self.num_secondary_blocks, "pinned_host")

    def _allocate(self, num_blocks: int, memory_kind: str) -> jax.Array:
        shape = (num_blocks, *self.block_shape)
        shards = 1 if self.mesh is None else self.mesh.shape[self.kv_head_axis]
        shard_bytes = num_blocks * self.block_nbytes // shards
        what = (f"{'primary' if memory_kind == 'device' else 'secondary'} pool {shape}"
                + (f" ({shards} shards)" if shards > 1 else ""))
        devices = self.local_devices
        if memory_kind == "device":  # each device of this process holds its own shard
            for device in devices:
                check_fits(device, memory_kind, shard_bytes, what)
        else:  # the pinned-host limit is the process's, for all its shards
            check_fits(devices[0], memory_kind, shard_bytes * len(devices), what)
        sharding = self.sharding(memory_kind)
        if memory_kind == "device":
            return jnp.zeros(shape, self.dtype, device=sharding)
        # Not jax.jit(..., out_shardings=pinned_host): with jax 0.10 such an array's type still
        # says device memory, and the next jit given it aborts the process.
        return local_zeros(shape, self.dtype, sharding)

    @property
    def local_devices(self) -> list[jax.Device]:
        """The devices of this process that hold a part of the pool."""
        return [self.device] if self.mesh is None else _process_devices(self.mesh)

    @property
    def primary(self) -> Any:
        """The current primary pool (memory kind `device`); for a pool over an engine's arrays,
        the list of them. While onboards into it are in flight on the transfer lanes, reading
        it first orders XLA's later work on it after them (see `hold_for_lanes`)."""
        self._settle("primary")
        return self.storage.as_held(self._primary)

    @primary.setter
    def primary(self, value: Any) -> None:
        value = self.storage.checked_primary(self, value)
        self._settle("primary")
        self._primary = value

    @property
    def secondary(self) -> jax.Array | None:
        """The current secondary pool (memory kind `pinned_host`), None with 0 blocks; read
        or assigned while transfers are in flight, as `primary`."""
        self._settle("secondary")
        return self._secondary

    @secondary.setter
    def secondary(self, value: jax.Array) -> None:
        if self.num_secondary_blocks == 0:
            raise ValueError("secondary: this pool has 0 secondary blocks; nothing can be assigned")
        value = self.checked_array("secondary", value, self.num_secondary_blocks, "pinned_host")
        self._settle("secondary")
        self._secondary = value

    def checked_array(self, name: str, value: Any, num_blocks: int,
                      memory_kind: str) -> jax.Array:
        """`value`, checked as the pool's new `name` array (shape, dtype, memory, sharding)."""
        if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
            raise TypeError(f"pool.{name} must be a concrete jax.Array, got {type(value).__name__}")
        expected = (num_blocks, *self.block_shape)
        if tuple(value.shape) != expected or value.dtype != self.dtype:
            raise ValueError(f"pool.{name} must be {self.dtype}{list(expected)}, "
                             f"got {value.dtype}{list(value.shape)}")
        if value.is_deleted():
            raise ValueError(f"pool.{name}: the array has been deleted (donated?)")
        kind = value.sharding.memory_kind or "device"
        if kind != memory_kind:
            raise ValueError(f"pool.{name} must live in memory kind {memory_kind!r}, got {kind!r}")
        if not value.sharding.is_equivalent_to(self.sharding(memory_kind), value.ndim):
            raise ValueError(f"pool.{name} must have the pool's sharding "
                             f"{self.sharding(memory_kind)}, got {value.sharding}")
        check_memory_space(f"pool.{name}", value)
        return value

    def take_copy_result(self, is_primary: bool, array: jax.Array) -> None:
        """Called by the manager with what its copy of this pool's primary or secondary array
        returned (the same buffers, updated in place, or a copy of the pool): made by the
        library from the current array, so it needs none of the assignment's checks, which
        cost a few microseconds a dispatch."""
        if is_primary:
            self._primary = self.storage.as_held(array)
        else:
            self._secondary = array

    def hold_for_lanes(self, names: tuple[str, ...], join: Any) -> None:
        """Called by the manager as it enqueues lane copies that use these arrays ("primary",
        "secondary") on a GPU, behind XLA's back. Until `release_lanes`, reading or assigning
        them first calls `join(name)`: XLA's stream then waits for those copies before anything
        dispatched later, so what user code computes from the array holds what they wrote, and
        an array it replaces outlives them. The CPU needs none of this (a lane copy is done
        when its call is), so a program behaves the same on both."""
        for name in names:
            self._lane_joins[name] = join

    def release_lanes(self, names: tuple[str, ...]) -> None:
        """Called by the manager once no lane copy uses these arrays any more."""
        for name in names:
            self._lane_joins.pop(name, None)

    def _settle(self, name: str) -> None:
        join = self._lane_joins.get(name)
        if join is not None:
            join(name)

    def stored(self, is_primary: bool) -> Any:
        """The primary or secondary array as held (for a pool over an engine's arrays, the list
        itself), without joining the lanes: for the manager, which orders its own copies."""
        return self._primary if is_primary else self._secondary

    def current(self, is_primary: bool, what: str) -> jax.Array:
        """The live primary or secondary array, with a clear error if it was deleted or absent."""
        array = self._primary if is_primary else self._secondary
        name = "primary" if is_primary else "secondary"
        if array is None:
            raise ValueError(f"{what}: the pool has no {name} blocks")
        if isinstance(array, list):  # an engine's arrays (from_layers)
            if any(a.is_deleted() for a in array):
                raise ValueError(
                    f"{what}: an array of pool.{name} has been deleted — it was donated to a "
                    f"jitted function; assign the function's results back to pool.{name}")
            return list(array)
        if array.is_deleted():
            raise ValueError(
                f"{what}: pool.{name} has been deleted — it was donated to a jitted function; "
                f"assign the function's result back to pool.{name}"
            )
        return array

    def __repr__(self) -> str:
        return self.storage.describe(self)
