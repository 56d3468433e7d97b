"""How a block copy becomes a custom call: the FFI target and its operands, the copy-engine
policy of `dma="auto"`, the stream annotation, and the jitted functions of eager calls."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _native
from ._checks import IndexFacts, dtype_bits, is_split
from ._jax_seams import function_form_compute_on

# CTAs (of 1024 threads) that a copy to or from pinned_host memory on a stream of its own uses
# by default: on an H200, 8 fill PCIe in either direction for whole blocks, and the other SMs
# stay free for the work running beside the copy. Without a stream of its own the copy takes
# every SM it can use (the fastest for short partial runs, which need many requests in flight).
HOST_COPY_CTAS = 8


# dma="auto" (`copy_blocks` outside jit) takes the copy engines for whole blocks of at least this
# many bytes between the two memories. Measured on the H200, one call at a time: the copy
# engines are ahead from 256 KiB (90/91 % of the memcpy ceiling against the kernel's 86/83 %;
# at 4 MiB 96/96 % against 92/89 %) and behind at 16-64 KiB, where the runtime's host time per
# copy (0.5-0.8 us) costs more than the copy moves; a partial block is one strided copy each,
# slower than the kernel at every size measured.
DMA_AUTO_MIN_BLOCK_BYTES = 256 * 1024


def auto_dma(dst_pool: jax.Array, src_pool: jax.Array, whole: bool, max_ctas: Any) -> bool:
    """dma="auto" outside jit: whether the copy engines take this copy (see `copy_blocks`)."""
    if not whole or max_ctas is not None or dst_pool.shape[0] == 0:
        return False
    kinds = {dst_pool.sharding.memory_kind, src_pool.sharding.memory_kind}
    block_bits = math.prod(dst_pool.shape[1:]) * dtype_bits(dst_pool.dtype)
    return (kinds == {"device", "pinned_host"}
            and not (is_split(dst_pool.sharding) or is_split(src_pool.sharding))
            and all(d.platform in ("gpu", "cuda") for d in dst_pool.devices())
            and block_bits >= 8 * DMA_AUTO_MIN_BLOCK_BYTES)


def put_in_pinned_host(arrays: tuple[Any, ...], like: jax.Array) -> tuple[jax.Array, ...]:
    """The index vectors in pinned_host memory of `like`'s device, their values in place
    before the copy is dispatched (the GPU handler reads them on the host as it enqueues)."""
    sharding = jax.sharding.SingleDeviceSharding(next(iter(like.devices())),
                                                 memory_kind="pinned_host")
    return jax.block_until_ready(tuple(
        jax.device_put(np.asarray(a, np.int32) if not isinstance(a, jax.Array) else a, sharding)
        for a in arrays))


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


def block_copy_call(dst_pool, src_pool, src_idx, dst_idx, tokens, facts: IndexFacts,
                    max_ctas: int | None = None, dma: bool = False, whole_blocks: bool = False):
    """Emits the custom call; `src_pool is dst_pool` (one traced value) copies within a pool.

    max_ctas: the GPU grid cap (None: no cap; above 2**30, which no GPU can run at once, the
    same as 2**30). dma: use the GPU's copy engines where the handler can (see `copy_blocks`).
    whole_blocks: every pair copies a whole block, as known on the host: the copy engines then
    need not read `tokens`, and the kernel gives each pair the work units of a whole block."""
    max_ctas = min(max_ctas or 0, 1 << 30)
    # Within one pool the pool is passed once: were it passed twice with one operand donated,
    # XLA would copy the whole pool to keep the other operand's read safe.
    within = src_pool is dst_pool
    batch = src_idx.shape[0]
    # Room to stage every source block when a copy within one pool may read a block that
    # another pair writes.
    block_nbytes = math.prod(dst_pool.shape[1:]) * dtype_bits(dst_pool.dtype) // 8
    staging = batch * block_nbytes if within and not facts.hazard_free else 0
    if dma or _ON_SIDE_STREAM.depth:  # never inside a CUDA graph (_native)
        target = (_native.BLOCK_COPY_WITHIN_NOGRAPH_TARGET if within
                  else _native.BLOCK_COPY_NOGRAPH_TARGET)
    else:
        target = _native.BLOCK_COPY_WITHIN_TARGET if within else _native.BLOCK_COPY_TARGET
    call = jax.ffi.ffi_call(target, copy_results(dst_pool, batch, staging),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    pools = (dst_pool,) if within else (dst_pool, src_pool)
    return call(*pools, src_idx, dst_idx, tokens, hazard_free=np.bool_(facts.hazard_free),
                unique_dst=np.bool_(facts.unique_dst), max_ctas=np.int64(max_ctas),
                dma=np.bool_(dma), whole_blocks=np.bool_(whole_blocks))[0]


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


@functools.lru_cache(maxsize=64)
def eager_fn(kind: str, out_sharding: jax.sharding.Sharding, facts: IndexFacts,
              donate: bool = False, max_ctas: int | None = None, dma: bool = False,
              whole_blocks: bool = False):
    """A jitted op for calls made outside jit; the result keeps the destination's sharding.

    A destination split over several devices is copied by each device on its own shard.
    """
    options = {"dma": dma, "whole_blocks": whole_blocks}
    if kind == "pool":
        def fn(dst, src, si, di, nt):
            return block_copy_call(dst, src, si, di, nt, facts, max_ctas, **options)
    else:
        def fn(dst, src, si, di, nt):
            return block_copy_call(dst[None], src[None], si, di, nt, facts, max_ctas,
                                   **options)[0]
    if is_split(out_sharding):
        spec, whole = out_sharding.spec, jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, mesh=out_sharding.mesh, in_specs=(spec, spec) + (whole,) * 3,
                           out_specs=spec)
    return jax.jit(fn, out_shardings=out_sharding, donate_argnums=(0,) if donate else ())
