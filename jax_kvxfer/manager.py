"""The transfer manager: onboard/offload/copy blocks between primary and secondary pools.

Every transfer consumes the pool arrays it touches and produces new ones (the destination is
donated and updated in place), so JAX's own buffer dependencies order the dispatches exactly as
the calls were made. On a GPU the copies themselves run on the transfer lanes (lanes.py),
TensorRT-LLM's side streams: beside the model step, joined by `sync_transfers`. The manager
tracks which slots the lanes' pending copies touch, and has a lane wait for the other (or XLA's
stream for a lane) only where two copies touch one slot. `pending_transfers` makes that
bookkeeping visible.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ._checks import IndexFacts, check_dma_choice, index_facts
from ._jax_seams import pinned_by_external_reference
from ._lowering import HOST_COPY_CTAS, block_copy_call
from .batch import PairBatch, check_batch, check_direction, check_index_batch, split_runs
from .both_ways import BothWaysPlan, both_ways_call, both_ways_plan
from .lanes import (
    NO_LANE,
    OFFLOAD_LANE,
    ONBOARD_LANE,
    join_call,
    lane_copy_call,
    lanes_idle,
    layer_lane_copy_call,
    take_exposed_seconds,
    wait_lanes,
)
from .layers import manager_copy, manager_copy_within
from .plan_ring import PlanRing, PlanSlot
from .pool import KVCacheBlock, KVCacheBlockPool

Slot = tuple[int, bool]  # (memory_pool_block_index, is_primary)


@dataclasses.dataclass
class TransferStats:
    """Blocks and bytes moved since the last `get_and_reset_transfer_stats` (bytes: all pools).

    TensorRT-LLM: the transfer manager's onboard/offload/intra-device statistics.
    """

    onboarded_blocks: int = 0  # pinned host -> device
    onboarded_bytes: int = 0
    offloaded_blocks: int = 0  # device -> pinned host
    offloaded_bytes: int = 0
    copied_blocks: int = 0  # within one memory (e.g. a partial-reuse copy on the device)
    copied_bytes: int = 0
    # GPU seconds XLA's stream spent on the transfer lanes' account: waiting at syncs for
    # copies compute did not hide, and taking offload snapshots (lanes.py). Over the work of
    # this process's managers that has finished; 0.0 without lanes. Not compared by ==.
    exposed_seconds: float = dataclasses.field(default=0.0, compare=False)


@dataclasses.dataclass(frozen=True)
class PendingTransfer:
    """What the transfers issued since the last sync do to one memory slot."""

    reads: int  # copies that read the slot
    writes: int  # copies that write it
    ops: tuple[str, ...]  # 'offload' / 'onboard' of each of those copies, in call order


# One jitted dispatch per batch covers every pool: one custom call per pool, the destinations
# donated so that each copy happens in place. `plan` holds the source indices, destination
# indices and token counts: three pinned-host arrays from the plan ring (plan_ring.py), or one
# [3, B] NumPy array where there is no pinned_host memory. `specs` holds each pool's
# PartitionSpec over `mesh` (None: unsharded): a sharded pool is copied by every device on its
# own shard, with no traffic between devices.
#
# Besides the pools, a dispatch takes donated and hands back unchanged the tokens of the plan
# ring slots it reads (plan_ring.py): XLA aliases them to outputs, so no op runs for them, and
# each returned token is ready when the dispatch has run. Without the ring, tokens are None.
def _on_shards(fn, mesh, spec, num_pools: int):
    if spec is None:
        return fn
    whole = jax.sharding.PartitionSpec()
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_pools + (whole,), out_specs=spec)


def _copy_across_impl(dsts, srcs, plan, token, facts, mesh, specs, dma=None, whole=False,
                      layers=None):
    """dma: per pool, whether its copy goes to the copy engines (None: none does); whole:
    every pair copies a whole block; layers: per pool, its LayerViews (None: none has)."""
    pools = []
    for d, s, spec, use_dma, views in zip(dsts, srcs, specs, dma or (False,) * len(dsts),
                                          layers or (None,) * len(dsts)):
        if views is not None:  # an engine's arrays (a list) and the host rows
            pools.append(manager_copy(d, s, plan, views=views, mesh=mesh,
                                      unique_dst=facts.unique_dst, dma=use_dma, whole=whole))
            continue

        def copy(d, s, p, use_dma=use_dma):
            return block_copy_call(d, s, p[0], p[1], p[2], facts, dma=use_dma, whole_blocks=whole)
        pools.append(_on_shards(copy, mesh, spec, 2)(d, s, plan))
    return tuple(pools), token


def _copy_within_impl(pools, plan, token, facts, mesh, specs, whole=False, layers=None):
    def copy(pool, p):
        return block_copy_call(pool, pool, p[0], p[1], p[2], facts, whole_blocks=whole)
    out = []
    for pool, spec, views in zip(pools, specs, layers or (None,) * len(pools)):
        if views is None:
            out.append(_on_shards(copy, mesh, spec, 1)(pool, plan))
        else:  # an engine's arrays
            out.append(manager_copy_within(pool, plan, facts, views=views, mesh=mesh,
                                           whole=whole))
    return tuple(out), token


def _both_ways_impl(gpus, hosts, offload_plan, onboard_plan, tokens, facts, plan, mesh, specs,
                    dma=None):
    """Per pool, an offload (GPU -> host) and an onboard (host -> GPU) at once; dma: per pool,
    whether both go to the copy engines (None: none does)."""
    results = []
    for g, h, spec, use_dma in zip(gpus, hosts, specs, dma or (False,) * len(gpus)):
        def copy(g, h, off, on, use_dma=use_dma):
            return both_ways_call(g, h, off, on, facts, plan, HOST_COPY_CTAS, dma=use_dma)
        if spec is not None:
            replicated = jax.sharding.PartitionSpec()
            copy = jax.shard_map(copy, mesh=mesh, in_specs=(spec, spec, replicated, replicated),
                                 out_specs=(spec, spec))
        results.append(copy(g, h, offload_plan, onboard_plan))
    return tuple(r[0] for r in results), tuple(r[1] for r in results), tokens


def _lane_across_impl(dsts, srcs, plan, token, lane, wait_lane, stream_wait_lane, whole,
                      layers=None):
    lanes = {"lane": lane, "wait_lane": wait_lane, "stream_wait_lane": stream_wait_lane,
             "whole_blocks": whole}
    pools = []
    for d, s, views in zip(dsts, srcs, layers or (None,) * len(dsts)):
        if views is None:  # within one pool when d is s: one traced value
            pools.append(lane_copy_call(d, s, plan[0], plan[1], plan[2], **lanes))
        elif d is s:  # an engine's arrays, each within itself in its own layout
            pools.append(manager_copy_within(d, plan, None, views=views, mesh=None, whole=whole,
                                             copy=functools.partial(_lane_within_view, **lanes)))
        else:  # an engine's arrays and their host rows
            offload = not isinstance(d, list)
            pools.append(layer_lane_copy_call(d if offload else s, s if offload else d, plan[0],
                                              plan[1], plan[2], offload=offload, views=views,
                                              **lanes))
    return tuple(pools), token


def _lane_within_view(view, src_idx, dst_idx, tokens, facts, **lanes):
    return lane_copy_call(view, view, src_idx, dst_idx, tokens, **lanes)


def _lane_within_impl(pools, plan, token, lane, wait_lane, stream_wait_lane, whole, layers=None):
    # each pool is its own source: one traced value, which lane_copy_call copies within
    return _lane_across_impl(pools, pools, plan, token, lane, wait_lane, stream_wait_lane, whole,
                             layers)


def _join_impl(arrays, lanes):
    return tuple(join_call(a, lanes) for a in arrays)


_LANE_STATIC = ("lane", "wait_lane", "stream_wait_lane", "whole", "layers")
_lane_across = jax.jit(_lane_across_impl, donate_argnums=(0, 3), static_argnames=_LANE_STATIC)
_lane_within = jax.jit(_lane_within_impl, donate_argnums=(0, 2), static_argnames=_LANE_STATIC)
_lane_across_undonated = jax.jit(_lane_across_impl, donate_argnums=3,
                                 static_argnames=_LANE_STATIC)
_lane_within_undonated = jax.jit(_lane_within_impl, donate_argnums=2,
                                 static_argnames=_LANE_STATIC)
_join = jax.jit(_join_impl, donate_argnums=0, static_argnames="lanes")
_join_undonated = jax.jit(_join_impl, static_argnames="lanes")

_STATIC = ("facts", "mesh", "specs", "layers")
_copy_across = jax.jit(_copy_across_impl, donate_argnums=(0, 3),
                       static_argnames=_STATIC + ("dma", "whole"))
_copy_within = jax.jit(_copy_within_impl, donate_argnums=(0, 2),
                       static_argnames=_STATIC + ("whole",))
# The same without donating the pools, for a destination that cannot be donated: on GPUs,
# reading a pinned_host array with NumPy (np.asarray) leaves JAX holding a zero-copy view of it,
# and a viewed buffer cannot be donated. XLA then copies the pool: correct, but not in place.
_copy_across_undonated = jax.jit(_copy_across_impl, donate_argnums=3,
                                 static_argnames=_STATIC + ("dma", "whole"))
_copy_within_undonated = jax.jit(_copy_within_impl, donate_argnums=2,
                                 static_argnames=_STATIC + ("whole",))
_BOTH_STATIC = ("facts", "mesh", "specs", "plan", "dma")
_both_ways = jax.jit(_both_ways_impl, donate_argnums=(0, 1, 4), static_argnames=_BOTH_STATIC)
_both_ways_undonated = jax.jit(_both_ways_impl, donate_argnums=4, static_argnames=_BOTH_STATIC)


class DonationWarning(UserWarning):
    """A pool array could not be donated, so a transfer copied the whole pool."""


def _tokens(slots: Sequence[PlanSlot | None], retry: bool = False) -> tuple[Any, ...]:
    """The tokens a dispatch reading these plan ring slots donates (None for a NumPy plan).
    retry: after a dispatch that failed, which may have consumed them."""
    if retry:
        for slot in slots:
            if slot is not None:
                slot.fresh_token()
    return tuple(None if slot is None else slot.token for slot in slots)


def _dispatched(slots: Sequence[PlanSlot | None], tokens: Sequence[Any]) -> None:
    for slot, token in zip(slots, tokens):
        if slot is not None:
            slot.dispatched(token)


def _warn_not_in_place(which: str, stacklevel: int) -> None:
    """stacklevel: of the user's call, counted from this function."""
    warnings.warn(
        f"pool.{which} could not be updated in place because a NumPy view of it exists "
        "(np.asarray on a host-memory array keeps one); this transfer copied the whole pool "
        "instead. Read pools with jax_kvxfer.to_numpy.", DonationWarning, stacklevel=stacklevel)


