"""Argument checks of the ops and the manager, and what known indices prove.

Every check raises a clear exception that names the argument and what was expected, before
anything is dispatched.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._jax_seams import memory_space

IndexLike = jax.Array | np.ndarray | Sequence[int]
TokensLike = None | int | jax.Array | np.ndarray | Sequence[int]

POOL_RANK = 6
BLOCK_RANK = POOL_RANK - 1
MEMORY_KINDS = ("device", "pinned_host")

# 4-bit types: packed two per byte on GPUs, so a token row is a whole number of bytes only when
# size_per_head is even. Other sub-byte types (2-bit) are not supported.
_FOUR_BIT_DTYPES = frozenset(
    jnp.dtype(t) for t in (jnp.int4, jnp.uint4, getattr(jnp, "float4_e2m1fn", jnp.int4))
)


def dtype_bits(dtype: Any) -> int:
    """Bits one element of `dtype` occupies in a packed pool (4 for int4/uint4/float4_e2m1fn)."""
    dtype = jnp.dtype(dtype)
    if dtype in _FOUR_BIT_DTYPES:
        return 4
    if dtype.itemsize == 1 and dtype.name in ("int2", "uint2", "int1", "uint1"):
        raise TypeError(f"dtype {dtype.name} is not supported: only 4-bit sub-byte types are")
    return 8 * dtype.itemsize


def check_int(name: str, value: Any) -> int:
    """`value` as an int; a TypeError naming `name` for anything but a Python or NumPy integer
    (bools included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_pool(name: str, pool: Any, rank: int | None) -> None:
    """A live pool (or block, by `rank`; None: any rank) in `device` or `pinned_host` memory."""
    if not isinstance(pool, jax.Array):
        raise TypeError(f"{name} must be a jax.Array, got {type(pool).__name__}")
    if rank is not None and pool.ndim != rank:
        what = "pool" if rank == POOL_RANK else "block"
        raise ValueError(
            f"{name} must be a {rank}-D {what} [{'num_blocks, ' if rank == POOL_RANK else ''}"
            f"num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head], "
            f"got shape {tuple(pool.shape)}"
        )
    dtype_bits(pool.dtype)
    if is_tracer(pool):
        return
    if pool.is_deleted():
        raise ValueError(f"{name} has been deleted (was it donated to a jitted function?)")
    kind = pool.sharding.memory_kind
    if kind is not None and kind not in MEMORY_KINDS:
        raise ValueError(f"{name} must live in memory kind 'device' or 'pinned_host', got {kind!r}")
    check_memory_space(name, pool)


def check_memory_space(name: str, array: jax.Array) -> None:
    """Rejects an array whose JAX type disagrees with where its buffer lives.

    With jax 0.10, `jax.jit(f, out_shardings=<pinned_host>)` returns arrays whose type still says
    device memory; passing one to another jitted function aborts the process inside XLA.
    """
    on_host = array.sharding.memory_kind == "pinned_host"
    space = memory_space(array)
    if space is not None and on_host != (getattr(space, "name", "") == "Host"):
        raise ValueError(
            f"{name} is in pinned_host memory but its JAX type says {space}: this JAX version "
            "mislabels arrays made by jax.jit(..., out_shardings=<pinned_host sharding>); make "
            "them with jax.device_put(x, <pinned_host sharding>) or return them from a jitted "
            "function whose input was already in pinned_host"
        )


def check_same_blocks(dst: jax.Array, src: jax.Array, dst_name: str, src_name: str,
                       lead: int) -> None:
    if dst.dtype != src.dtype:
        raise TypeError(f"{src_name} has dtype {src.dtype}, expected {dst_name}'s {dst.dtype}")
    if dst.shape[lead:] != src.shape[lead:]:
        raise ValueError(
            f"{src_name} has block shape {tuple(src.shape[lead:])}, "
            f"expected {dst_name}'s {tuple(dst.shape[lead:])}"
        )


def check_byte_rows(block_shape: tuple[int, ...], dtype: Any, partial_possible: bool) -> None:
    """Sub-byte pools need whole-byte blocks, and whole-byte token rows for partial copies."""
    bits = dtype_bits(dtype)
    if bits >= 8:
        return
    if int(np.prod(block_shape)) * bits % 8:
        raise ValueError(
            f"a block of {jnp.dtype(dtype).name} with shape {tuple(block_shape)} is not a whole "
            "number of bytes; use an even number of elements per block"
        )
    if partial_possible and block_shape[-1] * bits % 8:
        raise ValueError(
            f"partial copies of {jnp.dtype(dtype).name} need an even size_per_head (a token row "
            f"must be a whole number of bytes), got size_per_head={block_shape[-1]}; copy whole "
            "blocks (num_tokens=None) instead"
        )


def as_index_array(name: str, x: Any) -> jax.Array | np.ndarray:
    """An int32 vector from indices given as a list, NumPy or JAX array (traced or not)."""
    if isinstance(x, (jax.Array, np.ndarray)):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be a sequence of integers, got {x!r}") from e
        if arr.size == 0:
            arr = arr.astype(np.int32)
    if arr.dtype == np.bool_ or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if isinstance(arr, jax.Array) and not is_tracer(arr):
        arr = np.asarray(arr)  # known values: checked on the host, like NumPy input
    if isinstance(arr, np.ndarray):
        info = np.iinfo(np.int32)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise IndexError(f"{name} holds values outside int32: min {arr.min()}, max {arr.max()}")
        return arr.astype(np.int32)
    # Traced: values beyond int32 must not wrap into valid ones. Clamp them to values that mean
    # the same (-1: skip / whole block; int32 max: out of range / whole block).
    info, i32 = jnp.iinfo(arr.dtype), np.iinfo(np.int32)
    if info.max > i32.max:
        arr = jnp.minimum(arr, i32.max)
    if info.min < i32.min:
        arr = jnp.maximum(arr, -1)
    return arr.astype(jnp.int32)


def concrete(x: Any) -> np.ndarray | None:
    """The values of x when known on the host, without tracing (None for tracers)."""
    if is_tracer(x):
        return None
    return np.asarray(x)


def check_in_range(name: str, idx: np.ndarray | None, num_blocks: int, pool_name: str) -> None:
    if idx is not None and idx.size and idx.max() >= num_blocks:
        raise IndexError(
            f"{name} holds block index {int(idx.max())}, but {pool_name} has {num_blocks} blocks "
            "(valid: 0..num_blocks-1, or negative to skip the pair)"
        )


def normalize_tokens(num_tokens: TokensLike, batch: int) -> jax.Array | np.ndarray:
    if num_tokens is None:
        return np.zeros(batch, np.int32)  # 0 = whole block
    if isinstance(num_tokens, (bool, np.bool_)):
        raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}")
    if isinstance(num_tokens, (int, np.integer)):
        return np.full(batch, num_tokens, np.int64).clip(-1, np.iinfo(np.int32).max).astype(np.int32)
    if isinstance(num_tokens, (jax.Array, np.ndarray)) and num_tokens.ndim == 0:
        if not jnp.issubdtype(num_tokens.dtype, jnp.integer) or num_tokens.dtype == np.bool_:
            raise TypeError(f"num_tokens must hold integers, got dtype {num_tokens.dtype}")
        tokens = as_index_array("num_tokens", num_tokens.reshape(1))
        if is_tracer(tokens):
            return jnp.broadcast_to(tokens, (batch,))
        return np.repeat(tokens, batch)
    tokens = as_index_array("num_tokens", num_tokens)
    if tokens.shape[0] != batch:
        raise ValueError(f"num_tokens has length {tokens.shape[0]}, expected {batch} (one per pair)")
    return tokens


