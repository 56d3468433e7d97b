"""How a planned block copy becomes a custom call (`emit`, the one emitter): the FFI target
and its operands, the views of pools in another layout, the stream annotation, and the jitted
functions of eager calls."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp

from . import _layouts as layouts
from . import _native
from ._checks import dtype_bits, is_split
from ._jax_seams import function_form_compute_on, memory_space
from ._plan import CopyPlan


class _SideStreamDepth(threading.local):
    depth = 0  # > 0 while on_stream traces a function: its copies then take a nograph target


_ON_SIDE_STREAM = _SideStreamDepth()


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
    if plan.dma or _ON_SIDE_STREAM.depth:  # never inside a CUDA graph (_native)
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
    layout or single blocks (reshapes, free inside jit), on XLA stream `plan.stream` where it
    names one."""
    def copy(dst, src, si, di, n):
        shape = dst.shape
        if plan.one_block:
            dst, src = dst[None], src[None]
        if plan.axes is not None:
            dst = dst.reshape(layouts.Layout(dst.shape, *plan.axes).view)
            src = src.reshape(layouts.Layout(src.shape, *plan.axes).view)
        return block_copy_call(dst, dst if plan.within else src, si, di, n, plan).reshape(shape)

    if plan.stream is None:
        return copy(dst_pool, src_pool, src_idx, dst_idx, tokens)
    space = memory_space(dst_pool) or jax.memory.Space.Device
    return on_stream(copy, plan.stream, space)(dst_pool, src_pool, src_idx, dst_idx, tokens)


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


def on_stream(fn: Any, stream: int, out_space: Any) -> Any:
    """`fn` (traced inside jit) annotated to run on XLA GPU stream `stream`: XLA wraps it in an
    async start/done pair on a stream of its own, and the compute stream waits for it only
    where its result is used. `out_space`: the memory space of fn's result. Ignored on CPU.
    Copies traced inside take targets that XLA never records into a CUDA graph (a graph would
    replay them on the compute stream)."""
    annotate = function_form_compute_on()
    if annotate is None:
        raise NotImplementedError(f"stream=: jax {jax.__version__} has no function-form "
                                  "jax.experimental.compute_on")

    def traced_on_stream(*args: Any) -> Any:
        _ON_SIDE_STREAM.depth += 1  # copies traced here stay out of CUDA graphs
        try:
            return fn(*args)
        finally:
            _ON_SIDE_STREAM.depth -= 1

    return annotate(traced_on_stream, compute_type=f"gpu_stream:{stream}",
                    out_memory_spaces=out_space)
