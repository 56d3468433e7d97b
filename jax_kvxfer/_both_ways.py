"""`copy_blocks_both_ways`: an offload and an onboard between the same two pools at once.

Two `copy_blocks` calls between the same two pools, each reading the pool the other writes,
make XLA copy both pools whole first (it cannot order them otherwise), and one custom call
cannot alias both pools when one is in pinned_host memory (XLA's host offloader rejects it).
So the two directions are two custom calls, `new_b = fork(b, a)` then
`new_a = join(a, new_b)`: the second reads the first's result, XLA sees no cycle and copies no
pool, and that equals reading `b` as it was as long as no block is written by one direction and
read by the other (the plan below checks). On a GPU the fork's copy runs on a side stream of its
own, beside the join's, and the join makes XLA's stream wait for it (ffi/block_copy_cuda.cu).
Where a block is written by one direction and read by the other, the directions run one after
the other, the reader first, or with the sources of one read out first.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _native
from ._checks import (
    POOL_RANK,
    IndexFacts,
    IndexLike,
    TokensLike,
    as_index_array,
    check_byte_rows,
    check_dma,
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
from ._lowering import block_copy_call, copy_results
from ._plan import HOST_COPY_CTAS, CopyPlan, put_in_pinned_host

TICKET_BYTES = 8  # the fork's ticket result: its address identifies the fork to the join


class BothWaysPlan(NamedTuple):
    """How a both-ways copy stays exact (every read sees the pools as they were):

    - "together": no block is written by one direction and read by the other; on a GPU the two
      run at the same time;
    - "a_to_b_first" / "b_to_a_first": only that direction's reads would be spoilt by the other
      direction's writes, so it runs first;
    - "staged": both would (or the indices are traced): a->b's sources are read out into a
      device buffer first, then b->a runs, then a->b from that buffer.
    """

    mode: str = "together"


def both_ways_plan(ab_src: np.ndarray | None, ab_dst: np.ndarray | None,
                   ba_src: np.ndarray | None, ba_dst: np.ndarray | None,
                   a_blocks: int, b_blocks: int) -> BothWaysPlan:
    """The plan for known indices (None: traced, anything may clash)."""
    if any(x is None for x in (ab_src, ab_dst, ba_src, ba_dst)):
        return BothWaysPlan("staged")

    def valid(src, dst, src_blocks, dst_blocks):
        keep = (src >= 0) & (src < src_blocks) & (dst >= 0) & (dst < dst_blocks)
        return set(src[keep].tolist()), set(dst[keep].tolist())

    ab_reads, ab_writes = valid(ab_src, ab_dst, a_blocks, b_blocks)
    ba_reads, ba_writes = valid(ba_src, ba_dst, b_blocks, a_blocks)
    a_clash = bool(ab_reads & ba_writes)  # b->a writes an `a` block that a->b reads
    b_clash = bool(ba_reads & ab_writes)  # a->b writes a `b` block that b->a reads
    if a_clash and b_clash:
        return BothWaysPlan("staged")
    if a_clash:
        return BothWaysPlan("a_to_b_first")
    if b_clash:
        return BothWaysPlan("b_to_a_first")
    return BothWaysPlan("together")


def _cross_pool(plan: CopyPlan, **more: Any) -> dict[str, Any]:
    """The attributes of one direction's copy between the two pools (one never reads what
    the other writes: hazard_free), and the fork's or join's own."""
    return {**plan.attributes(), "hazard_free": np.bool_(True), **more}


def _fork_join(pool_a, pool_b, ab, ba, plans: tuple[CopyPlan, CopyPlan]):
    """a->b as the fork (on a side stream on the GPU), b->a as the join."""
    fork = jax.ffi.ffi_call(
        _native.BLOCK_COPY_FORK_TARGET, copy_results(pool_b, ab[0].shape[0]) + (
            jax.ShapeDtypeStruct((TICKET_BYTES,), jnp.uint8),),
        input_output_aliases={0: 0}, vmap_method="sequential")
    new_b, workspace, staging, ticket = fork(pool_b, pool_a, *ab, **_cross_pool(plans[0]))
    join = jax.ffi.ffi_call(_native.BLOCK_COPY_JOIN_TARGET,
                            copy_results(pool_a, ba[0].shape[0]),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    # after the ticket: what the fork's copy still uses, kept alive until the join has waited
    new_a = join(pool_a, new_b, *ba, ticket, workspace, staging, *ab,
                 **_cross_pool(plans[1], wait=np.bool_(True)))[0]
    # nothing can use new_b (whose copy the GPU may still be making) before the join
    return jax.lax.optimization_barrier((new_a, new_b))


def both_ways_call(pool_a, pool_b, ab, ba, facts: tuple[IndexFacts, IndexFacts],
                   plan: BothWaysPlan, max_ctas: int | None, dma: bool,
                   whole: tuple[bool, bool] = (False, False)):
    """The copies for `plan`; ab, ba: (src, dst, num_tokens) int32 vectors; whole: whether
    each direction copies whole blocks only (known tokens)."""
    ab_plan, ba_plan = (CopyPlan(f, whole_blocks=dma and w, dma=dma, max_ctas=max_ctas)
                        for f, w in zip(facts, whole))
    if plan.mode == "together":
        return _fork_join(pool_a, pool_b, ab, ba, (ab_plan, ba_plan))
    if plan.mode == "a_to_b_first":
        new_b = block_copy_call(pool_b, pool_a, *ab, ab_plan)
        return block_copy_call(pool_a, new_b, *ba, ba_plan), new_b
    if plan.mode == "b_to_a_first":
        new_a = block_copy_call(pool_a, pool_b, *ba, ba_plan)
        return new_a, block_copy_call(pool_b, new_a, *ab, ab_plan)
    # staged: a->b's source blocks read out into a device buffer (by the kernel: these indices
    # are computed here, not host-resident), then b->a, then a->b from the buffer
    # (each in-place write takes the result of the read before it as an extra operand: without
    # that order XLA would keep the read safe by copying the pool)
    src, dst, tokens = ab
    valid = (src >= 0) & (src < pool_a.shape[0]) & (dst >= 0) & (dst < pool_b.shape[0])
    slot = jnp.where(valid, jnp.arange(src.shape[0], dtype=jnp.int32), -1)
    buffer = jnp.zeros((src.shape[0], *pool_a.shape[1:]), pool_a.dtype)
    buffer = block_copy_call(buffer, pool_a, src, slot, jnp.zeros_like(slot),
                             CopyPlan(IndexFacts(True, True), max_ctas=max_ctas))
    new_a = _copy_after(pool_a, pool_b, ba, ba_plan, buffer)
    new_b = _copy_after(pool_b, buffer, (slot, dst, tokens),
                        CopyPlan(ab_plan.facts, max_ctas=max_ctas), new_a)
    return new_a, new_b


def _copy_after(dst_pool, src_pool, idx, plan: CopyPlan, after):
    """One copy that XLA runs after `after` was made (the join target, with nothing to wait
    for: `after` is only an extra operand)."""
    call = jax.ffi.ffi_call(_native.BLOCK_COPY_JOIN_TARGET,
                            copy_results(dst_pool, idx[0].shape[0]),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(dst_pool, src_pool, *idx, after, **_cross_pool(plan, wait=np.bool_(False)))[0]


@functools.lru_cache(maxsize=64)
def _eager_fn(shardings: tuple[Any, Any], facts: tuple[IndexFacts, IndexFacts],
              plan: BothWaysPlan, donate: bool, max_ctas: int | None, dma: bool,
              whole: tuple[bool, bool]):
    def fn(a, b, *idx):
        return both_ways_call(a, b, idx[:3], idx[3:], facts, plan, max_ctas, dma, whole)
    if is_split(shardings[0]):
        spec, replicated = shardings[0].spec, jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, mesh=shardings[0].mesh,
                           in_specs=(spec, spec) + (replicated,) * 6, out_specs=(spec, spec))
    return jax.jit(fn, out_shardings=shardings, donate_argnums=(0, 1) if donate else ())


def copy_blocks_both_ways(
    pool_a: jax.Array,
    pool_b: jax.Array,
    a_to_b_src: IndexLike,
    a_to_b_dst: IndexLike,
    b_to_a_src: IndexLike,
    b_to_a_dst: IndexLike,
    *,
    a_to_b_tokens: TokensLike = None,
    b_to_a_tokens: TokensLike = None,
    donate: bool = False,
    max_ctas: int | None = None,
    dma: bool = False,
    disjoint: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Copies blocks from `pool_a` into `pool_b` and from `pool_b` into `pool_a`: an offload
    and an onboard between a GPU pool and a host pool, at the same time on a GPU.

    Semantics: exactly `(copy_blocks(pool_a, pool_b, b_to_a_src, b_to_a_dst, b_to_a_tokens),
    copy_blocks(pool_b, pool_a, a_to_b_src, a_to_b_dst, a_to_b_tokens))` computed from the pools
    as they were. With known indices where no block is written by one direction and read by the
    other, the two directions run at the same time on a GPU (one on a side stream); otherwise,
    and with traced indices, one after the other (module docstring).

    Args:
      pool_a, pool_b: two different pools of one block shape and dtype, in `device` or
        `pinned_host` memory. Inside `jax.jit`, donate both for an in-place update.
      a_to_b_src, a_to_b_dst: block indices into `pool_a` and `pool_b` (one length).
      b_to_a_src, b_to_a_dst: block indices into `pool_b` and `pool_a` (one length).
      a_to_b_tokens, b_to_a_tokens: as `copy_blocks`' `num_tokens`, per direction.
      donate: outside jit only: consume both pools and update them in place.
      max_ctas: as `copy_blocks`; None: `HOST_COPY_CTAS` per direction when a pool is in
        pinned_host memory (so that both directions fit on the GPU at once).
      dma: as `copy_blocks`: both directions on the copy engines (one pool in device and one in
        pinned_host memory; inside jit, every index and token vector a pinned_host argument).
      disjoint: the caller's promise that no block is written by one direction and read by the
        other, so that the two run at the same time even with traced indices (with `dma=True`
        inside jit they always are). Checked where the indices are known; with traced indices
        a broken promise gives undefined blocks.

    Returns:
      `(new_pool_a, new_pool_b)`.

    Raises:
      As `copy_blocks`, naming the argument; ValueError when `pool_a` is `pool_b`, or with
      `disjoint=True` when known indices clash.
    """
    check_pool("pool_a", pool_a, POOL_RANK)
    check_pool("pool_b", pool_b, POOL_RANK)
    check_same_blocks(pool_a, pool_b, "pool_a", "pool_b", lead=1)
    if pool_a is pool_b:
        raise ValueError("pool_a and pool_b must be two different arrays; to copy within one "
                         "pool use copy_blocks(pool, pool, ...)")
    check_launch_options(max_ctas, None)
    for name, flag in (("dma", dma), ("disjoint", disjoint)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    idx = []
    for src_name, dst_name, src, dst, tokens_name, tokens in (
            ("a_to_b_src", "a_to_b_dst", a_to_b_src, a_to_b_dst, "a_to_b_tokens", a_to_b_tokens),
            ("b_to_a_src", "b_to_a_dst", b_to_a_src, b_to_a_dst, "b_to_a_tokens", b_to_a_tokens)):
        si, di = as_index_array(src_name, src), as_index_array(dst_name, dst)
        if si.shape[0] != di.shape[0]:
            raise ValueError(f"{src_name} has length {si.shape[0]} but {dst_name} has length "
                             f"{di.shape[0]}")
        try:
            nt = normalize_tokens(tokens, si.shape[0])
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("num_tokens", tokens_name)) from None
        idx.append((si, di, nt))
    (ab_si, ab_di, ab_nt), (ba_si, ba_di, ba_nt) = idx
    may_be_partial = (may_copy_partial(ab_nt, pool_a.shape[4]),
                      may_copy_partial(ba_nt, pool_a.shape[4]))
    check_byte_rows(pool_a.shape[1:], pool_a.dtype, any(may_be_partial))
    known = [concrete(x) for x in (ab_si, ab_di, ba_si, ba_di)]
    check_in_range("a_to_b_src", known[0], pool_a.shape[0], "pool_a")
    check_in_range("a_to_b_dst", known[1], pool_b.shape[0], "pool_b")
    check_in_range("b_to_a_src", known[2], pool_b.shape[0], "pool_b")
    check_in_range("b_to_a_dst", known[3], pool_a.shape[0], "pool_a")
    check_platform(pool_a, pool_b)
    check_split(pool_a, pool_b, "pool_a", "pool_b")
    facts = (index_facts(known[0], known[1], pool_a.shape[0], pool_b.shape[0]),
             index_facts(known[2], known[3], pool_b.shape[0], pool_a.shape[0]))
    plan = both_ways_plan(*known, pool_a.shape[0], pool_b.shape[0])
    if disjoint:
        if plan.mode != "together" and all(k is not None for k in known):
            raise ValueError("disjoint=True, but a block is written by one direction and read "
                             f"by the other (the copy would need plan {plan.mode!r})")
        plan = BothWaysPlan("together")
    if max_ctas is None and touches_host(pool_a, pool_b):
        max_ctas = HOST_COPY_CTAS
    max_ctas = None if max_ctas is None else int(max_ctas)
    args = (ab_si, ab_di, ab_nt, ba_si, ba_di, ba_nt)
    traced = any(is_tracer(x) for x in (pool_a, pool_b, *args))
    whole = (not may_be_partial[0], not may_be_partial[1])
    if dma:
        if not traced:
            if is_split(pool_a.sharding):
                raise ValueError("dma=True does not take pools split over several devices")
            args = put_in_pinned_host(args, pool_a)
        names = ("a_to_b_src", "a_to_b_dst", "num_tokens", "b_to_a_src", "b_to_a_dst",
                 "num_tokens")
        for k, (dst, src) in enumerate(((pool_b, pool_a), (pool_a, pool_b))):
            try:
                check_dma(dst, src, dict(zip(names[3 * k:3 * k + 3], args[3 * k:3 * k + 3])),
                          whole[k], ("pool_b", "pool_a") if k == 0 else ("pool_a", "pool_b"))
            except ValueError as e:
                raise ValueError(str(e).replace(
                    "num_tokens", ("a_to_b_tokens", "b_to_a_tokens")[k])) from None
    if traced:
        return both_ways_call(pool_a, pool_b, args[:3], args[3:], facts, plan, max_ctas,
                              bool(dma), whole)
    fn = _eager_fn((pool_a.sharding, pool_b.sharding), facts, plan, bool(donate), max_ctas,
                   bool(dma), whole)
    return fn(pool_a, pool_b, *args)


