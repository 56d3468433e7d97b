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
    check_pool,
    check_same_blocks,
    check_split,
    is_split,
    is_tracer,
    may_copy_partial,
    normalize_tokens,
)
from ._lowering import CopyPlan, eager_copy, emit
from ._plan import check_platform, plan_copy


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
    dma: bool | str = "auto",
    unique_dst_indices: bool = False,
) -> jax.Array:
    """Copies block `src_indices[i]` of `src_pool` into block `dst_indices[i]` of `dst_pool`.

    Every pair reads `src_pool` as it was before the call; of two pairs writing one block, the
    later wins for the tokens it writes. A negative index (or a traced one out of range) skips
    its pair. docs/semantics.md gives the full rules, docs/bad-inputs.md every error.

    Args:
      dst_pool, src_pool: `[num_blocks, num_layers, kv_factor, num_kv_heads, tokens_per_block,
        size_per_head]`, one block shape and dtype, in `device` or `pinned_host` memory. Inside
        `jax.jit`, donate `dst_pool` for an in-place update.
      src_indices, dst_indices: integer vectors of one length B (lists, NumPy or JAX arrays,
        traced or not).
      num_tokens: None (whole blocks), an int, or a vector of length B: n copies the first n
        tokens of the block; n <= 0 or n >= tokens_per_block the whole block.
      token_axis, block_axis: pools in an engine's own layout (NHD `[nb, T, H, D]`: token_axis
        1; HND: 2; K/V first `[2, nb, T, H, D]`: block_axis 1, token_axis 2).
      donate: outside jit only: consume `dst_pool` and update it in place.
      max_ctas: on GPUs, the most CTAs the copy kernel may occupy (None: every SM it can use).
      dma: on GPUs, between `device` and `pinned_host` memory, copy with the copy engines
        (no SM used) instead of the kernel. Inside `jax.jit` the indices must then be jit
        arguments in pinned_host memory, written before the call. "auto": the copy engines for
        whole blocks of 256 KiB or more outside jit, the kernel otherwise. Ignored on CPU.
      unique_dst_indices: the caller's promise that no destination block is written twice
        (negative padding may repeat); checked where the indices are known.

    Returns:
      The new destination pool (same shape, dtype and, outside jit, sharding as `dst_pool`).

    Raises:
      TypeError, ValueError, IndexError: naming the argument (docs/bad-inputs.md).
    """
    plan, (si, di, tokens), traced = plan_copy(
        dst_pool, src_pool, src_indices, dst_indices, num_tokens, token_axis=token_axis,
        block_axis=block_axis, max_ctas=max_ctas, dma=dma,
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