def may_copy_partial(tokens: Any, tokens_per_block: int) -> bool:
    values = concrete(tokens)
    if values is None:
        return True
    return bool(np.any((values > 0) & (values < tokens_per_block)))


class IndexFacts(NamedTuple):
    """What known (non-traced) indices prove; the kernels skip work that is then not needed."""

    hazard_free: bool = False  # no block is written by one pair and read by another
    unique_dst: bool = False  # no two pairs write one block


UNKNOWN = IndexFacts()


def index_facts(src: np.ndarray | None, dst: np.ndarray | None, src_blocks: int,
                dst_blocks: int) -> IndexFacts:
    """The facts of known indices; traced (None) indices prove nothing.

    A hazard only matters when source and destination are one buffer: the kernel then reads
    all sources out first. Without unique destinations the GPU kernel first scans for later
    pairs writing the same block (so the last one wins).
    """
    if src is None or dst is None:
        return UNKNOWN
    pairs = [(a, b) for a, b in zip(src.tolist(), dst.tolist())
             if 0 <= a < src_blocks and 0 <= b < dst_blocks]
    writers = collections.Counter(b for _, b in pairs)
    unique_dst = len(writers) == len(pairs)
    # A read is safe when no pair writes that block, or only the reading pair itself does.
    hazard_free = all(writers[a] == 0 or (writers[a] == 1 and a == b) for a, b in pairs)
    return IndexFacts(bool(hazard_free), bool(unique_dst))


