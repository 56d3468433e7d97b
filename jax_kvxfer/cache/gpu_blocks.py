"""The GPU pool's blocks: references, fresh blocks, copies of partial matches and eviction."""

from __future__ import annotations

from ..observe import events as kv_events
from .block_cache import CachedBlock


class GpuBlocks:
    """`BlockManager`'s primary pool: free pages, reusable cached blocks and the choice of a
    victim (offered to the host pool, see `HostTiers`); the state is the block manager's."""

    def _available_primary(self) -> int:
        return len(self._free) + len(self._reusable)

    def _ref(self, block: CachedBlock) -> None:
        """References a GPU block (a sequence uses it, or a queued copy reads it)."""
        if block.ref_count == 0 and block.key is not None:
            self._reusable.remove(block)
        block.ref_count += 1

    def _unref(self, block: CachedBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self._reusable.push(block)
            else:
                self._free.append(block.slot)

    def _new_block(self) -> CachedBlock:
        block = CachedBlock(self._next_block_id, self._primary_slot(), True, ref_count=1)
        self._next_block_id += 1
        return block

    def _copy_partial(self, src: CachedBlock, n: int) -> CachedBlock:
        """A fresh block, its first `n` tokens copied from `src` (pinned until then)."""
        dst = self._new_block()
        if self._queue.writes_page(dst.slot):  # a freed block's copy is still queued
            self._timed_issue()
        if src.is_primary:
            self._queue.copy(src, dst.slot, n)
            self._stats.partial_copies += 1
        else:
            self._queue.load(src, dst.slot, n)
            self._host.admission_reused([src.key])
            self._stats.partial_onboards += 1
        return dst

    def _primary_slot(self) -> int:
        """A free primary slot, evicting (offloading or dropping) a reusable block if needed."""
        if self._free:
            return self._free.popleft()
        victim = self._reusable.pop()  # callers check _available_primary first
        if self._queue.writes_page(victim.slot):
            # Queued stores are issued before queued loads; this one must read what a queued
            # load writes, so issue the queue first.
            self._timed_issue()
        slot = victim.slot
        if self._events is not None:
            self._event_removed(victim, kv_events.MEDIUM_GPU)
        if not self.enable_offload or self._host is None:
            self._index.remove(victim)
            self._stats.dropped_primary_blocks += 1
            return slot
        # Offered to the host pool with the blocks evicted next (one call for many). A batch
        # is of one priority and within the rows that priority could have: so each block is
        # kept or dropped as it would have been alone.
        if self._evicted and (victim.priority != self._evicted[0][0].priority or (
                self._evicted_room and len(self._evicted) >= self._evicted_room)):
            self._offer_evicted()
        if not self._evicted:
            self._evicted_room = self._host.rows_available(victim.priority)
        victim.is_primary = False
        self._evicted.append((victim, slot))
        rows = len(self._evicted)  # the rows this batch takes, should the host keep them all
        if self._rows_to_queued_store(rows) == rows:
            # Its row would drop a block whose store is queued: offered now, before its page
            # is handed out, so that the queue can be issued then (as one at a time would).
            self._offer_evicted()
        return slot
