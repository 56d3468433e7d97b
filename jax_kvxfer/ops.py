"""The block-copy ops: `copy_blocks` (batched, partial or whole) and `partial_block_copy`.

Both lower to one XLA FFI custom call, `jax_kvxfer_block_copy`, whose result is aliased to the
destination pool: inside `jax.jit` with the destination donated, the copy happens in place.
Called outside `jax.jit`, each op runs as its own small jitted computation whose result keeps
the destination's sharding (and so its memory kind).
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _native

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


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_pool(name: str, pool: Any, rank: int) -> None:
    if not isinstance(pool, jax.Array):
        raise TypeError(f"{name} must be a jax.Array, got {type(pool).__name__}")
    if pool.ndim != rank:
        what = "pool" if rank == POOL_RANK else "block"
        raise ValueError(
            f"{name} must be a {rank}-D {what} [{'num_blocks, ' if rank == POOL_RANK else ''}"
            f"num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head], "
            f"got shape {tuple(pool.shape)}"
        )
    dtype_bits(pool.dtype)
    if _is_tracer(pool):
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
    space = getattr(jax.typeof(array), "memory_space", None)
    if space is not None and on_host != (getattr(space, "name", "") == "Host"):
        raise ValueError(
            f"{name} is in pinned_host memory but its JAX type says {space}: this JAX version "
            "mislabels arrays made by jax.jit(..., out_shardings=<pinned_host sharding>); make "
            "them with jax.device_put(x, <pinned_host sharding>) or return them from a jitted "
            "function whose input was already in pinned_host"
        )


def _check_same_blocks(dst: jax.Array, src: jax.Array, dst_name: str, src_name: str,
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


def _as_index_array(name: str, x: Any) -> jax.Array | np.ndarray:
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
    if isinstance(arr, jax.Array) and not _is_tracer(arr):
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


def _concrete(x: Any) -> np.ndarray | None:
    """The values of x when known on the host, without tracing (None for tracers)."""
    if _is_tracer(x):
        return None
    return np.asarray(x)


def _check_in_range(name: str, idx: np.ndarray | None, num_blocks: int, pool_name: str) -> None:
    if idx is not None and idx.size and idx.max() >= num_blocks:
        raise IndexError(
            f"{name} holds block index {int(idx.max())}, but {pool_name} has {num_blocks} blocks "
            "(valid: 0..num_blocks-1, or negative to skip the pair)"
        )


def _normalize_tokens(num_tokens: TokensLike, batch: int) -> jax.Array | np.ndarray:
    if num_tokens is None:
        return np.zeros(batch, np.int32)  # 0 = whole block
    if isinstance(num_tokens, (bool, np.bool_)):
        raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}")
    if isinstance(num_tokens, (int, np.integer)):
        return np.full(batch, num_tokens, np.int64).clip(-1, np.iinfo(np.int32).max).astype(np.int32)
    if isinstance(num_tokens, (jax.Array, np.ndarray)) and num_tokens.ndim == 0:
        if not jnp.issubdtype(num_tokens.dtype, jnp.integer) or num_tokens.dtype == np.bool_:
            raise TypeError(f"num_tokens must hold integers, got dtype {num_tokens.dtype}")
        tokens = _as_index_array("num_tokens", num_tokens.reshape(1))
        if _is_tracer(tokens):
            return jnp.broadcast_to(tokens, (batch,))
        return np.repeat(tokens, batch)
    tokens = _as_index_array("num_tokens", num_tokens)
    if tokens.shape[0] != batch:
        raise ValueError(f"num_tokens has length {tokens.shape[0]}, expected {batch} (one per pair)")
    return tokens


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


# CTAs (of 1024 threads) that a copy to or from pinned_host memory on a stream of its own uses
# by default: on an H200, 8 fill PCIe in either direction for whole blocks, and the other SMs
# stay free for the work running beside the copy. Without a stream of its own the copy takes
# every SM it can use (the fastest for short partial runs, which need many requests in flight).
HOST_COPY_CTAS = 8

# dma="auto" (`copy_blocks` outside jit) takes the copy engines for whole blocks of at least this
# many bytes between the two memories. Measured on the H200, one call at a time: the copy
# engines are ahead from 256 KiB (90/91 % of the memcpy ceiling against the kernel's 86/83 %;
# at 4 MiB 96/96 % against 92/89 %) and behind at 16-64 KiB, where the runtime's host time per
# copy (about 0.8 us) costs more than the copy moves; a partial block is one strided copy each,
# slower than the kernel at every size measured.
DMA_AUTO_MIN_BLOCK_BYTES = 256 * 1024


def _memory_space(x: Any) -> Any:
    """x's memory space (jax.memory.Space) where JAX tells it, else None (NumPy, older JAX)."""
    return getattr(jax.typeof(x), "memory_space", None) if isinstance(x, jax.Array) else None


