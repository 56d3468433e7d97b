"""`OffloadingManager`: the scheduler side of the connector. It decides which engine blocks the
host pool keeps, in which rows, and which a store holds; it moves no data (`OffloadingWorker`
does).

vLLM v1: `vllm/v1/kv_offload/abstract.py` `OffloadingManager`, whose primitives and meanings
these are. A block in the host pool is in one of three states:

- *storing*: `prepare_store` gave it a row; the worker is copying it there. Not loadable
  (`lookup` answers None at it: ask again), not evictable, until `complete_store`;
- *reading*: `prepare_load` gave it a row that a store read fills. Not loadable by another
  request (`lookup` answers None at it), not evictable, until `complete_load`;
- *ready*: loadable; evictable while no `prepare_load` protects it (lowest priority first,
  least recently used first).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from .. import events as kv_events
from ..stores.base import Store
from .admission import AdmissionPolicy, admission_policy
from .lru import (
    DEFAULT_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    EvictionQueue,
    check_priority,
)
from .specs import (
    MEDIUM_CPU,
    BlockHash,
    LoadSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    StoreRead,
    StoreSpec,
    check_block_hash,
    event_key,
    store_key,
)
from .tiers import longest_stored

_STORING, _READING, _READY = "storing", "reading", "ready"


@dataclasses.dataclass(eq=False, slots=True)
class _HostBlock:
    block_id: int  # unique, for the eviction queue
    block_hash: BlockHash
    slot: int
    state: str
    priority: int
    protected: int = 0  # prepare_load calls not yet completed


@dataclasses.dataclass
class OffloadingStats:
    """What the manager did since the last `get_and_reset_stats`, in blocks."""

    looked_up: int = 0  # hashes given to lookup
    found: int = 0  # of those, counted as loadable (host pool or a store)
    loaded: int = 0  # blocks prepared for loading from the host pool
    read_from_store: int = 0  # blocks prepared for loading through a store read
    failed_loads: int = 0  # blocks of loads completed with success=False
    stored: int = 0  # blocks completed into the host pool
    declined: int = 0  # blocks prepare_store did not store (admission, priority)
    evicted: int = 0  # host blocks evicted to make room


class OffloadingManager:
    """Which engine blocks the host pool (and the stores below it) hold, for one engine.

    Keyed by the engine's block hashes (ints or bytes). The calls, in the order an engine makes
    them: `lookup` when a request is scheduled (after the GPU prefix cache's match), then
    `prepare_load` for the blocks it will load and `touch` for all it reuses; `complete_load`
    once the worker has loaded them; `prepare_store` for blocks the GPU computed (or evicts),
    `complete_store` once the worker has copied them; `take_events` once a step.
    """

    def __init__(self, num_host_blocks: int, *, block_size: int, stores: Sequence[Store] = (),
                 events: kv_events.KVEventPublisher | None = None,
                 admission: str | AdmissionPolicy | None = "always",
                 offload_min_priority: int = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY) -> None:
        """Args:
          num_host_blocks: rows of the worker's host pool (the same number).
          block_size: tokens per block (for the events).
          stores: the tiers below the host pool, in the worker's order (pass
            `worker.stores`: the worker binds them to its rows' layout). A block stored in the
            host pool is written through to each; a block found only in a store is read into a
            host row when loaded.
          events: publishes each `take_events` batch in vLLM's KV-event format
            (`jax_kvxfer.events`).
          admission: which blocks `prepare_store` stores (`jax_kvxfer.cache.admission_policy`:
            "always", "reuse[:rate]", "second-sighting[:k]" or a policy; a sighting is a
            `touch`). Default "always", as vLLM's offloading connector.
          offload_min_priority: blocks of a lower priority are never stored.

        Raises:
          TypeError, ValueError: a bad argument, named.
        """
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or \
                num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be an integer >= 1, got {num_host_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        stores = [stores] if isinstance(stores, Store) else list(stores)
        for i, store in enumerate(stores):
            if not isinstance(store, Store):
                raise TypeError(f"stores[{i}] must be a jax_kvxfer.stores.Store, got "
                                f"{type(store).__name__}")
            if store.fingerprint is None:
                raise ValueError(f"stores[{i}] is not bound to a row layout: make the "
                                 "OffloadingWorker with these stores first and pass "
                                 "stores=worker.stores")
        if events is not None and not isinstance(events, kv_events.KVEventPublisher):
            raise TypeError("events must be a jax_kvxfer.events.KVEventPublisher or None, got "
                            f"{type(events).__name__}")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.stores = tuple(stores)
        self._store_tiers = tuple(dict.fromkeys(store.tier for store in self.stores))
        self.admission = admission_policy(admission)
        self.offload_min_priority = check_priority(offload_min_priority)
        self._publisher = events
        self._free = collections.deque(range(num_host_blocks))
        self._blocks: dict[BlockHash, _HostBlock] = {}
        self._evictable = EvictionQueue()  # ready, unprotected blocks
        self._next_id = 0
        self._events: list[OffloadingEvent] = []
        self._stats = OffloadingStats()

    # -- loading -------------------------------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash], *,
               priority: int = DEFAULT_PRIORITY) -> int | None:
        """How many blocks, from the first, can be loaded now: ready in the host pool, or in a
        store with a host row to read them into (a free row, or one of a block of no higher
        priority than `priority` to evict). None when the first block that is not ready is
        being stored or read (ask again after `complete_store` / `complete_load`)."""
        hashes = self._checked("block_hashes", block_hashes)
        priority = check_priority(priority)
        self._stats.looked_up += len(hashes)
        n, pinned = 0, 0
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            if block.state != _READY:
                return None
            pinned += block.protected == 0 and block.priority <= priority
            n += 1
        if self.stores and n < len(hashes):
            rows = self._room(priority) - pinned
            rest = hashes[n:n + rows]
            stop = next((i for i, h in enumerate(rest) if h in self._blocks), len(rest))
            _, found = longest_stored(self.stores, [store_key(h) for h in rest[:stop]])
            n += found
        self._stats.found += n
        return n

    def prepare_load(self, block_hashes: Iterable[BlockHash], *, priority: int = DEFAULT_PRIORITY,
                     count_reuse: bool = True) -> LoadSpec:
        """Protects the blocks from eviction until `complete_load`, and says where the worker
        reads them: host rows, the rows of blocks only a store holds filled first by a store
        read (`LoadSpec.store_reads`; those blocks take `priority`, and may evict blocks of no
        higher priority).

        `count_reuse=False`: the admission policy is not told that these blocks are reused now
        (a prefetch into host rows, whose load to the GPU is counted then; a block held in case
        it is used: `admission_reused` once it is), so that no block counts twice.

        Raises:
          ValueError: a block that `lookup` would not count as loadable now (not held, still
            being stored or read, or no host row for a store read); nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        priority = check_priority(priority)
        if len(set(hashes)) != len(hashes):
            raise ValueError("block_hashes holds a hash twice")
        held = [self._blocks.get(h) for h in hashes]
        for i, block in enumerate(held):
            if block is not None and block.state != _READY:
                raise ValueError(f"block_hashes[{i}] is still being {block.state}; lookup() "
                                 "answers None until then")
        missing = [i for i, block in enumerate(held) if block is None]
        reads = self._plan_store_reads(hashes, missing)
        rows_free = self._room(priority) - sum(
            b is not None and b.protected == 0 and b.priority <= priority for b in held
        ) if missing else 0
        if len(missing) > rows_free:
            raise ValueError(f"block_hashes: {len(missing)} blocks to read from the stores but "
                             f"only {rows_free} host rows can be freed")
        for block in held:
            if block is not None:
                self._protect(block)
        for i in missing:  # rows for the store reads (the held blocks are protected now)
            held[i] = self._new_block(hashes[i], self._row(), _READING, priority)
            held[i].protected = 1
        if count_reuse:
            for h in hashes:
                self.admission_reused(h)
        self._stats.loaded += len(hashes) - len(missing)
        self._stats.read_from_store += len(missing)
        return LoadSpec(tuple(hashes), [b.slot for b in held], tuple(reads))

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Marks the blocks as recently used (hashes the host pool does not hold, such as
        blocks only the GPU caches, count as sightings for the admission policy)."""
        sightings = self.admission.counts_sightings
        for h in self._checked("block_hashes", block_hashes):
            if sightings:
                self.admission.seen(store_key(h))
            block = self._blocks.get(h)
            if block is not None and block.state == _READY and block.protected == 0:
                self._evictable.remove(block)
                self._evictable.push(block)

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Ends a `prepare_load`: the blocks may be evicted again. Blocks read from a store
        join the host pool, or, with `success=False` (the load failed), give their rows back.

        Raises:
          ValueError: a block not being loaded; nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is None or block.protected == 0:
                raise ValueError(f"block_hashes[{i}] is not being loaded (prepare_load first)")
        for h in hashes:
            block = self._blocks[h]
            block.protected -= 1
            if block.state == _READING:
                if success:
                    block.state = _READY
                    self._event([h], MEDIUM_CPU, removed=False)
                else:
                    self._forget(block)
                    self._stats.failed_loads += 1
                    continue
            elif not success:
                self._stats.failed_loads += 1
            if block.protected == 0:
                self._evictable.push(block)

    # -- storing -------------------------------------------------------------------------------

    def prepare_store(self, block_hashes: Iterable[BlockHash], *, priority: int = DEFAULT_PRIORITY,
                      admit: bool = True) -> PrepareStoreOutput | None:
        """Rows for the blocks the host pool does not hold yet (those the admission policy
        takes), evicting ready, unprotected blocks of no higher priority, the lowest priority
        and least recently used first. The blocks are protected until `complete_store`.

        `admit=False` does not ask the admission policy: a write-through of blocks the engine
        keeps on the GPU and wants in the stores at once (its replicas read them there), as
        opposed to an offload at eviction, which the policy gates.

        Returns None, changing nothing, when that many rows cannot be freed.

        Raises:
          TypeError, ValueError: bad hashes or priority; nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        priority = check_priority(priority)
        new = list(dict.fromkeys(h for h in hashes if h not in self._blocks))
        if len(new) > self._room(priority):
            return None
        to_store = [h for h in new if priority >= self.offload_min_priority
                    and (not admit or self.admission.admit(store_key(h)))]
        self._stats.declined += len(new) - len(to_store)
        evicted: list[BlockHash] = []
        slots = []
        for h in to_store:
            slot = self._row(evicted)
            slots.append(slot)
            self._new_block(h, slot, _STORING, priority)
        if evicted:
            self._event(evicted, MEDIUM_CPU, removed=True)
        return PrepareStoreOutput(to_store, StoreSpec(tuple(to_store), slots), evicted)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Ends a `prepare_store`: the blocks become loadable, or, with `success=False`, give
        their rows back. Blocks already ready are left as they are.

        Raises:
          ValueError: a block the host pool does not hold (never prepared); nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        for i, h in enumerate(hashes):
            if h not in self._blocks:
                raise ValueError(f"block_hashes[{i}] was not prepared for storing")
        done = []
        for h in hashes:
            block = self._blocks[h]
            if block.state != _STORING:
                continue
            if success:
                block.state = _READY
                self._evictable.push(block)
                done.append(h)
            else:
                self._forget(block)
        if done:
            self._stats.stored += len(done)
            self._event(done, MEDIUM_CPU, removed=False)
            for tier in self._store_tiers:
                self._event(done, tier, removed=False)

    def remove(self, block_hashes: Iterable[BlockHash]) -> None:
        """Drops ready, unprotected blocks from the host pool (their rows are free): a cache
        that keeps a block in one place only removes it once loaded back. Hashes the host pool
        does not hold are ignored.

        Raises:
          ValueError: a block still being stored, read or loaded; nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        held = [self._blocks.get(h) for h in hashes]
        for i, block in enumerate(held):
            if block is not None and (block.state != _READY or block.protected):
                raise ValueError(f"block_hashes[{i}] is still being "
                                 f"{'loaded' if block.protected else block.state}")
        gone = [b for b in dict.fromkeys(held) if b is not None]
        for block in gone:
            self._evictable.remove(block)
            self._forget(block)
        if gone:
            self._event([b.block_hash for b in gone], MEDIUM_CPU, removed=True)

    # -- events and introspection --------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call (and, with a publisher, publishes them)."""
        events, self._events = self._events, []
        if self._publisher is not None and events:
            self._publisher.publish([
                (kv_events.REMOVED, e.medium, event_key(h)) if e.removed else
                (kv_events.STORED, e.medium, event_key(h), None, (), e.block_size)
                for e in events for h in e.block_hashes])
        return events

    def get_and_reset_stats(self) -> OffloadingStats:
        stats, self._stats = self._stats, OffloadingStats()
        return stats

    @property
    def num_free_host_blocks(self) -> int:
        """Rows holding no block."""
        return len(self._free)

    def rows_available(self, priority: int = DEFAULT_PRIORITY) -> int:
        """Rows a block of `priority` can have now (in `prepare_store`, or read from a store in
        `prepare_load`): the free ones, and those of ready, unprotected blocks of no higher
        priority, which would be evicted."""
        return self._room(check_priority(priority))

    def lookup_stores(self, block_hashes: Iterable[BlockHash]) -> int:
        """How many blocks, from the first, one store holds (the store holding the most),
        whether or not the host pool has rows to read them into now: what a request could load
        from the stores once rows are free (`lookup` counts only what is loadable now)."""
        keys = [store_key(h) for h in self._checked("block_hashes", block_hashes)]
        return longest_stored(self.stores, keys)[1]

    def eviction_order(self) -> list[BlockHash]:
        """The ready, unprotected blocks, in the order they would be evicted (next first)."""
        return [block.block_hash for block in self._evictable]

    @property
    def num_evictable_blocks(self) -> int:
        """How many blocks `eviction_order` lists (read at once, from any thread)."""
        return len(self._evictable)

    def host_slot(self, block_hash: BlockHash) -> int | None:
        """The host row of a block the host pool holds (in any state), else None."""
        block = self._blocks.get(check_block_hash("block_hash", block_hash))
        return None if block is None else block.slot

    def admission_reused(self, block_hash: BlockHash) -> None:
        """Tells the admission policy that a stored block was loaded (its reuse rate)."""
        if self.admission.counts_reuse:
            self.admission.reused(store_key(block_hash))

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _checked(name: str, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        if isinstance(block_hashes, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of block hashes, got {block_hashes!r}")
        hashes = list(block_hashes)
        for i, h in enumerate(hashes):
            if type(h) is not bytes and type(h) is not int:  # the usual ones pass as they are
                hashes[i] = check_block_hash(f"{name}[{i}]", h)
        return hashes

    def _plan_store_reads(self, hashes: list[BlockHash], missing: list[int]) -> list[StoreRead]:
        """The store reads for the blocks at `missing`, in runs of consecutive positions, each
        from the store holding the longest part of it; ValueError if a store lacks a block."""
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        reads = []
        for run in runs:
            start = run[0]
            while start <= run[-1]:
                keys = [store_key(hashes[i]) for i in range(start, run[-1] + 1)]
                which, found = longest_stored(self.stores, keys)
                if not found:
                    raise ValueError(f"block_hashes[{start}] is held neither by the host pool "
                                     "nor by a store (lookup() first)")
                reads.append(StoreRead(which, start, start + found))
                start += found
        return reads

    def _protect(self, block: _HostBlock) -> None:
        if block.protected == 0 and block.state == _READY:
            self._evictable.remove(block)
        block.protected += 1

    def _new_block(self, block_hash: BlockHash, slot: int, state: str,
                   priority: int) -> _HostBlock:
        block = _HostBlock(self._next_id, block_hash, slot, state, priority)
        self._next_id += 1
        self._blocks[block_hash] = block
        return block

    def _room(self, priority: int) -> int:
        """Rows a block of `priority` can have: free ones, and those of ready, unprotected
        blocks of no higher priority."""
        return len(self._free) + self._evictable.count_at_most(priority)

    def _row(self, evicted: list[BlockHash] | None = None) -> int:
        """A free row, evicting the next victim if needed (callers checked there is one)."""
        if self._free:
            return self._free.popleft()
        victim = self._evictable.peek()
        self._evictable.remove(victim)
        del self._blocks[victim.block_hash]
        self._stats.evicted += 1
        if evicted is not None:
            evicted.append(victim.block_hash)
        else:
            self._event([victim.block_hash], MEDIUM_CPU, removed=True)
        return victim.slot

    def _forget(self, block: _HostBlock) -> None:
        """A block leaves the host pool without having been ready: its row is free."""
        del self._blocks[block.block_hash]
        self._free.append(block.slot)

    def _event(self, hashes: list[BlockHash], medium: str, *, removed: bool) -> None:
        self._events.append(OffloadingEvent(list(hashes), self.block_size, medium, removed))
