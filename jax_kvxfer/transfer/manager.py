"""The transfer manager: TensorRT-LLM's onboard / offload / sync verbs, and their statistics.

Every transfer consumes the pool arrays it touches and produces new ones (the destination is
donated and updated in place), so JAX's own buffer dependencies order the dispatches exactly as
the calls were made. The manager checks each call and splits it into runs of one direction;
an engine (_engines.py) copies them: on a GPU on the transfer lanes, TensorRT-LLM's side
streams, beside the model step and joined by `sync_transfers`, ordered where two copies touch
one slot (_hazards.py); elsewhere in line on XLA's stream. `pending_transfers` shows what the
transfers issued since the last sync touch.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..observe.metrics import TransferManagerReport, check_metrics_choice
from ..ops._checks import check_dma_choice, check_int
from ._batch import PairBatch, check_batch, check_direction, check_index_batch, split_runs
from ._engines import DonationWarning, Fence, InLineEngine, LaneEngine
from ._lanes import layer_group_bounds, take_exposed_seconds, wait_for_layers
from ._plan_ring import PlanRing
from .pool import KVCacheBlock, KVCacheBlockPool

__all__ = ["DonationWarning", "KVCacheTransferManager", "PendingTransfer", "TransferStats",
           "layer_group_bounds", "wait_for_layers"]

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
    # copies compute did not hide, and taking offload snapshots (_lanes.py). Over the work of
    # this process's managers that has finished; 0.0 without lanes. Not compared by ==.
    exposed_seconds: float = dataclasses.field(default=0.0, compare=False)


@dataclasses.dataclass(frozen=True)
class PendingTransfer:
    """What the transfers issued since the last sync do to one memory slot."""

    reads: int  # copies that read the slot
    writes: int  # copies that write it
    ops: tuple[str, ...]  # 'offload' / 'onboard' of each of those copies, in call order


class KVCacheTransferManager:
    """Moves blocks between the primary (GPU) and secondary (pinned host) memory of its pools.

    TensorRT-LLM: `KVCacheTransferManager` (`onboard`, `offload`, `syncTransfers`). A logical
    block spans every pool, so each transfer copies the block in all of them.

    Every method returns without waiting for the copies; all that a program can observe is as
    if the transfers ran one after another in call order. Methods are thread-safe (one lock).
    """

    def __init__(self, pools: Sequence[KVCacheBlockPool], *, plan_ring: bool = True,
                 dma: bool | str = "auto", metrics: bool | None = None,
                 layer_groups: int = 1) -> None:
        """Args:
          pools: one or more pools with equal block counts and tokens per block.
          plan_ring: pass block indices through a ring of `pinned_host` arrays that the copy
            kernel reads in place (_plan_ring.py; saves a host-to-device transfer per call).
            False: send them as NumPy arrays, which JAX moves to the device with each call.
            Both copy the same; the ring relies on JAX handing a pinned_host array's own
            buffer to the custom call, so False is the way out should a JAX version not.
          dma: how the blocks move on a GPU. True or "auto" (default): on the transfer lanes
            with the copy engines, beside the model step (_lanes.py), where the pools are on one
            device and the plan ring is on; "auto" falls back to the copy kernel on XLA's
            stream for sharded pools or plan_ring=False, True raises there. False: the copy
            kernel on XLA's stream, in line with compute (no lanes).
          metrics: report the statistics to the process-wide Prometheus registry
            (jax_kvxfer.observe.metrics); None: when a metrics server has been started.
          layer_groups: on the transfer lanes, each onboard lands in this many groups of
            layers, one after another (`layer_group_bounds`), so that a step synced with
            `sync_transfers(block=False, layer_wise=True)` computes its first layers while the
            later ones still arrive (`wait_for_layers`). 1 (default): one piece. More groups
            mean smaller copies (a block's bytes over the groups): keep a group's share of a
            block at 256 KiB or more, where the copy engines keep their pace. At most the
            pools' fewest layers.
        """
        check_dma_choice(dma)
        report = check_metrics_choice(metrics)
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
        fewest = min(p.num_layers for p in self._pools)
        layer_groups = check_int("layer_groups", layer_groups)
        if not 1 <= layer_groups <= fewest:
            raise ValueError(f"layer_groups must be between 1 and the pools' fewest layers "
                             f"({fewest}), got {layer_groups}")
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
        ring_sharding = PlanRing.sharding_for(first.sharding("device")) if plan_ring else None
        plans = PlanRing(ring_sharding) if ring_sharding is not None else None
        # The transfer lanes where they can run (pools on one device, indices in the plan
        # ring's pinned_host arrays), the copy kernel on XLA's stream otherwise (_engines.py).
        self._engine: InLineEngine | LaneEngine = (
            LaneEngine(self._pools, plans, self._lock, layer_groups)
            if dma is not False and plans is not None and first.mesh is None
            else InLineEngine(self._pools, plans))
        self._report = (TransferManagerReport(lambda: self._stats, self._lock)
                        if report else None)

    @property
    def pools(self) -> tuple[KVCacheBlockPool, ...]:
        return self._pools

    @property
    def metrics_report(self) -> TransferManagerReport | None:
        """This manager's report to the metrics (None: it does not report), which a block
        manager over it takes under its own name."""
        return self._report

    @property
    def metrics_label(self) -> str | None:
        """The `manager` label of this manager's metrics (None: it does not report)."""
        return self._report.label if self._report is not None else None

    @property
    def on_lanes(self) -> bool:
        """Whether the copies run on a GPU's transfer lanes, beside compute (_lanes.py)."""
        return isinstance(self._engine, LaneEngine) and self._engine.asynchronous

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
        self._transfer("offload", [(block, offload_block)], [check_int("num_tokens", num_tokens)])

    def onboard(self, offload_block: KVCacheBlock, block: KVCacheBlock,
                num_tokens: int = 0) -> None:
        """Copies `offload_block` into `block` (secondary -> primary, or primary -> primary).

        TensorRT-LLM: `KVCacheTransferManager::onboard` (an onboard from a primary block is
        the intra-device copy of partial reuse). Arguments and errors as for `offload`.
        """
        self._transfer("onboard", [(offload_block, block)], [check_int("num_tokens", num_tokens)])

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
        """`offload_blocks(offload_pairs)` then `onboard_blocks(onboard_pairs)`, both checked
        before either is issued.

        On the transfer lanes (a GPU, the default) the offloads (lane 0) and the onboards
        (lane 1) use both directions of PCIe at once: an offload's sources are snapshotted
        first, so an onboard may overwrite them, and an onboard reading a secondary slot that
        an offload writes waits for that offload (_hazards.py). In line on XLA's stream
        (sharded pools, dma=False, plan_ring=False) and on the CPU, one after the other.

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
            for op, batch in (("offload", off), ("onboard", on)):
                if len(batch):
                    self._issue(op, batch)

    def sync_transfers(self, block: bool = True, layer_wise: bool = False) -> None:
        """The step boundary: compute dispatched after it sees every transfer issued so far.

        TensorRT-LLM: `syncTransfers`. Clears `pending_transfers`.

        Args:
          block: wait on the host until every transfer is done and the pools' arrays are
            ready. False: return at once; on a GPU, XLA's stream waits for the onboards and
            copies within the GPU pool (what compute reads) before anything dispatched later,
            and offloads go on in the background: compute never reads what they write, and a
            later onboard from their slots waits for them on the GPU. (Read the secondary
            pool with `to_numpy`, which waits for them, or after a blocking sync.)
          layer_wise: with block=False, the wait for the onboards is left to the step
            dispatched next, which must pass the primary array through `wait_for_layers`
            before its layers read it, for every layer up to the last (as vLLM's connector
            calls `wait_for_layer_load` in each layer): its first layers then compute while
            the later ones still arrive (with `layer_groups`). Nothing else may read the
            primary array in between.

        Raises:
          ValueError: layer_wise with block=True.
        """
        if layer_wise and block:
            raise ValueError("layer_wise=True needs block=False: a blocking sync waits for "
                             "every layer already")
        with self._lock:
            self._issued.clear()
            if block:
                self._engine.sync()
            elif layer_wise:
                self._engine.hand_to_step()
            else:
                self._engine.join(everything=False)

    def fence(self) -> Fence:
        """A handle on every transfer issued so far: `fence.done()` tells, without waiting,
        whether they have all finished, and `fence.wait()` waits for them; both may be called
        from any thread (a store's I/O thread waits on one before reading host rows that
        offloads write). Costs nothing where the plan ring is on; without it, waits at once.
        """
        with self._lock:
            return self._engine.fence()

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
            if self._report is not None:
                self._report.reset(stats)
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
            self._engine.copy(run)
            self._count(run)
        self._issued.append((op, batch))

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

