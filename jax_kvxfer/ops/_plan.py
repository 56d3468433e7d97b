"""`plan_copy`: every check of a `copy_blocks` call, run once, and the frozen `CopyPlan` it
decides. `_lowering.emit` turns any plan into the custom call; nothing after planning checks
or decides again.

A pool in an engine's own layout (`token_axis`, `block_axis`) is planned as its 6-D view
(`_layouts.py`): the plan carries the axes, and the indices are expanded to the view's blocks
here, so that the rest of the path sees one geometry.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from . import _layouts as layouts
from . import _native
from ._checks import (
    POOL_RANK,
    IndexLike,
    TokensLike,
    as_index_array,
    check_byte_rows,
    check_dma,
    check_dma_choice,
    check_in_range,
    check_max_ctas,
    check_pool,
    check_same_blocks,
    check_split,
    concrete,
    dtype_bits,
    index_facts,
    is_split,
    is_tracer,
    may_copy_partial,
    normalize_tokens,
)
from ._lowering import CopyPlan

# dma="auto" (`copy_blocks` outside jit) takes the copy engines for whole blocks of at least this
# many bytes between the two memories. Measured on the H200, one call at a time: the copy
# engines are ahead from 256 KiB (90/91 % of the memcpy ceiling against the kernel's 86/83 %;
# at 4 MiB 96/96 % against 92/89 %) and behind at 16-64 KiB, where the runtime's host time per
# copy (0.5-0.8 us) costs more than the copy moves; a partial block is one strided copy each,
# slower than the kernel at every size measured.
DMA_AUTO_MIN_BLOCK_BYTES = 256 * 1024


def check_platform(*arrays: Any) -> None:
    """Arrays on a GPU need this build's CUDA handlers (a RuntimeError saying how to build
    them, before anything is traced)."""
    platforms = {d.platform for a in arrays if isinstance(a, jax.Array) and not is_tracer(a)
                 for d in a.devices()}
    if not platforms and any(is_tracer(a) for a in arrays):
        platforms = {jax.default_backend()}
    if "gpu" in platforms or "cuda" in platforms:
        _native.require_cuda_handlers()


def plan_copy(dst_pool: Any, src_pool: Any, src_indices: IndexLike, dst_indices: IndexLike,
              num_tokens: TokensLike, *, token_axis: int | None, block_axis: int,
              max_ctas: int | None, dma: bool | str,
              unique_dst_indices: bool, donate: bool) -> tuple[CopyPlan, tuple, bool]:
    """Checks a `copy_blocks` call (see its docstring for what raises) and plans it.

    Returns (plan, (src indices, dst indices, token counts) as the call takes them, whether any
    argument is traced). Outside jit with `dma`, the operands are in pinned_host memory."""
    check_max_ctas(max_ctas)
    check_dma_choice(dma)
    if not isinstance(unique_dst_indices, (bool, np.bool_)):
        raise TypeError(f"unique_dst_indices must be True or False, got {unique_dst_indices!r}")
    if token_axis is None and isinstance(block_axis, int) and block_axis == 0:
        axes = None
        check_pool("dst_pool", dst_pool, POOL_RANK)
        check_pool("src_pool", src_pool, POOL_RANK)
        check_same_blocks(dst_pool, src_pool, "dst_pool", "src_pool", lead=1)
        si, di, tokens = _pairs(src_indices, dst_indices, num_tokens)
        dst_shape, src_blocks = tuple(dst_pool.shape), src_pool.shape[0]
        may_be_partial = may_copy_partial(tokens, dst_shape[4])
        check_byte_rows(dst_shape[1:], dst_pool.dtype, may_be_partial)
        check_in_range("src_indices", concrete(si), src_blocks, "src_pool")
        check_in_range("dst_indices", concrete(di), dst_shape[0], "dst_pool")
    else:
        dst_lay, src_lay = _layouts(dst_pool, src_pool, token_axis, block_axis)
        si, di, tokens = _pairs(src_indices, dst_indices, num_tokens)
        check_in_range("src_indices", concrete(si), src_lay.num_blocks, "src_pool")
        check_in_range("dst_indices", concrete(di), dst_lay.num_blocks, "dst_pool")
        si, di = layouts.expand_pairs(si, src_lay), layouts.expand_pairs(di, dst_lay)
        tokens = layouts.expand_tokens(tokens, dst_lay)
        axes = (dst_lay.block_axis, dst_lay.token_axis)
        dst_shape, src_blocks = dst_lay.view, src_lay.view[0]
        may_be_partial = may_copy_partial(tokens, dst_shape[4])
        check_byte_rows(dst_shape[1:], dst_pool.dtype, may_be_partial)
    check_platform(dst_pool, src_pool)
    check_split(dst_pool, src_pool, "dst_pool", "src_pool")
    si_host, di_host = concrete(si), concrete(di)
    facts = index_facts(si_host, di_host, src_blocks, dst_shape[0])
    if unique_dst_indices:
        if si_host is not None and di_host is not None and not facts.unique_dst:
            raise ValueError("unique_dst_indices=True, but dst_indices writes one block in two "
                             "pairs (negative padding may repeat)")
        facts = facts._replace(unique_dst=True)
    whole = not may_be_partial
    traced = any(is_tracer(a) for a in (dst_pool, src_pool, si, di, tokens))
    if isinstance(dma, str):  # "auto": outside jit, 6-D pools of one GPU, whole large blocks
        dma = (not traced and axes is None
               and _auto_dma(dst_pool, src_pool, dst_shape, whole, max_ctas))
    dma = bool(dma)
    within = src_pool is dst_pool
    if dma:
        if not traced:
            if is_split(dst_pool.sharding):
                raise ValueError("dma=True does not take pools split over several devices")
            si, di, tokens = put_in_pinned_host((si, di, tokens), dst_pool)
        check_dma(dst_pool, src_pool, {"src_indices": si, "dst_indices": di,
                                       "num_tokens": tokens}, whole)
    if not traced and donate and within:
        raise ValueError("donate=True needs src_pool to be another array than dst_pool")
    plan = CopyPlan(facts=facts, whole_blocks=whole, dma=dma,
                    max_ctas=None if max_ctas is None else int(max_ctas),
                    within=within, axes=axes)
    return plan, (si, di, tokens), traced


def _pairs(src_indices: IndexLike, dst_indices: IndexLike,
           num_tokens: TokensLike) -> tuple[Any, Any, Any]:
    """The index vectors (int32, one length) and the token counts of a batch, checked."""
    si = as_index_array("src_indices", src_indices)
    di = as_index_array("dst_indices", dst_indices)
    if si.shape[0] != di.shape[0]:
        raise ValueError(
            f"src_indices has length {si.shape[0]} but dst_indices has length {di.shape[0]}")
    return si, di, normalize_tokens(num_tokens, si.shape[0])


def _layouts(dst_pool: Any, src_pool: Any, token_axis: int | None,
             block_axis: Any) -> tuple[layouts.Layout, layouts.Layout]:
    """The two pools' layouts, checked against each other."""
    check_pool("dst_pool", dst_pool, None)
    check_pool("src_pool", src_pool, None)
    if token_axis is None:
        raise TypeError("block_axis needs token_axis: the axis a partial copy's tokens run along")
    dst_lay = layouts.layout("dst_pool", dst_pool, token_axis, block_axis)
    src_lay = layouts.layout("src_pool", src_pool, token_axis, block_axis)
    b = dst_lay.block_axis
    if dst_pool.dtype != src_pool.dtype:
        raise TypeError(f"src_pool has dtype {src_pool.dtype}, expected dst_pool's "
                        f"{dst_pool.dtype}")
    if len(src_lay.shape) != len(dst_lay.shape) or any(
            x != y for k, (x, y) in enumerate(zip(src_lay.shape, dst_lay.shape)) if k != b):
        raise ValueError(f"src_pool has shape {src_lay.shape}, expected dst_pool's "
                         f"{dst_lay.shape} except along block_axis {b}")
    for name, pool in (("dst_pool", dst_pool), ("src_pool", src_pool)):
        if not is_tracer(pool) and is_split(pool.sharding):
            raise ValueError(f"{name} is split over devices: token_axis and block_axis take "
                             "pools on one device (split pools take the 6-D layout)")
    return dst_lay, src_lay


def _auto_dma(dst_pool: jax.Array, src_pool: jax.Array, shape: tuple[int, ...], whole: bool,
              max_ctas: Any) -> bool:
    """dma="auto" outside jit: whether the copy engines take this copy (see `copy_blocks`)."""
    if not whole or max_ctas is not None or shape[0] == 0:
        return False
    kinds = {dst_pool.sharding.memory_kind, src_pool.sharding.memory_kind}
    block_bits = math.prod(shape[1:]) * dtype_bits(dst_pool.dtype)
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