def touches_host(*pools: Any) -> bool:
    return any(memory_space(p) == jax.memory.Space.Host for p in pools)


def check_dma(dst_pool: Any, src_pool: Any, plan: dict[str, Any], whole_blocks: bool,
              pool_names: tuple[str, str] = ("dst_pool", "src_pool")) -> None:
    """dma=True: one pool in device memory and the other in pinned_host memory, and the plan
    arrays (`name: array`; "num_tokens" may be left out when every pair copies whole blocks)
    in pinned_host memory, where the GPU handler reads them as it enqueues the copies."""
    host = jax.memory.Space.Host

    def kind(pool: Any) -> str:  # a concrete array's sharding says it on every JAX version
        if not is_tracer(pool):
            return pool.sharding.memory_kind
        return "pinned_host" if memory_space(pool) == host else "device"

    dst_kind, src_kind = kind(dst_pool), kind(src_pool)
    if (dst_kind == "pinned_host") == (src_kind == "pinned_host"):
        raise ValueError("dma=True copies between device and pinned_host memory; "
                         f"{pool_names[0]} and {pool_names[1]} are in {dst_kind!r} and "
                         f"{src_kind!r}")
    for name, x in plan.items():
        if name == "num_tokens" and whole_blocks:
            continue
        if not is_tracer(x) and not isinstance(x, jax.Array):
            raise ValueError(f"dma=True inside jax.jit needs {name} in pinned_host memory (a jit "
                             f"argument put there on the host), got a constant {type(x).__name__}")
        space = memory_space(x)
        if space is not None and space != host:
            raise ValueError(f"dma=True needs {name} in pinned_host memory, where the GPU handler "
                             f"reads it while it enqueues the copies; it is in {space}")


def check_dma_choice(dma: Any) -> None:
    """`dma` of `copy_blocks` and of the manager: True, False or "auto"."""
    if not (isinstance(dma, (bool, np.bool_)) or (isinstance(dma, str) and dma == "auto")):
        raise TypeError(f'dma must be True, False or "auto", got {dma!r}')


def check_max_ctas(max_ctas: int | None) -> None:
    if max_ctas is None:
        return
    if isinstance(max_ctas, (bool, np.bool_)) or not isinstance(max_ctas, (int, np.integer)):
        raise TypeError(f"max_ctas must be None or a positive int, got {max_ctas!r}")
    if max_ctas < 1:
        raise ValueError(f"max_ctas must be None or a positive int, got {max_ctas!r}")


def is_split(sharding: jax.sharding.Sharding) -> bool:
    return isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1


def check_split(dst: jax.Array, src: jax.Array, dst_name: str, src_name: str) -> None:
    """A destination split over devices: per-device copies need whole blocks and whole token
    ranges on every device, and the source split the same way."""
    if is_tracer(dst) or not is_split(dst.sharding):
        return
    spec = tuple(dst.sharding.spec) + (None,) * dst.ndim
    lead = dst.ndim - BLOCK_RANK  # 1 for a pool (its blocks dimension), 0 for one block
    if spec[lead + 3] is not None or (lead and spec[0] is not None):
        raise ValueError(f"{dst_name} may be split along layers, K/V, heads or size_per_head, "
                         f"not along blocks or tokens; got {dst.sharding.spec}")
    if is_tracer(src) or not src.sharding.with_memory_kind(
            dst.sharding.memory_kind).is_equivalent_to(dst.sharding, dst.ndim):
        raise ValueError(f"{src_name} must be split over the devices like {dst_name} "
                         f"({dst.sharding.spec}), got {getattr(src, 'sharding', None)}")
