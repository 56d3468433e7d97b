"""How a pool holds its blocks, as a strategy the pool and the manager's engines call without
asking which one they hold:

- `PoolArrays`: one contiguous array per memory, `[num_blocks, num_layers, kv_factor,
  num_kv_heads, tokens_per_block, size_per_head]` (`KVCacheBlockPool.create`), split by heads
  over a mesh or on one device;
- `LayerArrays`: an engine's own per-layer arrays on the GPU, as they are, and host rows that
  hold a block of every layer (`KVCacheBlockPool.from_layers`, `_layers.py`).

Each owns its geometry (the shape of a block as the arrays hold it, the split), its checks (of
an array assigned to the pool, of a partial copy), the layout of a host row (which the stores
keep blocks under) and the manager's copy calls, traced inside the engines' jitted dispatches.
Both are frozen and hashable: the dispatches take them as static arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from ..ops._checks import check_byte_rows
from ..ops._lowering import CopyPlan, block_copy_call
from ._lanes import lane_copy_call
from ._layers import (
    LayerViews,
    check_layers,
    layer_lane_copy_call,
    manager_copy,
    manager_copy_within,
)


def _on_shards(fn: Any, mesh: Any, spec: Any, num_pools: int) -> Any:
    """`fn` of `num_pools` pool arrays and a replicated plan, per device shard where split."""
    if spec is None:
        return fn
    whole = jax.sharding.PartitionSpec()
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_pools + (whole,), out_specs=spec)


@dataclasses.dataclass(frozen=True)
class PoolArrays:
    """A pool of one contiguous array per memory."""

    block_shape: tuple[int, ...]  # (num_layers, kv_factor, num_kv_heads, tokens, size_per_head)
    spec: jax.sharding.PartitionSpec | None = None  # both arrays' split over the mesh

    @property
    def host_row_parts(self) -> None:
        return None  # a host row is one block of the array, as the block shape says

    def check_partial(self, dtype: Any) -> None:
        check_byte_rows(self.block_shape, dtype, partial_possible=True)

    def as_held(self, primary: Any) -> Any:
        return primary

    def checked_primary(self, pool: Any, value: Any) -> Any:
        return pool.checked_array("primary", value, pool.num_primary_blocks, "device")

    def describe(self, pool: Any) -> str:
        place = (f"mesh={dict(pool.mesh.shape)}, kv_head_axis={pool.kv_head_axis!r}"
                 if pool.mesh is not None else f"device={pool.device}")
        return (f"KVCacheBlockPool(block_shape={self.block_shape}, dtype={pool.dtype.name}, "
                f"num_primary_blocks={pool.num_primary_blocks}, "
                f"num_secondary_blocks={pool.num_secondary_blocks}, {place})")

    # -- the manager's copies (traced) -----------------------------------------------------

    def copy(self, dst: Any, src: Any, plan: Any, facts: Any, whole: bool, mesh: Any) -> Any:
        """In line on XLA's stream, between the two arrays; `plan` is `[3, B]`."""
        def copy(d, s, p):
            return block_copy_call(d, s, p[0], p[1], p[2], CopyPlan(facts, whole_blocks=whole))
        return _on_shards(copy, mesh, self.spec, 2)(dst, src, plan)

    def copy_within(self, pool: Any, plan: Any, facts: Any, whole: bool, mesh: Any) -> Any:
        def copy(a, p):
            return block_copy_call(a, a, p[0], p[1], p[2], CopyPlan(facts, whole_blocks=whole))
        return _on_shards(copy, mesh, self.spec, 1)(pool, plan)

    def lane_copy(self, dst: Any, src: Any, plan: Any, **lanes: Any) -> Any:
        """On a transfer lane; within the array when `dst is src` (one traced value)."""
        return lane_copy_call(dst, src, plan[0], plan[1], plan[2], **lanes)


@dataclasses.dataclass(frozen=True)
class LayerArrays:
    """A pool over an engine's per-layer arrays (the GPU side, a list) and host rows."""

    views: LayerViews
    devices: int = 1  # devices the arrays are split over (one row part each)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A host row's elements: `(row,)`, or `(devices, row)` where split (a part each)."""
        row = self.views.row_nbytes // self.views.itemsize
        return (row,) if self.devices == 1 else (self.devices, row)

    @property
    def spec(self) -> jax.sharding.PartitionSpec | None:
        return self.views.host_spec  # the host array's

    @property
    def host_row_parts(self) -> tuple:
        return tuple((lay.shape, lay.token_axis, lay.block_axis) for lay in self.views.layouts)

    def check_partial(self, dtype: Any) -> None:
        pass  # whole bytes: checked when the pool was made

    def as_held(self, primary: Any) -> Any:
        return list(primary)  # the pool's list stays its own

    def checked_primary(self, pool: Any, value: Any) -> Any:
        return list(check_layers("pool.primary", value, pool.stored(True)))

    def describe(self, pool: Any) -> str:
        return (f"KVCacheBlockPool.from_layers({len(self.views.layouts)} arrays, "
                f"dtype={pool.dtype.name}, num_primary_blocks={pool.num_primary_blocks}, "
                f"num_secondary_blocks={pool.num_secondary_blocks}, device={pool.device})")

    # -- the manager's copies (traced) -----------------------------------------------------

    def copy(self, dst: Any, src: Any, plan: Any, facts: Any, whole: bool, mesh: Any) -> Any:
        """Between the arrays (a list) and the host rows, either way."""
        return manager_copy(dst, src, plan, views=self.views, mesh=mesh,
                            unique_dst=facts.unique_dst, dma=False, whole=whole)

    def copy_within(self, pool: Any, plan: Any, facts: Any, whole: bool, mesh: Any) -> Any:
        return manager_copy_within(pool, plan, facts, views=self.views, mesh=mesh, whole=whole)

    def lane_copy(self, dst: Any, src: Any, plan: Any, **lanes: Any) -> Any:
        if dst is src:  # each array within itself, in its own layout
            return manager_copy_within(dst, plan, None, views=self.views, mesh=None,
                                       whole=lanes["whole_blocks"],
                                       copy=functools.partial(_lane_within_view, **lanes))
        offload = not isinstance(dst, list)
        host, arrays = (dst, src) if offload else (src, dst)
        return layer_lane_copy_call(host, arrays, plan[0], plan[1], plan[2], offload=offload,
                                    views=self.views, **lanes)


def _lane_within_view(view: Any, src_idx: Any, dst_idx: Any, tokens: Any, facts: Any,
                      **lanes: Any) -> Any:
    return lane_copy_call(view, view, src_idx, dst_idx, tokens, **lanes)


PoolStorage = PoolArrays | LayerArrays
