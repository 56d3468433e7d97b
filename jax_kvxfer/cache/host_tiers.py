"""The glue to the connector's host pool and stores: offload, onboard and store reads."""

from __future__ import annotations

import dataclasses

from ..connector import LoadSpec
from ..observe import events as kv_events
from .block_cache import CachedBlock


@dataclasses.dataclass(eq=False)
class StoreRead:
    """A read of store blocks into host rows: the worker's job, and the blocks it reads (not yet
    in the index)."""

    job: int
    blocks: list[CachedBlock]
    success: bool | None = None  # None: still reading


class HostTiers:
    """`BlockManager`'s side of the connector (`OffloadingManager` and `OffloadingWorker`):
    what moves between the GPU, the host pool and the stores; the state is the block
    manager's, set in its `__init__`."""

    def _offer_evicted(self) -> None:
        """Offers the blocks evicted from the GPU since the last call to the host pool: those
        it keeps (priority, admission, room) are queued to be stored there, the others are
        dropped. They are ready in the host pool at once: the worker runs their store before
        any job that reads their rows, and evicting one first issues the queue
        (_drop_evicted)."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
        # A sequence's blocks are evicted last block first; the host pool gets them first block
        # first, so that a prefix's rows ascend (a later onboard of it, and this offload, then
        # move runs of rows in one copy each), and its eviction order stays theirs (below).
        evicted.reverse()
        out = self._host.prepare_store([block.key for block, _ in evicted],
                                       priority=evicted[0][0].priority)
        dropped_queued_store = self._drop_evicted()
        if dropped_queued_store:  # its store first, in a job before the stores of these blocks
            self._issue_stores()
        rows = (dict(zip(out.block_hashes_to_store, out.store_spec.host_slots.tolist()))
                if out is not None else {})
        kept = []
        for block, page in evicted:
            row = rows.get(block.key)
            if row is None:
                self._index.remove(block)
                self._stats.dropped_primary_blocks += 1
                continue
            self._queue.store(block.key, page, row, block.priority)
            block.slot = row
            kept.append(block.key)
        if dropped_queued_store:  # the rest of the queue too, before these blocks join the
            self._timed_issue()  # host pool: as when they were offered one at a time
        if kept:
            kept.reverse()  # last block first, as evicted: the host pool evicts them in that order
            self._host.complete_store(kept)
            self._host_pushes += len(kept)
            self._publish_host_events()  # on the host now, and written through to the stores
            self._stats.offloaded_blocks += len(kept)

    def _stage_for_stores(self, block: CachedBlock, priority: int) -> None:
        """store_on_release: queues a copy of a GPU block into a host row, written through to
        the stores once issued; the row is free again after that (the worker makes a later
        user wait for the write). Blocks of a priority that is not offloaded, or with no row
        to spare, reach the stores only if evicted."""
        out = self._host.prepare_store([block.key], priority=priority, admit=False)
        if self._drop_evicted():
            self._timed_issue()
        if out is not None and out.block_hashes_to_store:
            self._queue.store(block.key, block.slot, int(out.store_spec.host_slots[0]),
                              priority, staged=True)

    def _pin_on_host(self, blocks: list[CachedBlock], count_reuse: bool = True) -> None:
        """Protects host blocks from eviction until their loads are issued (or `_unpin`)."""
        self._offer_evicted()
        self._host.prepare_load([b.key for b in blocks], count_reuse=count_reuse)
        for block in blocks:
            block.ref_count += 1

    def _unpin(self, block: CachedBlock) -> None:
        """Releases a pinned host block that is not loaded after all."""
        self._host.complete_load([block.key])
        self._host_pushes += 1
        block.ref_count -= 1

    def _onboard(self, block: CachedBlock) -> None:
        """Moves a matched (pinned) host block into a primary slot; it leaves the host pool
        once its load is issued."""
        dst = self._primary_slot()
        if self._queue.writes_page(dst):  # a freed block's copy is still queued
            self._timed_issue()
        self._queue.load(block, dst)
        block.slot, block.is_primary = dst, True
        if self._events is not None:  # on the GPU; gone from the host once the load is issued
            self._event_stored(block, kv_events.MEDIUM_GPU)
        self._stats.onboarded_blocks += 1

    def _drop_host_copy(self, block: CachedBlock) -> None:
        """Drops an unused host block whose content the GPU now holds (one place per block)."""
        self._host.remove([block.key])
        self._publish_host_events()
        self._index.remove(block)

    def _read_store_blocks(self, chain: list, *, priority: int,
                           wait: bool = True) -> list[CachedBlock]:
        """Reads the chain's blocks from the stores into host rows (as many as the host pool
        can give, at this priority); with `wait`, returns the blocks that arrived intact, from
        the first, in the index as unpinned host blocks. Without it, see `prefetch`."""
        specs = self._rows_for_reads([c[0] for c in chain], priority)
        if not specs:
            return []
        # A row may have been taken from a host block whose store is still queued: issue it
        # now, so that it lands (and is written through) before the read writes the row.
        self._timed_issue()
        reads, links = [], iter(chain)
        for spec in specs:
            read = StoreRead(next(self._jobs), [])
            # the rows first: zip stops at the last row without taking the next run's link
            for row, (key, parent, tokens) in zip(spec.host_slots.tolist(), links):
                read.blocks.append(CachedBlock(self._next_block_id, row, False, key, parent,
                                               tokens, priority))
                self._next_block_id += 1
            self._worker.submit_load(read.job, spec, None)
            self._reads[read.job] = read
            reads.append(read)
        if not wait:
            for read in reads:
                for block in read.blocks:
                    self._prefetching[block.key] = read
            return [b for read in reads for b in read.blocks]
        self._worker.wait([read.job for read in reads])
        self._collect_finished()
        return self._store_blocks_arrived(reads)

    def _rows_for_reads(self, keys: list[bytes], priority: int) -> list[LoadSpec]:
        """Host rows for store reads of `keys`, as many as the host pool can give at this
        priority, from the first (one `prepare_load` per run of rows). Where taking a row
        drops a block whose store is queued, or where rows run out while queued loads would
        give some back, the queue is issued first (the rows then come from what it frees)."""
        self._offer_evicted()
        specs, taken = [], 0
        while taken < len(keys):
            n = min(len(keys) - taken, self._host.rows_available(priority))
            if not n:
                if not self._queue.frees_host_rows():
                    break
                self._timed_issue()  # queued loads give their rows back
                continue
            n = self._rows_to_queued_store(n) or n
            specs.append(self._host.prepare_load(keys[taken:taken + n], priority=priority,
                                                 count_reuse=False))
            taken += n
            if self._drop_evicted():
                self._timed_issue()
        return specs

    def _rows_to_queued_store(self, rows: int) -> int | None:
        """With stores: of the next `rows` host rows handed out (free ones first, then those
        of evicted blocks), the count up to the one whose eviction drops a block with a queued
        store, if any (that store must be issued before the row is written again, and the
        queue is issued then); None if none does."""
        if not self._has_stores or not self._queue.offloads_queued():
            return None
        free = self._host.num_free_host_blocks
        evictions = rows - free
        if evictions <= 0:
            return None
        # Ahead of the first such block in the eviction order: every block of its priority or
        # lower, but those pushed since the queue's stores began (it is one of them).
        lowest = self._queue.lowest_store_priority
        ahead = self._host.rows_available(lowest) - free - self._host_pushes
        if evictions <= ahead:
            return None
        for i, key in enumerate(self._host.eviction_order()[:evictions]):
            if self._queue.stores(key):
                return free + i + 1
        return None

    def _store_blocks_arrived(self, reads: list[StoreRead]) -> list[CachedBlock]:
        """The blocks of finished reads that arrived intact, up to the first read that did not,
        join the index as host blocks (one the GPU pool got meanwhile is not kept twice); the
        others give their rows back."""
        kept, lost, intact = [], [], True
        for read in reads:
            intact = intact and read.success
            for block in read.blocks:
                if intact and block.key not in self._index.by_key:
                    self._index.add(block)
                    kept.append(block)
                else:
                    lost.append(block.key)
        if lost:
            self._host.complete_load(lost, success=False)
        if kept:
            self._host.complete_load([b.key for b in kept])
            self._host_pushes += len(kept)
            self._publish_host_events()
        return kept

    def _finish_prefetch(self, key: bytes) -> None:
        """Waits for the prefetch reading `key`, if any; its blocks join the index as reusable
        host blocks."""
        read = self._prefetching.get(key)
        if read is None:
            return
        if read.success is None:
            self._worker.wait([read.job])
            self._collect_finished()
        for block in read.blocks:
            self._prefetching.pop(block.key, None)
        self._store_blocks_arrived([read])

    def _collect_finished(self) -> None:
        """Notes the outcome of the store reads the worker reports finished."""
        for job, success in self._worker.get_finished():
            read = self._reads.pop(job, None)
            if read is not None:
                read.success = success

    def _drop_evicted(self) -> bool:
        """The host blocks the connector evicted to make room leave the index. Returns whether,
        with stores, one of them has its store still queued: the caller issues it before the
        row is written again, so that it is written through (the row's next user waits for
        that write); without stores, a later copy into the row may follow in the same job."""
        dropped_queued_store = False
        for event in self._host.take_events():
            for key in event.block_hashes:
                block = self._index.by_key[key]
                if self._events is not None:
                    self._event_removed(block, kv_events.MEDIUM_CPU)
                self._index.remove(block)
                self._stats.dropped_secondary_blocks += 1
                dropped_queued_store |= self._has_stores and self._queue.stores(key)
        return dropped_queued_store