def _facts_across(batch: PairBatch) -> IndexFacts:
    """Source and destination are different arrays: only duplicate writes matter."""
    return IndexFacts(hazard_free=True, unique_dst=batch.unique_dst)


def _bucket(n: int) -> int:
    """Batch sizes are padded to powers of two so a new batch size rarely recompiles."""
    return 1 << max(0, n - 1).bit_length()


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


class KVCacheTransferManager:
    """Moves blocks between the primary (GPU) and secondary (pinned host) memory of its pools.

    TensorRT-LLM: `KVCacheTransferManager` (`onboard`, `offload`, `syncTransfers`). A logical
    block spans every pool, so each transfer copies the block in all of them.

    Every method returns without waiting for the copies; all that a program can observe is as
    if the transfers ran one after another in call order. Methods are thread-safe (one lock).
    """

    def __init__(self, pools: Sequence[KVCacheBlockPool], *, plan_ring: bool = True,
                 dma: bool | str = "auto") -> None:
        """Args:
          pools: one or more pools with equal block counts and tokens per block.
          plan_ring: pass block indices through a ring of `pinned_host` arrays that the copy
            kernel reads in place (plan_ring.py; saves a host-to-device transfer per call).
            False: send them as NumPy arrays, which JAX moves to the device with each call.
            Both copy the same; the ring relies on JAX handing a pinned_host array's own
            buffer to the custom call, so False is the way out should a JAX version not.
          dma: how the blocks move on a GPU. True or "auto" (default): on the transfer lanes
            with the copy engines, beside the model step (lanes.py), where the pools are on one
            device and the plan ring is on; "auto" falls back to the copy kernel on XLA's
            stream for sharded pools or plan_ring=False, True raises there. False: the copy
            kernel on XLA's stream, in line with compute (no lanes).
        """
        check_dma_choice(dma)
        if isinstance(pools, KVCacheBlockPool):
            pools = [pools]
        self._pools = tuple(pools)
        if not self._pools:
            raise ValueError("pools must hold at least one KVCacheBlockPool")
        for i, p in enumerate(self._pools):
            if not isinstance(p, KVCacheBlockPool):
                raise TypeError(f"pools[{i}] must be a KVCacheBlockPool, got {type(p).__name__}")
        if len({id(p) for p in self._pools}) != len(self._pools):
            raise ValueError("pools holds the same KVCacheBlockPool twice; pass each pool once")
        first = self._pools[0]
        for i, p in enumerate(self._pools[1:], start=1):
            for field in ("num_primary_blocks", "num_secondary_blocks", "tokens_per_block",
                          "device", "mesh", "kv_head_axis"):
                if getattr(p, field) != getattr(first, field):
                    raise ValueError(
                        f"pools[{i}].{field} is {getattr(p, field)}, but pools[0].{field} is "
                        f"{getattr(first, field)}: the pools of one manager must agree on it"
                    )
        self._lock = threading.RLock()
        # Batches issued since the last sync; `pending_transfers` is derived from them only
        # when asked, which keeps that bookkeeping off every transfer's path.
        self._issued: list[tuple[str, PairBatch]] = []
        self._stats = TransferStats()
        # Bytes one pair moves in all pools: a whole block, or per token of a partial copy.
        self._block_nbytes = sum(p.block_nbytes for p in self._pools)
        self._token_nbytes = sum(p.token_run_nbytes(1) for p in self._pools)
        dma = dma if isinstance(dma, str) else bool(dma)
        if dma is True and not plan_ring:
            raise ValueError("dma=True needs plan_ring=True: the copy engines are handed the "
                             "block indices from the plan ring's pinned_host arrays")
        if dma is True and first.mesh is not None:
            raise ValueError("dma=True takes pools on one device; these are sharded over "
                             f"{first.mesh.size} devices")
        layers = tuple(p.layers for p in self._pools)
        self._static = {"mesh": first.mesh, "specs": tuple(p.partition_spec for p in self._pools)}
        self._layers = layers if any(v is not None for v in layers) else None
        ring_sharding = PlanRing.sharding_for(first.sharding("device")) if plan_ring else None
        self._plans = PlanRing(ring_sharding) if ring_sharding is not None else None
        # The transfer lanes (lanes.py), and per slot whether a pending lane copy touches it:
        # lane 1 writes primary slots and reads secondary ones, lane 0 writes secondary ones
        # (its reads of primary slots are over once its snapshot is taken, on XLA's stream).
        self._lanes = dma is not False and self._plans is not None and first.mesh is None
        self._lanes_async = self._lanes and first.device.platform == "gpu"
        if self._lanes_async:
            # A manager dropped with copies in flight: its pools' arrays (which it holds) must
            # outlive the copies, so the last moment it exists waits for the lanes.
            weakref.finalize(self, wait_lanes)
        self._onboards_pending = self._offloads_pending = False
        # What a pool calls when user code reads or assigns an array the lanes still use
        # (KVCacheBlockPool.hold_for_lanes); weak, so that pools do not keep their manager.
        this = weakref.ref(self)
        self._join_for_user = lambda name: (m := this()) is not None and m._user_join(name)
        self._onboard_writes = np.zeros(first.num_primary_blocks, np.bool_)
        self._onboard_reads = np.zeros(first.num_secondary_blocks, np.bool_)
        self._offload_writes = np.zeros(first.num_secondary_blocks, np.bool_)

    @property
    def pools(self) -> tuple[KVCacheBlockPool, ...]:
        return self._pools

    @property
    def on_lanes(self) -> bool:
        """Whether the copies run on a GPU's transfer lanes, beside compute (lanes.py)."""
        return self._lanes_async

    # -- the verbs ---------------------------------------------------------------------------

    def offload(self, block: KVCacheBlock, offload_block: KVCacheBlock,
                num_tokens: int = 0) -> None:
        """Copies `block` into `offload_block` (normally primary -> secondary).

        TensorRT-LLM: `KVCacheTransferManager::offload`.

        Args:
          block, offload_block: source and destination; direction follows their `is_primary`.
          num_tokens: copy the first n tokens; n <= 0 or n >= tokens_per_block: whole block.

        Raises:
          TypeError, ValueError, IndexError: bad blocks or num_tokens; nothing is copied.
        """
        self._transfer("offload", [(block, offload_block)], [_as_int("num_tokens", num_tokens)])

    def onboard(self, offload_block: KVCacheBlock, block: KVCacheBlock,
                num_tokens: int = 0) -> None:
        """Copies `offload_block` into `block` (secondary -> primary, or primary -> primary).

        TensorRT-LLM: `KVCacheTransferManager::onboard` (an onboard from a primary block is
        the intra-device copy of partial reuse). Arguments and errors as for `offload`.
        """
        self._transfer("onboard", [(offload_block, block)], [_as_int("num_tokens", num_tokens)])

    def offload_blocks(self, pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                       num_tokens: None | int | Sequence[int] = None) -> None:
        """Batched `offload` of `(src_block, dst_block)` pairs: one copy per pool per batch.

        Args:
          pairs: `(src_block, dst_block)` tuples, applied as if one after another.
          num_tokens: None (whole blocks), one int for all pairs, or one int per pair.
        """
        self._transfer("offload", pairs, num_tokens)

    def onboard_blocks(self, pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                       num_tokens: None | int | Sequence[int] = None) -> None:
        """Batched `onboard`; arguments as for `offload_blocks`."""
        self._transfer("onboard", pairs, num_tokens)

    def offload_indices(self, src: Any, dst: Any,
                        num_tokens: None | int | Sequence[int] | np.ndarray = None) -> None:
        """`offload_blocks` for engines that hold slots in arrays: primary slots `src[i]` ->
        secondary slots `dst[i]`.

        Args:
          src, dst: integer NumPy arrays (or sequences) of one length.
          num_tokens: None (whole blocks), an int for every pair, or one per pair.

        Raises:
          TypeError, ValueError, IndexError: naming `src`, `dst` or `num_tokens`; nothing is
          copied.
        """
        self._transfer_indices("offload", src, dst, num_tokens, True, False)

    def onboard_indices(self, src: Any, dst: Any,
                        num_tokens: None | int | Sequence[int] | np.ndarray = None) -> None:
        """`onboard_blocks` for slot arrays: secondary slots `src[i]` -> primary slots
        `dst[i]`. Arguments and errors as for `offload_indices`."""
        self._transfer_indices("onboard", src, dst, num_tokens, False, True)

    def offload_and_onboard(self, offload_pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                            onboard_pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                            offload_tokens: None | int | Sequence[int] = None,
                            onboard_tokens: None | int | Sequence[int] = None) -> None:
        """`offload_blocks(offload_pairs)` then `onboard_blocks(onboard_pairs)`, with both
        directions of PCIe busy at once where that gives the same result.

        On a GPU the two run at the same time (`copy_blocks_both_ways` per pool) when every
        offload goes primary -> secondary, every onboard secondary -> primary, no onboard reads
        a secondary slot that an offload writes (it must then see the offloaded data, so the two
        run one after the other) and no onboard writes a primary block that an offload reads
        (the common case of reusing an evicted block at once: the offload then runs first, in
        the same dispatch).

        Args:
          offload_pairs, onboard_pairs, offload_tokens, onboard_tokens: as for
            `offload_blocks` / `onboard_blocks`.

        Raises:
          TypeError, ValueError, IndexError: bad blocks or token counts in either list;
          nothing is copied.
        """
        with self._lock:
            off = self._checked("offload", offload_pairs, offload_tokens, "offload_pairs")
            on = self._checked("onboard", onboard_pairs, onboard_tokens, "onboard_pairs")
            # On the lanes both directions run at once anyway (lane 1 waits for lane 0 only
            # where an onboard reads a slot that an offload writes).
            if (len(off) and len(on) and not self._lanes and self._layers is None
                    and self._one_run_each_way(off, on)):
                self._dispatch_both_ways(off, on)
                self._count(off)
                self._count(on)
                self._issued += [("offload", off), ("onboard", on)]
                return
            for op, batch in (("offload", off), ("onboard", on)):
                if len(batch):
                    self._issue(op, batch)

    def sync_transfers(self, block: bool = True) -> None:
        """The step boundary: compute dispatched after it sees every transfer issued so far.

        TensorRT-LLM: `syncTransfers`. Clears `pending_transfers`.

        Args:
          block: wait on the host until every transfer is done and the pools' arrays are
            ready. False: return at once; on a GPU, XLA's stream waits for the onboards and
            copies within the GPU pool (what compute reads) before anything dispatched later,
            and offloads go on in the background: compute never reads what they write, and a
            later onboard from their slots waits for them on the GPU. (Read the secondary
            pool with `to_numpy`, which waits for them, or after a blocking sync.)
        """
        with self._lock:
            self._issued.clear()
            if not block:
                self._join_lanes(everything=False)
                return
            # Once the pools' arrays are ready, every lane copy is enqueued; once the lanes are
            # idle, all is done, and later work needs no join on XLA's stream.
            arrays = jax.tree.leaves([(p.stored(True), p.stored(False)) for p in self._pools])
            jax.block_until_ready([a for a in arrays if not a.is_deleted()])
            if self._onboards_pending or self._offloads_pending:
                wait_lanes()
                self._onboards_done()
                self._offloads_done()
            if self._plans is not None:
                self._plans.all_done()

    @property
    def pending_transfers(self) -> Mapping[Slot, PendingTransfer]:
        """Slots touched since the last sync, keyed by `(memory_pool_block_index, is_primary)`.

        Keyed by memory slot, not logical block id: TensorRT-LLM's id keying let two blocks
        offloaded into one secondary slot race. A read-only snapshot.
        """
        with self._lock:
            records: dict[Slot, list] = {}  # slot -> [reads, writes, [op, ...]]
            for op, batch in self._issued:
                for i in range(len(batch)):
                    for slot, kind in (((int(batch.src[i]), bool(batch.src_primary[i])), 0),
                                       ((int(batch.dst[i]), bool(batch.dst_primary[i])), 1)):
                        record = records.setdefault(slot, [0, 0, []])
                        record[kind] += 1
                        record[2].append(op)
            return types.MappingProxyType({
                slot: PendingTransfer(reads, writes, tuple(ops))
                for slot, (reads, writes, ops) in records.items()})

    def get_and_reset_transfer_stats(self) -> TransferStats:
        """Returns the blocks and bytes moved since the last call and starts counting anew."""
        with self._lock:
            stats, self._stats = self._stats, TransferStats()
            stats.exposed_seconds = take_exposed_seconds()
            return stats

    # -- implementation ----------------------------------------------------------------------

    def _transfer(self, op: str, pairs: Sequence[Any], num_tokens: Any) -> None:
        with self._lock:
            batch = self._checked(op, pairs, num_tokens)
            if len(batch):
                self._issue(op, batch)

    def _transfer_indices(self, op: str, src: Any, dst: Any, num_tokens: Any,
                          src_primary: bool, dst_primary: bool) -> None:
        with self._lock:
            first = self._pools[0]
            batch = check_index_batch(src, dst, num_tokens, src_primary, dst_primary,
                                      first.num_primary_blocks, first.num_secondary_blocks,
                                      first.tokens_per_block)
            if len(batch):
                self._check_live(op, batch)
                self._issue(op, batch)

    def _checked(self, op: str, pairs: Sequence[Any], num_tokens: Any,
                 name: str = "pairs") -> PairBatch:
        """The batch, checked against every pool and against the verb's direction; raises
        before anything is dispatched. name: the argument that holds the pairs."""
        first = self._pools[0]
        batch = check_batch(pairs, num_tokens, first.num_primary_blocks,
                            first.num_secondary_blocks, first.tokens_per_block)
        check_direction(op, name, pairs, batch)
        if len(batch):
            self._check_live(op, batch)
        return batch

    def _check_live(self, op: str, batch: PairBatch) -> None:
        """Byte rows for partial copies, and every array live, before anything is dispatched."""
        if not batch.whole:
            for pool in self._pools:
                pool.check_partial()
        memories = (set(batch.direction) if batch.direction is not None else
                    set(batch.src_primary.tolist()) | set(batch.dst_primary.tolist()))
        for pool in self._pools:
            for is_primary in memories:
                pool.current(is_primary, op)

    def _issue(self, op: str, batch: PairBatch) -> None:
        runs = split_runs(batch)
        for rows in runs:
            run = batch if len(runs) == 1 else batch.take(rows)
            self._dispatch(run)
            self._count(run)
        self._issued.append((op, batch))

    @staticmethod
    def _one_run_each_way(off: PairBatch, on: PairBatch) -> bool:
        """Offloads all primary -> secondary, onboards all secondary -> primary, and no onboard
        reads a secondary slot that an offload writes."""
        return (off.direction == (True, False) and on.direction == (False, True)
                and not set(on.src.tolist()) & set(off.dst.tolist()))

    def _plan_arrays(self, run: PairBatch) -> tuple[Any, Any]:
        """(what to pass for the run's [3, bucket] plan, its ring slot or None)."""
        n = len(run)
        if self._plans is None:
            plan = np.full((3, _bucket(n)), -1, np.int32)  # -1: a padding pair, skipped
            plan[0, :n], plan[1, :n], plan[2, :n] = run.src, run.dst, run.tokens
            return plan, None
        slot = self._plans.next_slot(_bucket(n))
        return slot.write((run.src, run.dst, run.tokens)), slot

    def _dispatch_both_ways(self, off: PairBatch, on: PairBatch) -> None:
        """One jitted call per manager: each pool offloads and onboards in one custom call."""
        (off_plan, off_slot), (on_plan, on_slot) = self._plan_arrays(off), self._plan_arrays(on)
        first = self._pools[0]
        facts = (_facts_across(off), _facts_across(on))
        plan: BothWaysPlan = both_ways_plan(off.src, off.dst, on.src, on.dst,
                                            first.num_primary_blocks, first.num_secondary_blocks)
        gpus = tuple(p.current(True, "transfer") for p in self._pools)
        hosts = tuple(p.current(False, "transfer") for p in self._pools)
        slots = (off_slot, on_slot)
        args = (gpus, hosts, tuple(off_plan), tuple(on_plan))
        kw = {"facts": facts, "plan": plan, **self._static}
        try:
            new_gpus, new_hosts, tokens = _both_ways(*args, _tokens(slots), **kw)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if not pinned_by_external_reference(e):
                raise
            _warn_not_in_place("primary and secondary", stacklevel=4)
            new_gpus, new_hosts, tokens = _both_ways_undonated(*args, _tokens(slots, True), **kw)
        _dispatched(slots, tokens)
        for pool, g, h in zip(self._pools, new_gpus, new_hosts):
            pool.take_copy_result(True, g)
            pool.take_copy_result(False, h)

    def _dispatch(self, run: PairBatch) -> None:
        """One jitted copy per pool for a run of one direction."""
        src_primary, dst_primary = run.direction  # a run has one (split_runs)
        first = self._pools[0]
        if self._lanes and (src_primary or dst_primary):
            self._dispatch_on_lane(run)
            return
        self._join_lanes(everything=True)  # a copy on XLA's stream comes after the lanes' copies
        plan_arg, slot = self._plan_arrays(run)
        dsts = tuple(p.current(dst_primary, "transfer") for p in self._pools)
        if src_primary == dst_primary:
            blocks = first.num_primary_blocks if dst_primary else first.num_secondary_blocks
            facts = index_facts(run.src, run.dst, blocks, blocks)
            args = (dsts, plan_arg)
            donated, undonated = _copy_within, _copy_within_undonated
        else:
            srcs = tuple(p.current(src_primary, "transfer") for p in self._pools)
            facts = _facts_across(run)
            args = (dsts, srcs, plan_arg)
            donated, undonated = _copy_across, _copy_across_undonated
        static = dict(self._static, facts=facts, whole=run.whole, layers=self._layers)
        self._run_copy(donated, undonated, args, slot, static, dst_primary)

    def _run_copy(self, donated: Any, undonated: Any, args: tuple, slot: PlanSlot | None,
                  static: dict[str, Any], dst_primary: bool) -> None:
        """Dispatches a copy of every pool, in place, or (a NumPy view pins the destination)
        copying the pool, with a warning; the results become the pools' arrays."""
        try:
            results, (token,) = donated(*args, _tokens((slot,)), **static)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if not pinned_by_external_reference(e):
                raise
            # from the user: offload_blocks -> _transfer -> _issue -> _dispatch(_on_lane) ->
            # _run_copy -> here
            _warn_not_in_place("primary" if dst_primary else "secondary", stacklevel=7)
            results, (token,) = undonated(*args, _tokens((slot,), True), **static)
        _dispatched((slot,), (token,))
        for pool, result in zip(self._pools, results):
            pool.take_copy_result(dst_primary, result)

    def _dispatch_on_lane(self, run: PairBatch) -> None:
        """One jitted lane copy per pool for a run with a primary side (lanes.py)."""
        src_primary, dst_primary = run.direction
        wait_lane = stream_wait_lane = NO_LANE
        if not dst_primary:  # an offload
            lane = OFFLOAD_LANE
            if self._onboard_reads[run.dst].any():  # overwrites what an onboard still reads
                wait_lane = ONBOARD_LANE
            if self._onboard_writes[run.src].any():  # snapshots what an onboard still writes
                stream_wait_lane = ONBOARD_LANE
        else:  # an onboard, or a copy within the GPU pool
            lane = ONBOARD_LANE
            if not src_primary and self._offload_writes[run.src].any():
                wait_lane = OFFLOAD_LANE  # reads what an offload still writes
        plan_arg, slot = self._plan_arrays(run)
        dsts = tuple(p.current(dst_primary, "transfer") for p in self._pools)
        static = {"lane": lane, "wait_lane": wait_lane, "stream_wait_lane": stream_wait_lane,
                  "whole": run.whole, "layers": self._layers}
        if src_primary == dst_primary:
            args = (dsts, plan_arg)
            donated, undonated = _lane_within, _lane_within_undonated
        else:
            args = (dsts, tuple(p.current(src_primary, "transfer") for p in self._pools),
                    plan_arg)
            donated, undonated = _lane_across, _lane_across_undonated
        self._run_copy(donated, undonated, args, slot, static, dst_primary)
        if self._lanes_async:  # on the CPU a lane copy is done already
            # the arrays the lane still uses: what it writes, and an onboard's source (an
            # offload's source was snapshotted)
            held = (("secondary",) if not dst_primary else
                    ("primary",) if src_primary else ("primary", "secondary"))
            for pool in self._pools:
                pool.hold_for_lanes(held, self._join_for_user)
        if dst_primary:
            self._onboard_writes[run.dst] = True
            if not src_primary:
                self._onboard_reads[run.src] = True
            self._onboards_pending = True
        else:
            self._offload_writes[run.dst] = True
            self._offloads_pending = True

    def _join_lanes(self, everything: bool, through: tuple[bool, ...] | None = None) -> None:
        """XLA's stream waits for lane 1 (onboards and copies within the GPU pool: everything
        compute may read) or, with `everything`, for both lanes; one dispatch. Later copies
        and steps then come after those lanes' pending copies, whose slots are pending no more.
        through: the memories (True: primary) whose arrays the join takes and hands on, which
        only places it in XLA's order (default: the primary, and with `everything` the
        secondary too); the arrays it takes are replaced, so a reference user code kept to
        one of them is deleted.
        """
        if not (self._onboards_pending or (everything and self._offloads_pending)):
            if self._offloads_pending and lanes_idle():
                self._offloads_done()
            return
        lanes = (OFFLOAD_LANE, ONBOARD_LANE) if everything else (ONBOARD_LANE,)
        through = through or ((True, False) if everything else (True,))
        # the pools' arrays (a pool over an engine's arrays has a list), absent ones left out
        arrays, tree = jax.tree.flatten([[p.stored(m) for m in through] for p in self._pools])
        try:
            joined = _join(tuple(arrays), lanes=lanes)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if not pinned_by_external_reference(e):
                raise
            joined = _join_undonated(tuple(arrays), lanes=lanes)  # copies a pool a view pins
        for pool, new in zip(self._pools, jax.tree.unflatten(tree, list(joined))):
            for memory, array in zip(through, new):
                if array is not None:
                    pool.take_copy_result(memory, array)
        self._onboards_done()
        if everything or not self._offloads_pending or lanes_idle():
            self._offloads_done()

    def _user_join(self, name: str) -> None:
        """User code reads or assigns a pool's `name` array ("primary" or "secondary") while
        lane copies use it: XLA's stream waits for them before anything dispatched later (the
        primary: for lane 1, whose copies write it; the secondary: for both lanes). A
        non-blocking sync of what that array needs: offloads still run beside the next step
        when only the primary is read, and the join takes only that array, so references
        user code holds to the other stay live."""
        with self._lock:
            if name == "primary":
                self._join_lanes(everything=False)
            else:
                self._join_lanes(everything=True, through=(False,))

    def _onboards_done(self) -> None:
        """No onboard or copy within the GPU pool is pending: XLA's stream joined lane 1, or
        the host waited for it."""
        # the secondary arrays, which onboards read, stay held while offloads write them
        held = ("primary",) if self._offloads_pending else ("primary", "secondary")
        for pool in self._pools:
            pool.release_lanes(held)
        self._onboard_writes[:] = False
        self._onboard_reads[:] = False
        self._onboards_pending = False

    def _offloads_done(self) -> None:
        """No offload is pending (XLA's stream joined lane 0, or it is idle), and no onboard
        either: the secondary arrays are free."""
        for pool in self._pools:
            pool.release_lanes(("secondary",))
        self._offload_writes[:] = False
        self._offloads_pending = False

    def _count(self, run: PairBatch) -> None:
        """Adds a run of one direction to the statistics."""
        if run.whole:
            nbytes = len(run) * self._block_nbytes
        else:
            t = self._pools[0].tokens_per_block
            whole = (run.tokens <= 0) | (run.tokens >= t)
            nbytes = int(np.where(whole, self._block_nbytes,
                                  run.tokens.astype(np.int64) * self._token_nbytes).sum())
        src_primary, dst_primary = run.direction
        kind = ("offloaded" if src_primary and not dst_primary else
                "onboarded" if dst_primary and not src_primary else "copied")
        setattr(self._stats, f"{kind}_blocks", getattr(self._stats, f"{kind}_blocks") + len(run))
        setattr(self._stats, f"{kind}_bytes", getattr(self._stats, f"{kind}_bytes") + nbytes)

