"""The block-copy ops: `copy_blocks` (batched, partial or whole) and `partial_block_copy`.

Both lower to one XLA FFI custom call, `jax_kvxfer_block_copy`, whose result is aliased to the
destination pool: inside `jax.jit` with the destination donated, the copy happens in place.
Called outside `jax.jit`, each op runs as its own small jitted computation whose result keeps
the destination's sharding (and so its memory kind).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import _layouts as layouts
from ._checks import (
    BLOCK_RANK,
    IndexFacts,
    IndexLike,
    TokensLike,
    check_byte_rows,
    check_platform,
    check_pool,
    check_same_blocks,
    check_split,
    is_split,
    is_tracer,
    may_copy_partial,
    normalize_tokens,
)
from ._lowering import eager_copy, emit
from ._plan import CopyPlan, plan_copy


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
    plan, (si, di, tokens), traced = plan_copy(
        dst_pool, src_pool, src_indices, dst_indices, num_tokens, token_axis=token_axis,
        block_axis=block_axis, max_ctas=max_ctas, stream=stream, dma=dma,
        unique_dst_indices=unique_dst_indices, donate=donate)
    if traced:
        return emit(plan, dst_pool, src_pool, si, di, tokens)
    return eager_copy(plan, dst_pool.sharding, bool(donate))(dst_pool, src_pool, si, di, tokens)


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
    axes = None
    if token_axis is not None:
        check_pool("dst", dst, None)
        check_pool("src", src, None)
        if dst.shape != src.shape:
            raise ValueError(f"src has shape {tuple(src.shape)}, expected dst's {tuple(dst.shape)}")
        if not is_tracer(dst) and is_split(dst.sharding):
            raise ValueError("dst is split over devices: token_axis takes blocks on one device "
                             "(split blocks take the 5-D layout)")
        axes = (0, layouts.axis("token_axis", token_axis, dst.ndim) + 1)
        view = layouts.Layout((1, *dst.shape), *axes).view
    else:
        check_pool("dst", dst, BLOCK_RANK)
        check_pool("src", src, BLOCK_RANK)
        check_same_blocks(dst, src, "dst", "src", lead=0)
        view = (1, *dst.shape)
    tokens = normalize_tokens(_one_count(num_tokens), 1)
    check_byte_rows(view[1:], dst.dtype, may_copy_partial(tokens, view[4]))
    check_platform(dst, src)
    check_split(dst, src, "dst", "src")
    plan = CopyPlan(IndexFacts(hazard_free=True, unique_dst=True), axes=axes, one_block=True)
    zero = np.zeros(1, np.int32)
    if any(is_tracer(a) for a in (dst, src, tokens)):
        return emit(plan, dst, src, zero, zero, tokens)
    return eager_copy(plan, dst.sharding)(dst, src, zero, zero, tokens)


def _one_count(num_tokens: Any) -> Any:
    """partial_block_copy's num_tokens: an int or an integer scalar array."""
    if isinstance(num_tokens, (bool, np.bool_)) or not (
        isinstance(num_tokens, (int, np.integer))
        or (isinstance(num_tokens, (jax.Array, np.ndarray)) and num_tokens.ndim == 0)
    ):
        raise TypeError(f"num_tokens must be an int or an integer scalar array, got {num_tokens!r}")
    return num_tokens
