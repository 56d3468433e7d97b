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
import itertools
from collections.abc import Iterable, Sequence

from ..observe import events as kv_events
from ..stores.base import Store
from .admission import AdmissionPolicy, AlwaysAdmit, admission_policy
from .lru import (
    DEFAULT_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
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
from .tiers import READ_PROBE_EVERY, check_recompute_cost, longest_stored, read_rate


@dataclasses.dataclass
class OffloadingStats:
    """What the manager did since the last `get_and_reset_stats`, in blocks. The lookup
    counts are per call: a block of a request asked about again (still waiting, or read
    ahead and then admitted) counts again."""

    looked_up: int = 0  # hashes given to lookup
    found: int = 0  # of those, counted as loadable (host pool or a store)
    loaded: int = 0  # blocks prepared for loading from the host pool
    read_from_store: int = 0  # blocks prepared for loading through a store read
    failed_loads: int = 0  # blocks of loads completed with success=False
    store_skipped: int = 0  # blocks only a store held that lookup left to recompute (the
    # read was expected to take longer: set_recompute_cost)
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
                 offload_min_priority: int = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
                 recompute_s_per_token: float | None = None) -> None:
        """Args:
          num_host_blocks: rows of the worker's host pool (the same number).
          block_size: tokens per block (for the events).
          stores: the tiers below the host pool, in the worker's order (pass
            `worker.stores`: the worker binds them to its rows' layout). A block stored in the
            host pool is written through to each; a block found only in a store is read into a
            host row when loaded.
          events: publishes each `take_events` batch in vLLM's KV-event format
            (`jax_kvxfer.observe.events`).
          admission: which blocks `prepare_store` stores (`jax_kvxfer.cache.admission_policy`:
            "always", "reuse[:rate]", "second-sighting[:k]" or a policy; a sighting is a
            `touch`). Default "always", as vLLM's offloading connector.
          offload_min_priority: blocks of a lower priority are never stored.
          recompute_s_per_token: seconds the engine's model takes to compute one prompt
            token's K/V, or None (the default: a store is always read); see
            `set_recompute_cost`.

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
            raise TypeError("events must be a jax_kvxfer.observe.events.KVEventPublisher or None, got "
                            f"{type(events).__name__}")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.stores = tuple(stores)
        self._store_tiers = tuple(dict.fromkeys(store.tier for store in self.stores))
        self.admission = admission_policy(admission)
        self.offload_min_priority = check_priority(offload_min_priority)
        self.recompute_s_per_token = check_recompute_cost(recompute_s_per_token)
        self._reads_skipped = 0  # lookups that left a store's blocks to recompute
        self._publisher = events
        # Every held block's row and priority; its state: storing, reading, or ready (in no
        # set below but `_ready`). The sets and dicts are worked on with C-level operations
        # (set algebra, map and filter over builtin methods), not a Python loop per block: a
        # step touches hundreds of blocks, and the scheduler's time is the engine's.
        self._slot: dict[BlockHash, int] = {}
        self._priority: dict[BlockHash, int] = {}
        self._storing: set[BlockHash] = set()
        self._reading: set[BlockHash] = set()
        self._ready: set[BlockHash] = set()
        self._protected: dict[BlockHash, int] = {}  # prepare_load calls not completed
        # ready, unprotected blocks by priority, least recently used first: the evictable ones
        # (plain dicts keep insertion order, and update faster than OrderedDicts)
        self._lru: dict[int, dict[BlockHash, None]] = {}
        self._free = list(range(num_host_blocks))
        self._events: list[OffloadingEvent] = []
        self._stats = OffloadingStats()

    # -- loading -------------------------------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash], *,
               priority: int = DEFAULT_PRIORITY) -> int | None:
        """How many blocks, from the first, can be loaded now: ready in the host pool, or in a
        store with a host row to read them into (a free row, or one of a block of no higher
        priority than `priority` to evict), and, once `set_recompute_cost` was given, whose
        read is expected to beat recomputing them. None when the first block that is not
        ready is being stored or read (ask again after `complete_store` / `complete_load`)."""
        hashes = self._checked("block_hashes", block_hashes)
        priority = check_priority(priority)
        self._stats.looked_up += len(hashes)
        n = len(list(itertools.takewhile(self._ready.__contains__, hashes)))
        if n < len(hashes) and hashes[n] in self._slot:
            return None
        if self.stores and n < len(hashes):
            rows = self._room(priority) - self._evictable_among(hashes[:n], priority)
            rest = list(itertools.takewhile(lambda h: h not in self._slot, hashes[n:n + rows]))
            which, stored = longest_stored(self.stores, [store_key(h) for h in rest])
            if stored and not self._read_pays(which, stored):
                self._stats.store_skipped += stored
                stored = 0
            n += stored
        self._stats.found += n
        return n

    def set_recompute_cost(self, s_per_token: float | None) -> None:
        """Seconds the engine's model takes to compute one prompt token's K/V (its measured
        prefill rate, inverted), or None: always read. Once given, `lookup` counts the blocks
        only a store holds only where their read is expected to finish before recomputing
        their tokens would, by the store's measured reads (`tiers.read_rate`: until
        `tiers.MIN_READS` are measured, the store is read, and so measured); otherwise it
        stops before them and the engine recomputes them (`OffloadingStats.store_skipped`).
        One such lookup in `tiers.READ_PROBE_EVERY` counts them all the same (a probe: the
        read keeps the estimate current). Call it again as the measurement changes.

        Raises:
          TypeError, ValueError: not None nor a finite number > 0 (nothing changes).
        """
        self.recompute_s_per_token = check_recompute_cost(s_per_token)

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
        given = set(hashes)
        if len(given) != len(hashes):
            raise ValueError("block_hashes holds a hash twice")
        busy = () if given.isdisjoint(self._storing) and given.isdisjoint(self._reading) else \
            given & (self._storing | self._reading)
        if busy:
            i = next(i for i, h in enumerate(hashes) if h in busy)
            raise ValueError(f"block_hashes[{i}] is still being "
                             f"{'stored' if hashes[i] in self._storing else 'read'}; lookup() "
                             "answers None until then")
        missing = set(itertools.filterfalse(self._slot.__contains__, hashes))
        held = [h for h in hashes if h not in missing] if missing else hashes
        reads: list[StoreRead] = []
        if missing:
            positions = [i for i, h in enumerate(hashes) if h in missing]
            reads = self._plan_store_reads(hashes, positions)
            rows = self._room(priority) - self._evictable_among(held, priority)
            if len(missing) > rows:
                raise ValueError(f"block_hashes: {len(missing)} blocks to read from the stores "
                                 f"but only {rows} host rows can be freed")
        self._protect(held)
        if missing:  # rows for the store reads (the held blocks are protected now)
            reading = [hashes[i] for i in positions]
            self._hold(reading, priority, self._reading)
            self._protected.update(dict.fromkeys(reading, 1))
        if count_reuse:
            self.admission_reused(hashes)
        self._stats.loaded += len(held)
        self._stats.read_from_store += len(missing)
        return LoadSpec(tuple(hashes), list(map(self._slot.__getitem__, hashes)), tuple(reads))

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Marks the blocks as recently used, the first most recently (so that a prefix is
        evicted after the blocks extending it); hashes the host pool does not hold, such as
        blocks only the GPU caches, count as sightings for the admission policy."""
        hashes = self._checked("block_hashes", block_hashes)
        if self.admission.counts_sightings:
            for h in hashes:
                self.admission.seen(store_key(h))
        for bucket in self._lru.values():
            again = list(filter(bucket.__contains__, reversed(hashes)))
            _drain(map(bucket.__delitem__, again))
            bucket.update(dict.fromkeys(again))

    def complete_load(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Ends a `prepare_load`: the blocks may be evicted again. Blocks read from a store
        join the host pool, or, with `success=False` (the load failed), give their rows back.

        Raises:
          ValueError: a block not being loaded; nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        counts = list(map(self._protected.get, hashes))
        if None in counts:
            i = counts.index(None)
            raise ValueError(f"block_hashes[{i}] is not being loaded (prepare_load first)")
        if counts.count(1) == len(counts) and len(set(hashes)) == len(hashes):
            released = hashes  # the usual case: each block loaded once, completed once
            _drain(map(self._protected.__delitem__, hashes))
        else:  # a block loaded by several requests at once (completed once each, or together)
            times = collections.Counter(hashes)
            for i, h in enumerate(hashes):
                if times[h] > self._protected[h]:
                    raise ValueError(f"block_hashes[{i}] completes more loads than were "
                                     "prepared")
            released = []
            for h, n in times.items():
                left = self._protected[h] - n
                if left:
                    self._protected[h] = left
                else:
                    del self._protected[h]
                    released.append(h)
        read = [h for h in released if h in self._reading] if self._reading else []
        if read:
            self._reading.difference_update(read)
            if success:
                self._ready.update(read)
                self._event(read, MEDIUM_CPU, removed=False)
            else:
                self._forget(read)
                gone = set(read)
                released = [h for h in released if h not in gone]
        if not success:
            self._stats.failed_loads += len(hashes)
        self._queue(released)

    # -- storing -------------------------------------------------------------------------------

    def prepare_store(self, block_hashes: Iterable[BlockHash], *, priority: int = DEFAULT_PRIORITY,
                      admit: bool = True) -> PrepareStoreOutput | None:
        """Rows for the blocks the host pool does not hold yet (those the admission policy
        takes), evicting ready, unprotected blocks of no higher priority, the lowest priority
        and least recently used first; the blocks get the rows in ascending order (hand a
        prompt's blocks over first to last: its rows then ascend along it, and runs of
        consecutive rows move in one copy). The blocks are protected until `complete_store`.

        `admit=False` does not ask the admission policy: a write-through of blocks the engine
        keeps on the GPU and wants in the stores at once (its replicas read them there), as
        opposed to an offload at eviction, which the policy gates.

        Returns None, changing nothing, when that many rows cannot be freed.

        Raises:
          TypeError, ValueError: bad hashes or priority; nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        priority = check_priority(priority)
        new = list(itertools.filterfalse(self._slot.__contains__, dict.fromkeys(hashes)))
        if len(new) > self._room(priority):
            return None
        if priority < self.offload_min_priority:
            to_store = []
        elif not admit:
            to_store = new
        elif isinstance(self.admission, AlwaysAdmit):  # the default: no call per block
            to_store = new
            self.admission.admitted += len(new)
        else:
            to_store = [h for h in new if self.admission.admit(store_key(h))]
        self._stats.declined += len(new) - len(to_store)
        evicted = self._hold(to_store, priority, self._storing)
        return PrepareStoreOutput(to_store, StoreSpec(
            tuple(to_store), list(map(self._slot.__getitem__, to_store))), evicted)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Ends a `prepare_store`: the blocks become loadable, or, with `success=False`, give
        their rows back. Blocks already ready are left as they are.

        Raises:
          ValueError: a block the host pool does not hold (never prepared); nothing changes.
        """
        hashes = self._checked("block_hashes", block_hashes)
        unknown = set(itertools.filterfalse(self._slot.__contains__, hashes))
        if unknown:
            i = next(i for i, h in enumerate(hashes) if h in unknown)
            raise ValueError(f"block_hashes[{i}] was not prepared for storing")
        done = list(filter(self._storing.__contains__, dict.fromkeys(hashes)))
        self._storing.difference_update(done)
        if not success:
            self._forget(done)
            return
        self._ready.update(done)
        self._queue(done)
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
        held = list(filter(self._slot.__contains__, dict.fromkeys(hashes)))
        busy = set(itertools.filterfalse(self._ready.__contains__, held)).union(
            filter(self._protected.__contains__, held))
        if busy:
            i = next(i for i, h in enumerate(hashes) if h in busy)
            what = ("loaded" if hashes[i] in self._protected
                    else "stored" if hashes[i] in self._storing else "read")
            raise ValueError(f"block_hashes[{i}] is still being {what}")
        self._unqueue(held)
        self._forget(held)
        if held:
            self._event(held, MEDIUM_CPU, removed=True)

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
        return [h for p in sorted(self._lru) for h in self._lru[p]]

    @property
    def num_evictable_blocks(self) -> int:
        """How many blocks `eviction_order` lists."""
        return sum(map(len, self._lru.values()))

    def admission_reused(self, block_hashes: Iterable[BlockHash]) -> None:
        """Tells the admission policy that these stored blocks were loaded (its reuse rate)."""
        if self.admission.counts_reuse:
            for h in block_hashes:
                self.admission.reused(store_key(h))

    def host_slot(self, block_hash: BlockHash) -> int | None:
        """The host row of a block the host pool holds (in any state), else None."""
        return self._slot.get(check_block_hash("block_hash", block_hash))

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _checked(name: str, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        if isinstance(block_hashes, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of block hashes, got {block_hashes!r}")
        hashes = list(block_hashes)
        if set(map(type, hashes)) <= _HASH_TYPES:
            return hashes
        return [check_block_hash(f"{name}[{i}]", h) for i, h in enumerate(hashes)]

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

    def _read_pays(self, which: int, blocks: int) -> bool:
        """Whether reading `blocks` blocks from store `which` is expected to beat recomputing
        their tokens (ties recompute), or is a probe; yes without a recompute cost or a
        measured store. A read grows only by its bytes past its latency, so if reading fewer
        of the blocks paid, reading them all pays more."""
        c, store = self.recompute_s_per_token, self.stores[which]
        seconds = None if c is None else read_rate(store).seconds(blocks * store.row_nbytes)
        if seconds is None or seconds < blocks * self.block_size * c:
            return True
        self._reads_skipped += 1
        return self._reads_skipped % READ_PROBE_EVERY == 0

    def _room(self, priority: int) -> int:
        """Rows a block of `priority` can have: free ones, and those of ready, unprotected
        blocks of no higher priority."""
        return len(self._free) + sum(len(b) for p, b in self._lru.items() if p <= priority)

    def _evictable_among(self, hashes: list[BlockHash], priority: int) -> int:
        """How many of these blocks are evictable for a block of `priority`."""
        return sum(len(list(filter(b.__contains__, hashes)))
                   for p, b in self._lru.items() if p <= priority)

    def _protect(self, hashes: list[BlockHash]) -> None:
        """One more `prepare_load` protects these ready blocks."""
        self._unqueue(hashes)
        again = {h: self._protected[h] for h in filter(self._protected.__contains__, hashes)}
        self._protected.update(dict.fromkeys(hashes, 1))
        for h, n in again.items():  # loaded by several requests at once: rare
            self._protected[h] = n + 1

    def _queue(self, hashes: list[BlockHash]) -> None:
        """Ready blocks no longer protected join the eviction order as the most recently used,
        in order (the last the most recent: a block stored or loaded later is evicted later,
        as vLLM's LRU does)."""
        ready = list(itertools.filterfalse(self._protected.__contains__, hashes))
        by_priority = self._priority
        priorities = set(map(by_priority.__getitem__, ready))
        for p in priorities:
            bucket = self._lru.setdefault(p, {})
            members = ready if len(priorities) == 1 else [h for h in ready if by_priority[h] == p]
            bucket.update(dict.fromkeys(members))

    def _unqueue(self, hashes: list[BlockHash]) -> None:
        """These held blocks leave the eviction order (those in it)."""
        for p in set(map(self._priority.__getitem__, hashes)) & self._lru.keys():
            bucket = self._lru[p]
            _drain(map(bucket.__delitem__, list(filter(bucket.__contains__, hashes))))
            if not bucket:
                del self._lru[p]

    def _hold(self, hashes: list[BlockHash], priority: int, state: set) -> list[BlockHash]:
        """Rows for new blocks in `state` (free rows first, then evicting: the lowest priority,
        least recently used first; callers checked there is room), in ascending order; returns
        the evicted."""
        take = min(len(hashes), len(self._free))
        slots = self._free[:take]
        del self._free[:take]
        evicted: list[BlockHash] = []
        for p in sorted(self._lru):
            if len(slots) + len(evicted) == len(hashes):
                break
            bucket = self._lru[p]
            victims = list(itertools.islice(bucket, len(hashes) - len(slots) - len(evicted)))
            _drain(map(bucket.__delitem__, victims))
            if not bucket:
                del self._lru[p]
            evicted += victims
        if evicted:
            slots += map(self._slot.pop, evicted)
            _drain(map(self._priority.pop, evicted))
            self._ready.difference_update(evicted)
            self._stats.evicted += len(evicted)
            self._event(evicted, MEDIUM_CPU, removed=True)
        # The rows in ascending order: a batch handed over in its order (a prompt's blocks, first
        # to last) then lies in runs of consecutive rows, which one copy moves each way.
        slots.sort()
        self._slot.update(zip(hashes, slots))
        self._priority.update(dict.fromkeys(hashes, priority))
        state.update(hashes)
        return evicted

    def _forget(self, hashes: list[BlockHash]) -> None:
        """Blocks out of every state and queue leave the host pool: their rows are free."""
        self._free += map(self._slot.pop, hashes)
        _drain(map(self._priority.pop, hashes))
        self._ready.difference_update(hashes)

    def _event(self, hashes: list[BlockHash], medium: str, *, removed: bool) -> None:
        self._events.append(OffloadingEvent(list(hashes), self.block_size, medium, removed))


_HASH_TYPES = {int, bytes}


def _drain(iterator: Iterable) -> None:
    """Runs a map over builtin methods to its end at C speed (the idiom of itertools' recipes)."""
    collections.deque(iterator, maxlen=0)