def _touches_host(*pools: Any) -> bool:
    return any(_memory_space(p) == jax.memory.Space.Host for p in pools)


def check_dma(dst_pool: Any, src_pool: Any, plan: dict[str, Any], whole_blocks: bool,
              pool_names: tuple[str, str] = ("dst_pool", "src_pool")) -> None:
    """dma=True: one pool in device memory and the other in pinned_host memory, and the plan
    arrays (`name: array`; "num_tokens" may be left out when every pair copies whole blocks)
    in pinned_host memory, where the GPU handler reads them as it enqueues the copies."""
    host = jax.memory.Space.Host

    def kind(pool: Any) -> str:  # a concrete array's sharding says it on every JAX version
        if not _is_tracer(pool):
            return pool.sharding.memory_kind
        return "pinned_host" if _memory_space(pool) == host else "device"

    dst_kind, src_kind = kind(dst_pool), kind(src_pool)
    if (dst_kind == "pinned_host") == (src_kind == "pinned_host"):
        raise ValueError("dma=True copies between device and pinned_host memory; "
                         f"{pool_names[0]} and {pool_names[1]} are in {dst_kind!r} and "
                         f"{src_kind!r}")
    for name, x in plan.items():
        if name == "num_tokens" and whole_blocks:
            continue
        if not _is_tracer(x) and not isinstance(x, jax.Array):
            raise ValueError(f"dma=True inside jax.jit needs {name} in pinned_host memory (a jit "
                             f"argument put there on the host), got a constant {type(x).__name__}")
        space = _memory_space(x)
        if space is not None and space != host:
            raise ValueError(f"dma=True needs {name} in pinned_host memory, where the GPU handler "
                             f"reads it while it enqueues the copies; it is in {space}")


def check_dma_choice(dma: Any) -> None:
    """`dma` of `copy_blocks` and of the manager: True, False or "auto"."""
    if not (isinstance(dma, (bool, np.bool_)) or (isinstance(dma, str) and dma == "auto")):
        raise TypeError(f'dma must be True, False or "auto", got {dma!r}')


def check_launch_options(max_ctas: int | None, stream: int | None) -> None:
    for name, value in (("max_ctas", max_ctas), ("stream", stream)):
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be None or a positive int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")


class _SideStreamDepth(threading.local):
    depth = 0  # > 0 while on_stream traces a function: its copies then take a nograph target


_ON_SIDE_STREAM = _SideStreamDepth()


