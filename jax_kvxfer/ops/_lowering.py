"""How a planned block copy becomes a custom call: `CopyPlan`, what the call is told (the plan
`_plan.plan_copy` decides for `copy_blocks`, or the transfer manager's own), and `emit`, the one
emitter: the FFI target and its operands, the views of pools in another layout, and the jitted
functions of eager calls."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _layouts as layouts
from . import _native
from ._checks import UNKNOWN, IndexFacts, dtype_bits, is_split


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """One block copy as the custom call will do it (hashable: eager calls cache their jitted
    function by plan)."""

    facts: IndexFacts = UNKNOWN  # what known indices prove
    whole_blocks: bool = False  # every pair copies a whole block, as known on the host
    dma: bool = False  # the GPU's copy engines, not the copy kernel
    max_ctas: int | None = None  # the kernel's grid cap (None: no cap)
    within: bool = False  # source and destination are one array
    # pools in an engine's own layout: their (block_axis, token_axis); the copy takes their 6-D
    # views (_layouts.py), reshaped back after
    axes: tuple[int, int] | None = None
    one_block: bool = False  # the arrays are single blocks: the copy sees pools of one block

    def attributes(self) -> dict[str, Any]:
        """The custom call's attributes (ffi/block_copy.h, CopyOptions)."""
        return {"hazard_free": np.bool_(self.facts.hazard_free),
                "unique_dst": np.bool_(self.facts.unique_dst),
                "max_ctas": np.int64(min(self.max_ctas or 0, 1 << 30)),
                "dma": np.bool_(self.dma), "whole_blocks": np.bool_(self.whole_blocks)}


def copy_results(dst_pool, batch: int, staging_bytes: int = 0) -> tuple:
    """The result types of a block copy custom call: the destination pool (its memory space
    included: pinned_host stays there), then the workspaces XLA allocates as extra results
    (ffi/block_copy.h, CheckWorkspaces): an int32 per pair for the GPU's duplicate scan, and
    `staging_bytes` to stage source blocks in."""
    return (jax.typeof(dst_pool),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((staging_bytes,), jnp.uint8))


def block_copy_call(dst_pool, src_pool, src_idx, dst_idx, tokens, plan: CopyPlan):
    """The custom call of `plan` over 6-D pools; `src_pool is dst_pool` (one traced value)
    copies within a pool."""
    # Within one pool the pool is passed once: were it passed twice with one operand donated,
    # XLA would copy the whole pool to keep the other operand's read safe.
    within = src_pool is dst_pool
    batch = src_idx.shape[0]
    # Room to stage every source block when a copy within one pool may read a block that
    # another pair writes.
    block_nbytes = math.prod(dst_pool.shape[1:]) * dtype_bits(dst_pool.dtype) // 8
    staging = batch * block_nbytes if within and not plan.facts.hazard_free else 0
    if plan.dma:  # never inside a CUDA graph (_native)
        target = (_native.BLOCK_COPY_WITHIN_NOGRAPH_TARGET if within
                  else _native.BLOCK_COPY_NOGRAPH_TARGET)
    else:
        target = _native.BLOCK_COPY_WITHIN_TARGET if within else _native.BLOCK_COPY_TARGET
    call = jax.ffi.ffi_call(target, copy_results(dst_pool, batch, staging),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    pools = (dst_pool,) if within else (dst_pool, src_pool)
    return call(*pools, src_idx, dst_idx, tokens, **plan.attributes())[0]


def emit(plan: CopyPlan, dst_pool, src_pool, src_idx, dst_idx, tokens):
    """The copy `plan` describes, traced: over the pools' 6-D views where they are in another
    layout or single blocks (reshapes, free inside jit)."""
    shape = dst_pool.shape
    dst, src = (dst_pool[None], src_pool[None]) if plan.one_block else (dst_pool, src_pool)
    if plan.axes is not None:
        dst = dst.reshape(layouts.Layout(dst.shape, *plan.axes).view)
        src = src.reshape(layouts.Layout(src.shape, *plan.axes).view)
    return block_copy_call(dst, dst if plan.within else src, src_idx, dst_idx, tokens,
                           plan).reshape(shape)


@functools.lru_cache(maxsize=64)
def eager_copy(plan: CopyPlan, out_sharding: jax.sharding.Sharding, donate: bool = False):
    """The jitted program of a copy called outside jit: `emit` of `plan`, its result keeping
    the destination's sharding. A destination split over several devices is copied by each
    device on its own shard. Within one pool the array is passed twice and read once."""
    fn = functools.partial(emit, plan)
    if is_split(out_sharding):
        spec, whole = out_sharding.spec, jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, mesh=out_sharding.mesh, in_specs=(spec, spec) + (whole,) * 3,
                           out_specs=spec)
    return jax.jit(fn, out_shardings=out_sharding, donate_argnums=(0,) if donate else ())

