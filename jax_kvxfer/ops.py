"""The block-copy ops: `copy_blocks` (batched, partial or whole) and `partial_block_copy`.

Both lower to one XLA FFI custom call, `jax_kvxfer_block_copy`, whose result is aliased to the
destination pool: inside `jax.jit` with the destination donated, the copy happens in place.
Called outside `jax.jit`, each op runs as its own small jitted computation whose result keeps
the destination's sharding (and so its memory kind).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from . import _layouts as layouts
from ._checks import (
    BLOCK_RANK,
    POOL_RANK,
    IndexFacts,
    IndexLike,
    TokensLike,
    as_index_array,
    check_byte_rows,
    check_dma,
    check_dma_choice,
    check_in_range,
    check_launch_options,
    check_platform,
    check_pool,
    check_same_blocks,
    check_split,
    concrete,
    index_facts,
    is_split,
    is_tracer,
    may_copy_partial,
    normalize_tokens,
    touches_host,
)
from ._jax_seams import memory_space
from ._lowering import (
    HOST_COPY_CTAS,
    auto_dma,
    block_copy_call,
    eager_fn,
    on_stream,
    put_in_pinned_host,
)


def copy_blocks(
    dst_pool: jax.Array,
    src_pool: jax.Array,
    src_indices: IndexLike,
    dst_indices: IndexLike,
    num_tokens: TokensLike = None,
    *,
    token_axis: int | None = None,
    block_axis: int = 0,
    donate: bool = False,
    max_ctas: int | None = None,
    stream: int | None = None,
    dma: bool | str = "auto",
    unique_dst_indices: bool = False,
) -> jax.Array:
    """Copies block `src_indices[i]` of `src_pool` into block `dst_indices[i]` of `dst_pool`.

    TensorRT-LLM: one `copyBlock` per pair (memcpy or `kvCacheBlockPartialCopy`), batched into
    one custom call.

    Semantics: every pair reads `src_pool` as it was before the call; when two pairs write one
    destination block, the later pair wins for the tokens it writes. A negative index skips the
    pair (padding for bucketed batches); a traced index that is out of range is skipped too and
    never touches memory.

    Args:
      dst_pool: `[num_blocks, num_layers, kv_factor, num_kv_heads, tokens_per_block,
        size_per_head]` in memory kind `device` or `pinned_host`. Donate it (inside `jax.jit`)
        for an in-place update.
      src_pool: a pool of the same block shape and dtype, in `device` or `pinned_host` memory.
      src_indices, dst_indices: integer vectors of one length B (lists, NumPy or JAX arrays,
        traced or not).
      num_tokens: None (whole blocks), an int for every pair, or an integer vector of length B.
        Per pair, n copies `block[:, :, :, :n, :]`; n <= 0 or n >= tokens_per_block copies the
        whole block.
      token_axis, block_axis: pools in an engine's own layout: any rank, blocks along
        `block_axis` (0; 1 for K/V first, `[2, num_blocks, ...]`), and n tokens of a partial
        copy taken along `token_axis`, which must come after it (NHD `[nb, T, H, D]`: 1; HND
        `[nb, H, T, D]`: 2; K/V first `[2, nb, T, H, D]`: block_axis 1, token_axis 2; MLA
        `[nb, T, D]`: 1). Both pools then have the same shape except along `block_axis`, and
        live on one device each. None: today's 6-D layout (token axis 4). The copy is the same
        custom call over a view of the pools (a reshape, free inside `jax.jit`); outside jit,
        it takes the copy kernel unless `dma=True`.
      donate: outside jit only: consume `dst_pool` and update it in place. Without it the call
        is functional, and XLA first copies the whole destination pool. (Inside `jax.jit`,
        donate through `donate_argnums` instead.)
      max_ctas: on GPUs, the most CTAs (of 1024 threads; about one SM each) the copy kernel
        may occupy. None: every SM it can use, except for a copy to or from pinned_host memory
        with a `stream`, which takes `HOST_COPY_CTAS` (8: enough for PCIe on an H200 with
        whole blocks) and leaves the other SMs to the work beside it. Ignored on CPU.
      stream: inside `jax.jit`, run the copy on XLA GPU stream `stream` (1, 2, ...; JAX's
        stream annotation, `jax.experimental.compute_on`) so that it can overlap the jitted
        function's other work; XLA makes the users of the result wait for it. An offload and
        an onboard on two streams share PCIe's two directions. No effect outside `jax.jit`
        or on CPU.
      dma: on GPUs, copy with the copy engines (DMA) instead of the copy kernel: no SM is
        used, so with `stream` the copy runs beside compute without slowing it. Only between
        a `device` and a `pinned_host` pool, and the GPU handler reads the indices (and
        `num_tokens`, unless every pair copies whole blocks) on the host as it enqueues the
        copies: outside jit they are put in pinned_host memory for you; inside `jax.jit` they
        must be jit arguments in pinned_host memory whose values were written on the host
        before the call (not computed in the same program). Whole blocks adjacent in both
        pools become one copy, a partial block one strided copy. On an H200 whole blocks of
        64 KiB or more move as fast as with the kernel or faster (98 % of the memcpy at
        4 MiB), but 16 KiB blocks at a third of it, and partial blocks below 1 MiB slower
        than with the kernel. "auto" (default): the copy engines for a call outside jit that
        copies whole blocks of at least DMA_AUTO_MIN_BLOCK_BYTES between a `device` and a
        `pinned_host` pool of one GPU without `max_ctas` (its indices are known, so they can
        be put where the handler reads them); the copy kernel otherwise, and always inside
        `jax.jit`, where the index values may not exist yet when the copies are enqueued.
        Ignored on CPU.
      unique_dst_indices: the caller's promise that no destination block is written by two
        pairs (negative padding may repeat), as `unique_indices` of JAX's scatter. With traced
        indices the GPU then skips its scan for later pairs writing the same block (known
        indices are checked on the host, which then tells the GPU itself). Checked where
        the indices are known; with traced indices a broken promise leaves the blocks written
        twice undefined (never memory outside the pools).

    Returns:
      The new destination pool (same shape, dtype and, outside jit, sharding as `dst_pool`).

    Raises:
      TypeError: non-array pools, mismatched dtypes, non-integer indices, token counts,
        max_ctas or stream, a dma other than True, False or "auto", a non-bool
        unique_dst_indices.
      ValueError: wrong ranks or block shapes, other memory kinds, deleted pools, index vectors
        of different lengths, partial copies of sub-byte rows that are not whole bytes,
        max_ctas or stream below 1; with dma=True, two pools in one memory kind, pools split
        over devices, or (inside jit) indices that are not in pinned_host memory; with
        unique_dst_indices=True, known destination indices that repeat.
      IndexError: known (non-traced) indices >= the pool's number of blocks.
    """
    if token_axis is not None or not (isinstance(block_axis, int) and block_axis == 0):
        return _copy_in_layout(dst_pool, src_pool, src_indices, dst_indices, num_tokens,
                               token_axis=token_axis, block_axis=block_axis, donate=donate,
                               max_ctas=max_ctas, stream=stream, dma=dma,
                               unique_dst_indices=unique_dst_indices)
    check_pool("dst_pool", dst_pool, POOL_RANK)
    check_pool("src_pool", src_pool, POOL_RANK)
    check_same_blocks(dst_pool, src_pool, "dst_pool", "src_pool", lead=1)
    check_launch_options(max_ctas, stream)
    check_dma_choice(dma)
    if not isinstance(unique_dst_indices, (bool, np.bool_)):
        raise TypeError(f"unique_dst_indices must be True or False, got {unique_dst_indices!r}")
    si, di, tokens = _pairs(src_indices, dst_indices, num_tokens)
    may_be_partial = may_copy_partial(tokens, dst_pool.shape[4])
    check_byte_rows(dst_pool.shape[1:], dst_pool.dtype, may_be_partial)
    si_host, di_host = concrete(si), concrete(di)
    check_in_range("src_indices", si_host, src_pool.shape[0], "src_pool")
    check_in_range("dst_indices", di_host, dst_pool.shape[0], "dst_pool")
    check_platform(dst_pool, src_pool)
    check_split(dst_pool, src_pool, "dst_pool", "src_pool")
    facts = index_facts(si_host, di_host, src_pool.shape[0], dst_pool.shape[0])
    if unique_dst_indices:
        if si_host is not None and di_host is not None and not facts.unique_dst:
            raise ValueError("unique_dst_indices=True, but dst_indices writes one block in two "
                             "pairs (negative padding may repeat)")
        facts = facts._replace(unique_dst=True)
    whole = not may_be_partial
    traced = any(is_tracer(a) for a in (dst_pool, src_pool, si, di, tokens))
    if isinstance(dma, str):  # "auto"
        dma = not traced and auto_dma(dst_pool, src_pool, whole, max_ctas)
    dma = bool(dma)
    if max_ctas is None and stream is not None and touches_host(dst_pool, src_pool):
        max_ctas = HOST_COPY_CTAS
    max_ctas = None if max_ctas is None else int(max_ctas)
    if dma:
        if not traced:
            if is_split(dst_pool.sharding):
                raise ValueError("dma=True does not take pools split over several devices")
            si, di, tokens = put_in_pinned_host((si, di, tokens), dst_pool)
        check_dma(dst_pool, src_pool, {"src_indices": si, "dst_indices": di,
                                       "num_tokens": tokens}, whole)
    options = {"dma": dma, "whole_blocks": whole}
    if traced:
        if stream is None:
            return block_copy_call(dst_pool, src_pool, si, di, tokens, facts, max_ctas,
                                   **options)
        within = src_pool is dst_pool

        def copy(dst, src, a, b, n):
            return block_copy_call(dst, dst if within else src, a, b, n, facts, max_ctas,
                                   **options)

        space = memory_space(dst_pool) or jax.memory.Space.Device
        return on_stream(copy, int(stream), space)(dst_pool, src_pool, si, di, tokens)
    if donate and dst_pool is src_pool:
        raise ValueError("donate=True needs src_pool to be another array than dst_pool")
    fn = eager_fn("pool", dst_pool.sharding, facts, bool(donate), max_ctas, **options)
    return fn(dst_pool, src_pool, si, di, tokens)


def _pairs(src_indices: IndexLike, dst_indices: IndexLike,
           num_tokens: TokensLike) -> tuple[Any, Any, Any]:
    """The index vectors (int32, one length) and the token counts of a batch, checked."""
    si = as_index_array("src_indices", src_indices)
    di = as_index_array("dst_indices", dst_indices)
    if si.shape[0] != di.shape[0]:
        raise ValueError(
            f"src_indices has length {si.shape[0]} but dst_indices has length {di.shape[0]}")
    return si, di, normalize_tokens(num_tokens, si.shape[0])


def _copy_in_layout(dst_pool: jax.Array, src_pool: jax.Array, src_indices: IndexLike,
                    dst_indices: IndexLike, num_tokens: TokensLike, *, token_axis: int | None,
                    block_axis: int, donate: bool, max_ctas: int | None, stream: int | None,
                    dma: bool | str, unique_dst_indices: bool) -> jax.Array:
    """`copy_blocks` of pools in their own layout: the same copy over their 6-D views."""
    check_pool("dst_pool", dst_pool, None)
    check_pool("src_pool", src_pool, None)
    if token_axis is None:
        raise TypeError("block_axis needs token_axis: the axis a partial copy's tokens run along")
    check_dma_choice(dma)
    check_launch_options(max_ctas, stream)
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
    si, di, tokens = _pairs(src_indices, dst_indices, num_tokens)
    check_in_range("src_indices", concrete(si), src_lay.num_blocks, "src_pool")
    check_in_range("dst_indices", concrete(di), dst_lay.num_blocks, "dst_pool")
    si, tokens = layouts.expand_pairs(si, src_lay), layouts.expand_tokens(tokens, dst_lay)
    di = layouts.expand_pairs(di, dst_lay)
    within = src_pool is dst_pool
    static = {"lays": (dst_lay, src_lay), "within": within, "options": (
        ("max_ctas", max_ctas), ("stream", stream), ("unique_dst_indices", unique_dst_indices))}
    if any(is_tracer(x) for x in (dst_pool, src_pool, si, di, tokens)):
        return _copy_views(dst_pool, src_pool, si, di, tokens, dma=dma, **static)
    if unique_dst_indices and not index_facts(si, di, src_lay.view[0], dst_lay.view[0]).unique_dst:
        raise ValueError("unique_dst_indices=True, but dst_indices writes one block in two pairs "
                         "(negative padding may repeat)")
    dma = bool(dma is True or dma is np.True_)  # outside jit: the kernel unless asked otherwise
    if dma:
        si, di, tokens = put_in_pinned_host((si, di, tokens), dst_pool)
    if donate and within:
        raise ValueError("donate=True needs src_pool to be another array than dst_pool")
    fn = _eager_layout_fn(dst_pool.sharding, bool(donate), dma, **static)
    return fn(dst_pool, src_pool, si, di, tokens)


def _copy_views(dst, src, src_idx, dst_idx, tokens, *, lays: tuple, within: bool, dma: Any,
                options: tuple) -> jax.Array:
    """The copy over the pools' 6-D views, reshaped back to the destination's layout."""
    dst_lay, src_lay = lays
    view = dst.reshape(dst_lay.view)
    src_view = view if within else src.reshape(src_lay.view)
    return copy_blocks(view, src_view, src_idx, dst_idx, tokens, dma=dma,
                       **dict(options)).reshape(dst.shape)


@functools.lru_cache(maxsize=64)
def _eager_layout_fn(sharding: jax.sharding.Sharding, donate: bool, dma: bool, *, lays: tuple,
                     within: bool, options: tuple) -> Any:
    """A jitted copy in a layout, for calls outside jit: the views and the copy in one program,
    so that a donated pool is updated in place."""
    copy = functools.partial(_copy_views, dma=dma, lays=lays, within=within, options=options)
    if within:  # one array passed twice: the copy reads and writes the first
        return jax.jit(lambda dst, _, *rest: copy(dst, dst, *rest), out_shardings=sharding)
    return jax.jit(copy, out_shardings=sharding, donate_argnums=(0,) if donate else ())


def partial_block_copy(dst: jax.Array, src: jax.Array, num_tokens: int | jax.Array, *,
                       token_axis: int | None = None) -> jax.Array:
    """Returns `dst` with its first `num_tokens` tokens, `[:, :, :, :n, :]`, taken from `src`.

    TensorRT-LLM: `kvCacheBlockPartialCopy` (one block, one pool).

    Args:
      dst, src: one block each, `[num_layers, kv_factor, num_kv_heads, tokens_per_block,
        size_per_head]`, same shape and dtype, in `device` or `pinned_host` memory.
      num_tokens: a Python int or an integer scalar (traced values do not recompile).
        n <= 0 or n >= tokens_per_block copies the whole block.
      token_axis: a block in an engine's own layout (any rank): the axis its tokens run along
        (NHD `[T, H, D]`: 0; HND `[H, T, D]`: 1). None: the 5-D block above (token axis 3).

    Returns:
      The new `dst` block.

    Raises:
      TypeError, ValueError: as for `copy_blocks`.
    """
    if token_axis is not None:
        check_pool("dst", dst, None)
        check_pool("src", src, None)
        if dst.shape != src.shape:
            raise ValueError(f"src has shape {tuple(src.shape)}, expected dst's {tuple(dst.shape)}")
        axis = layouts.axis("token_axis", token_axis, dst.ndim)
        return copy_blocks(dst[None], src[None], [0], [0], _one_count(num_tokens),
                           token_axis=axis + 1)[0]
    check_pool("dst", dst, BLOCK_RANK)
    check_pool("src", src, BLOCK_RANK)
    check_same_blocks(dst, src, "dst", "src", lead=0)
    tokens = normalize_tokens(_one_count(num_tokens), 1)
    check_byte_rows(dst.shape, dst.dtype, may_copy_partial(tokens, dst.shape[3]))
    check_platform(dst, src)
    check_split(dst, src, "dst", "src")
    zero = np.zeros(1, np.int32)
    one_pair = IndexFacts(hazard_free=True, unique_dst=True)
    if any(is_tracer(a) for a in (dst, src, tokens)):
        return block_copy_call(dst[None], src[None], zero, zero, tokens, one_pair)[0]
    return eager_fn("block", dst.sharding, one_pair)(dst, src, zero, zero, tokens)


def _one_count(num_tokens: Any) -> Any:
    """partial_block_copy's num_tokens: an int or an integer scalar array."""
    if isinstance(num_tokens, (bool, np.bool_)) or not (
        isinstance(num_tokens, (int, np.integer))
        or (isinstance(num_tokens, (jax.Array, np.ndarray)) and num_tokens.ndim == 0)
    ):
        raise TypeError(f"num_tokens must be an int or an integer scalar array, got {num_tokens!r}")
    return num_tokens