def copy_results(dst_pool, batch: int, staging_bytes: int = 0) -> tuple:
    """The result types of a block copy custom call: the destination pool (its memory space
    included: pinned_host stays there), then the workspaces XLA allocates as extra results
    (ffi/block_copy.h, CheckWorkspaces): for the GPU's duplicate scan an int32 per pair and,
    for a destination in device memory, one per destination block (where a large batch's scan
    finds each block's last writer; XLA places these workspaces with the destination, and in
    pinned host memory the handler scans without them), and `staging_bytes` to stage source
    blocks in."""
    claims = 0 if _memory_space(dst_pool) == jax.memory.Space.Host else dst_pool.shape[0]
    return (jax.typeof(dst_pool),
            jax.ShapeDtypeStruct((batch + claims,), jnp.int32),
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
    from jax.experimental import compute_on as mod

    # jax 0.10 calls the function form compute_on2; jax 0.11 renamed it compute_on.
    annotate = getattr(mod, "compute_on2", None)
    if annotate is None and "out_memory_spaces" in inspect.signature(mod.compute_on).parameters:
        annotate = mod.compute_on
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
def _eager_fn(kind: str, out_sharding: jax.sharding.Sharding, facts: IndexFacts,
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
    if _is_split(out_sharding):
        spec, whole = out_sharding.spec, jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, mesh=out_sharding.mesh, in_specs=(spec, spec) + (whole,) * 3,
                           out_specs=spec)
    return jax.jit(fn, out_shardings=out_sharding, donate_argnums=(0,) if donate else ())


def _is_split(sharding: jax.sharding.Sharding) -> bool:
    return isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1


def _check_split(dst: jax.Array, src: jax.Array, dst_name: str, src_name: str) -> None:
    """A destination split over devices: per-device copies need whole blocks and whole token
    ranges on every device, and the source split the same way."""
    if _is_tracer(dst) or not _is_split(dst.sharding):
        return
    spec = tuple(dst.sharding.spec) + (None,) * dst.ndim
    lead = dst.ndim - BLOCK_RANK  # 1 for a pool (its blocks dimension), 0 for one block
    if spec[lead + 3] is not None or (lead and spec[0] is not None):
        raise ValueError(f"{dst_name} may be split along layers, K/V, heads or size_per_head, "
                         f"not along blocks or tokens; got {dst.sharding.spec}")
    if _is_tracer(src) or not src.sharding.with_memory_kind(
            dst.sharding.memory_kind).is_equivalent_to(dst.sharding, dst.ndim):
        raise ValueError(f"{src_name} must be split over the devices like {dst_name} "
                         f"({dst.sharding.spec}), got {getattr(src, 'sharding', None)}")


def _check_platform(*arrays: Any) -> None:
    platforms = {d.platform for a in arrays if isinstance(a, jax.Array) and not _is_tracer(a)
                 for d in a.devices()}
    if not platforms and any(_is_tracer(a) for a in arrays):
        platforms = {jax.default_backend()}
    if "gpu" in platforms or "cuda" in platforms:
        _native.require_cuda_handlers()


def copy_blocks(
    dst_pool: jax.Array,
    src_pool: jax.Array,
    src_indices: IndexLike,
    dst_indices: IndexLike,
    num_tokens: TokensLike = None,
    *,
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
        indices the GPU then skips the scan for later pairs writing the same block, one
        kernel launch per call (known indices are scanned on the host anyway). Checked where
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
    _check_pool("dst_pool", dst_pool, POOL_RANK)
    _check_pool("src_pool", src_pool, POOL_RANK)
    _check_same_blocks(dst_pool, src_pool, "dst_pool", "src_pool", lead=1)
    check_launch_options(max_ctas, stream)
    check_dma_choice(dma)
    if not isinstance(unique_dst_indices, (bool, np.bool_)):
        raise TypeError(f"unique_dst_indices must be True or False, got {unique_dst_indices!r}")
    si = _as_index_array("src_indices", src_indices)
    di = _as_index_array("dst_indices", dst_indices)
    if si.shape[0] != di.shape[0]:
        raise ValueError(
            f"src_indices has length {si.shape[0]} but dst_indices has length {di.shape[0]}"
        )
    tokens = _normalize_tokens(num_tokens, si.shape[0])
    may_be_partial = _may_be_partial(tokens, dst_pool.shape[4])
    check_byte_rows(dst_pool.shape[1:], dst_pool.dtype, may_be_partial)
    si_host, di_host = _concrete(si), _concrete(di)
    _check_in_range("src_indices", si_host, src_pool.shape[0], "src_pool")
    _check_in_range("dst_indices", di_host, dst_pool.shape[0], "dst_pool")
    _check_platform(dst_pool, src_pool)
    _check_split(dst_pool, src_pool, "dst_pool", "src_pool")
    facts = index_facts(si_host, di_host, src_pool.shape[0], dst_pool.shape[0])
    if unique_dst_indices:
        if si_host is not None and di_host is not None and not facts.unique_dst:
            raise ValueError("unique_dst_indices=True, but dst_indices writes one block in two "
                             "pairs (negative padding may repeat)")
        facts = facts._replace(unique_dst=True)
    whole = not may_be_partial
    traced = any(_is_tracer(a) for a in (dst_pool, src_pool, si, di, tokens))
    if isinstance(dma, str):  # "auto"
        dma = not traced and _auto_dma(dst_pool, src_pool, whole, max_ctas)
    dma = bool(dma)
    if max_ctas is None and stream is not None and _touches_host(dst_pool, src_pool):
        max_ctas = HOST_COPY_CTAS
    max_ctas = None if max_ctas is None else int(max_ctas)
    if dma:
        if not traced:
            if _is_split(dst_pool.sharding):
                raise ValueError("dma=True does not take pools split over several devices")
            si, di, tokens = _put_in_pinned_host((si, di, tokens), dst_pool)
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

        space = _memory_space(dst_pool) or jax.memory.Space.Device
        return on_stream(copy, int(stream), space)(dst_pool, src_pool, si, di, tokens)
    if donate and dst_pool is src_pool:
        raise ValueError("donate=True needs src_pool to be another array than dst_pool")
    fn = _eager_fn("pool", dst_pool.sharding, facts, bool(donate), max_ctas, **options)
    return fn(dst_pool, src_pool, si, di, tokens)


def _auto_dma(dst_pool: jax.Array, src_pool: jax.Array, whole: bool, max_ctas: Any) -> bool:
    """dma="auto" outside jit: whether the copy engines take this copy (see `copy_blocks`)."""
    if not whole or max_ctas is not None or dst_pool.shape[0] == 0:
        return False
    kinds = {dst_pool.sharding.memory_kind, src_pool.sharding.memory_kind}
    block_bits = math.prod(dst_pool.shape[1:]) * dtype_bits(dst_pool.dtype)
    return (kinds == {"device", "pinned_host"}
            and not (_is_split(dst_pool.sharding) or _is_split(src_pool.sharding))
            and all(d.platform in ("gpu", "cuda") for d in dst_pool.devices())
            and block_bits >= 8 * DMA_AUTO_MIN_BLOCK_BYTES)


def _put_in_pinned_host(arrays: tuple[Any, ...], like: jax.Array) -> tuple[jax.Array, ...]:
    """The index vectors in pinned_host memory of `like`'s device, their values in place
    before the copy is dispatched (the GPU handler reads them on the host as it enqueues)."""
    sharding = jax.sharding.SingleDeviceSharding(next(iter(like.devices())),
                                                 memory_kind="pinned_host")
    return jax.block_until_ready(tuple(
        jax.device_put(np.asarray(a, np.int32) if not isinstance(a, jax.Array) else a, sharding)
        for a in arrays))


def _may_be_partial(tokens: Any, tokens_per_block: int) -> bool:
    values = _concrete(tokens)
    if values is None:
        return True
    return bool(np.any((values > 0) & (values < tokens_per_block)))


def partial_block_copy(dst: jax.Array, src: jax.Array, num_tokens: int | jax.Array) -> jax.Array:
    """Returns `dst` with its first `num_tokens` tokens, `[:, :, :, :n, :]`, taken from `src`.

    TensorRT-LLM: `kvCacheBlockPartialCopy` (one block, one pool).

    Args:
      dst, src: one block each, `[num_layers, kv_factor, num_kv_heads, tokens_per_block,
        size_per_head]`, same shape and dtype, in `device` or `pinned_host` memory.
      num_tokens: a Python int or an integer scalar (traced values do not recompile).
        n <= 0 or n >= tokens_per_block copies the whole block.

    Returns:
      The new `dst` block.

    Raises:
      TypeError, ValueError: as for `copy_blocks`.
    """
    _check_pool("dst", dst, BLOCK_RANK)
    _check_pool("src", src, BLOCK_RANK)
    _check_same_blocks(dst, src, "dst", "src", lead=0)
    if isinstance(num_tokens, (bool, np.bool_)) or not (
        isinstance(num_tokens, (int, np.integer))
        or (isinstance(num_tokens, (jax.Array, np.ndarray)) and num_tokens.ndim == 0)
    ):
        raise TypeError(f"num_tokens must be an int or an integer scalar array, got {num_tokens!r}")
    tokens = _normalize_tokens(num_tokens, 1)
    check_byte_rows(dst.shape, dst.dtype, _may_be_partial(tokens, dst.shape[3]))
    _check_platform(dst, src)
    _check_split(dst, src, "dst", "src")
    zero = np.zeros(1, np.int32)
    one_pair = IndexFacts(hazard_free=True, unique_dst=True)
    if any(_is_tracer(a) for a in (dst, src, tokens)):
        return block_copy_call(dst[None], src[None], zero, zero, tokens, one_pair)[0]
    return _eager_fn("block", dst.sharding, one_pair)(dst, src, zero, zero, tokens)
