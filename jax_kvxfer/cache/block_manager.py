"""`BlockManager`: prefix reuse, LRU eviction with priorities, offload to host and onboard back.

TensorRT-LLM: `BlockManager` / `WindowBlockManager` around its `KVCacheTransferManager`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Hashable, Sequence

from .. import events as kv_events
from ..connector.admission import AdmissionPolicy, admission_policy
from ..connector.lru import (
    DEFAULT_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    EvictionQueue,
    check_priority,
)
from ..connector.tiers import StoreTiers
from ..manager import KVCacheTransferManager
from ..metrics import BlockManagerReport, check_metrics_choice
from ..pool import KVCacheBlockPool
from ..stores.base import Store, StoreStats
from .block_cache import (
    ROOT_KEY,
    BlockIndex,
    BlockManagerStats,
    CachedBlock,
    PoolExhaustedError,
    PrefixMatch,
    TransferQueue,
    block_key,
    check_token_ids,
    checked_pools,
)


@dataclasses.dataclass(eq=False)
class _Sequence:
    tokens: list[int]
    blocks: list[CachedBlock]
    priority: int


@dataclasses.dataclass(eq=False)
class _StoreRun:
    """Full blocks of a prompt that only a store holds: which store, and per block its key,
    parent key and tokens."""

    store: int
    chain: list[tuple[bytes, bytes, tuple[int, ...]]]


@dataclasses.dataclass(eq=False)
class _Match:
    """What a prompt reuses: its full blocks in order, as runs that the GPU and host pools hold
    (lists of blocks) and runs that only a store holds (`_StoreRun`); then a partially matched
    block of the pools and its matching tokens; and the tokens reused in all, should every
    store block arrive intact."""

    runs: list[list[CachedBlock] | _StoreRun]
    partial: tuple[CachedBlock, int] | None
    tokens: int
    # else a partly filled block only a store holds (an earlier turn's reply tail, say), all
    # of whose tokens the prompt repeats: which store, and its key, parent key and tokens
    store_partial: _StoreRun | None = None

    def pool_blocks(self) -> list[CachedBlock]:
        return [b for run in self.runs if isinstance(run, list) for b in run]

    def store_blocks(self) -> int:
        return sum(len(run.chain) for run in self.runs if isinstance(run, _StoreRun))


@dataclasses.dataclass(eq=False)
class _Prefetch:
    """A store read into host rows that `prefetch` started."""

    future: object  # concurrent.futures.Future of the number of blocks read intact
    blocks: list[CachedBlock]  # secondary blocks, not yet in the index


class BlockManager:
    """Allocates KV-cache blocks to sequences and reuses cached prefixes across them.

    TensorRT-LLM: `BlockManager` (reuse, eviction policy, `onboardBlock`, `offloadBlock`).

    Blocks are found by a chained hash of (parent block's hash, the block's token ids). When the
    primary pool is full, the least recently used reusable block of the lowest priority is
    evicted: offloaded to the secondary pool when its priority is at least
    `secondary_offload_min_priority` (the secondary pool then evicts its own LRU block of no
    higher priority if full), dropped otherwise. A prompt's matched blocks in the secondary pool
    are onboarded; a partially matched block is copied into a fresh block
    (copy-on-partial-reuse). Transfers are queued during allocation and issued in batches; call
    `sync_transfers()` at the step boundary, after allocating and before the forward pass.

    Usage per step: `add_sequence` / `append_tokens` for every sequence, `sync_transfers()`,
    then run the model with `block_table(seq_id)` (primary block indices, in order); at the
    end, `release_sequence` stores the blocks for reuse. Add only tokens whose K/V the model
    writes: the cache holds what the sequence's tokens say it holds.
    """

    def __init__(self, pools: KVCacheBlockPool | Sequence[KVCacheBlockPool], *,
                 transfer_manager: KVCacheTransferManager | None = None,
                 secondary_offload_min_priority: int = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
                 enable_offload: bool = True, enable_partial_reuse: bool = True,
                 admission: str | AdmissionPolicy | None = None,
                 stores: Sequence[Store] = (), store_on_release: bool = False,
                 events: kv_events.KVEventPublisher | None = None,
                 metrics: bool | None = None) -> None:
        """Args:
          pools: the pool(s) a block spans (their block counts and tokens per block agree).
          transfer_manager: moves the blocks (default: `KVCacheTransferManager(pools)`).
          secondary_offload_min_priority: evicted blocks of lower priority are not offloaded.
          enable_offload: False never offloads (TensorRT-LLM's `onboard_blocks=false`).
          enable_partial_reuse: False ignores partially matched blocks.
          admission: which evicted blocks of an offloaded priority are offloaded
            (jax_kvxfer.cache.admission): "reuse[:rate]" (None: every block while the blocks
            onboarded from the host pool or read from the stores are at least rate, 0.05, of
            those offloaded, and for the first 4,096 offloads; else one in 16), "always",
            "second-sighting[:k]" (only blocks whose key was seen k times, 2 by default, in a
            decaying window; a sighting is a released sequence holding the block), or a
            policy object.
          stores: the tiers below the host pool, in order (`jax_kvxfer.stores`): every block
            offloaded to the host is written to them in the background, and a prefix found
            only there is read into host rows and onboarded. They need a host pool, on one
            device. Call `flush()` to make the writes durable, `close()` at the end.
          store_on_release: with stores, a released sequence's new blocks (of a priority
            that is offloaded) are also written to them at once, copied through free host
            rows, not only once evicted to the host: replicas sharing a store find a finished
            turn's blocks while this one still holds them on the GPU.
          events: publishes the cache's KV events (blocks stored and removed, per medium)
            in vLLM's format, one batch per `sync_transfers` (jax_kvxfer.events); None: the
            publisher of `events.publish_by_default`, if one is set.
          metrics: report the statistics to the process-wide Prometheus registry
            (jax_kvxfer.metrics); None: when a metrics server has been started.
        """
        if isinstance(stores, Store):  # one store where a sequence is expected: one tier
            stores = (stores,)
        if events is not None and not isinstance(events, kv_events.KVEventPublisher):
            raise TypeError("events must be a jax_kvxfer.events.KVEventPublisher or None, got "
                            f"{type(events).__name__}")
        events = events if events is not None else kv_events.default_publisher()
        report = check_metrics_choice(metrics)
        pools = checked_pools(pools)
        first = pools[0]
        self.tokens_per_block = first.tokens_per_block
        self.num_primary_blocks = first.num_primary_blocks
        self.num_secondary_blocks = first.num_secondary_blocks
        self.secondary_offload_min_priority = check_priority(secondary_offload_min_priority)
        self.enable_offload = bool(enable_offload)
        self.enable_partial_reuse = bool(enable_partial_reuse)
        self.admission = admission_policy(admission)
        self._sightings = self.admission if self.admission.counts_sightings else None
        self._reuse = self.admission if self.admission.counts_reuse else None
        self.transfer_manager = transfer_manager or KVCacheTransferManager(pools, metrics=report)
        self._free = {True: collections.deque(range(self.num_primary_blocks)),
                      False: collections.deque(range(self.num_secondary_blocks))}
        self._reusable = {True: EvictionQueue(), False: EvictionQueue()}
        self._index = BlockIndex()
        self._seqs: dict[Hashable, _Sequence] = {}
        self._next_block_id = 0
        self._stats = BlockManagerStats()
        self._queue = TransferQueue()
        self._tiers = StoreTiers(stores, pools, self.transfer_manager) if stores else None
        self._to_store: list[tuple[bytes, int]] = []  # offloaded, to write through at issue
        self.store_on_release = bool(store_on_release) and self._tiers is not None
        self._staged: list[int] = []  # host rows of store_on_release copies, freed at issue
        self._prefetching: dict[bytes, _Prefetch] = {}  # by the key of each block it reads
        # KV events: this step's raw events (events.STORED, ...), published at the boundary
        self._publisher = events
        self._events: list[tuple] | None = [(kv_events.CLEARED,)] if events is not None else None
        self._report = (BlockManagerReport(lambda: self._stats, self._metric_gauges,
                                           self._tiers.stats if self._tiers else None)
                        if report else None)

    # -- sequences -------------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], *,
                     priority: int = DEFAULT_PRIORITY) -> int:
        """Allocates blocks for a prompt, reusing its cached prefix; returns that prefix's length.

        The caller computes K/V for positions `[returned, len(token_ids))`; at least the last
        token is always left to compute (its logits are needed).

        Args:
          seq_id: any hashable id not in use.
          token_ids: the prompt (non-empty, non-negative ints).
          priority: 0-100, the retention priority its blocks get when released.

        Raises:
          KeyError: seq_id is in use. TypeError, ValueError: bad tokens or priority.
          PoolExhaustedError: the primary pool cannot hold the prompt (nothing is changed).
        """
        try:
            hash(seq_id)
        except TypeError as e:
            raise TypeError(f"seq_id must be hashable, got {seq_id!r}") from e
        if seq_id in self._seqs:
            raise KeyError(f"seq_id {seq_id!r} is already in use; release it first")
        tokens = check_token_ids("token_ids", token_ids)
        if not tokens:
            raise ValueError("token_ids must hold at least one token")
        priority = check_priority(priority)
        match = self._match(tokens)
        partial, reused = match.partial, match.tokens
        num_blocks = math.ceil(len(tokens) / self.tokens_per_block)
        pinned = [*match.pool_blocks(), *([partial[0]] if partial else [])]
        for block in pinned:
            self._ref(block)
        # only the first run's GPU blocks surely save a slot: a short store read drops the rest
        first = match.runs[0] if match.runs and isinstance(match.runs[0], list) else []
        need = num_blocks - sum(b.is_primary for b in first)
        if need > self._available_primary():
            for block in pinned:
                self._unref(block)
            raise PoolExhaustedError(
                f"add_sequence({seq_id!r}): needs {need} free primary blocks but only "
                f"{self._available_primary()} can be freed (the rest are in use by running "
                f"sequences); release sequences or use a larger primary pool")
        s = self._stats
        # Host hits are onboarded first, so that issuing gives their rows back for the store
        # reads should the host pool run short of rows to stage them in.
        for block in match.pool_blocks():
            if block.is_primary:
                s.reused_blocks += 1
            else:
                self._onboard(block)
        blocks, whole = [], True
        for run in match.runs:
            if isinstance(run, _StoreRun):
                if not whole:
                    continue
                # read into host rows, then onboarded like host hits (each run as it arrives)
                found = self._read_store_blocks(run.store, run.chain, priority=priority)
                s.store_hit_blocks += len(found)
                whole = len(found) == len(run.chain)
                for block in found:
                    self._onboard(block)
                blocks += found
            elif whole:
                blocks += run
            else:  # after a block that did not arrive: not a prefix any more
                for block in run:
                    self._unref(block)
        if whole and match.store_partial is not None:
            found = self._read_store_blocks(match.store_partial.store, match.store_partial.chain,
                                            priority=priority)
            if found:  # its reference is the pin the partial copy releases
                partial = (found[0], len(found[0].tokens))
            else:
                reused -= len(match.store_partial.chain[0][2])
        if not whole:
            if partial:
                self._unref(partial[0])
                partial = None
            reused = len(blocks) * self.tokens_per_block
        s.prompt_tokens += len(tokens)
        s.reused_tokens += reused
        if partial:
            src, n = partial
            dst = self._new_block()
            # The pin taken above is released once the copy is issued.
            self._queue.onboard(src, dst.slot, n, pin=src)
            if src.is_primary:
                s.partial_copies += 1
            else:
                s.partial_onboards += 1
                if self._reuse is not None:
                    self._reuse.reused(src.key)
            blocks.append(dst)
        while len(blocks) < num_blocks:
            blocks.append(self._new_block())
        self._seqs[seq_id] = _Sequence(list(tokens), blocks, priority)
        return reused

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Extends a sequence (e.g. by a generated token), allocating blocks as needed.

        Raises:
          KeyError: unknown seq_id. PoolExhaustedError: no block can be freed (no change).
        """
        seq = self._seq(seq_id)
        tokens = check_token_ids("token_ids", token_ids)
        need = math.ceil((len(seq.tokens) + len(tokens)) / self.tokens_per_block) - len(seq.blocks)
        if need > self._available_primary():
            raise PoolExhaustedError(f"append_tokens({seq_id!r}): needs {need} free primary "
                                     f"blocks, only {self._available_primary()} can be freed")
        seq.tokens.extend(tokens)
        for _ in range(need):
            seq.blocks.append(self._new_block())

    def release_sequence(self, seq_id: Hashable, *, store_for_reuse: bool = True) -> None:
        """Ends a sequence; its blocks become reusable (cached) unless `store_for_reuse=False`.

        TensorRT-LLM: `releaseBlocks` / `storeBlocks`. Blocks are keyed by the sequence's
        tokens, partially filled last block included; blocks whose content is already cached
        are freed.
        """
        self._seq(seq_id)
        seq = self._seqs.pop(seq_id)
        parent = ROOT_KEY
        t = self.tokens_per_block
        for i, block in enumerate(seq.blocks):
            tokens = tuple(seq.tokens[i * t:(i + 1) * t])
            if not store_for_reuse or not tokens:
                break
            if block.key is None:
                key = block_key(parent, tokens)
                old = self._index.by_key.get(key)
                if old is not None and old.ref_count == 0 and not old.is_primary:
                    self._drop_secondary(old)  # the same content, now on the device: keep this
                    old = None
                if old is None:
                    block.key, block.parent_key, block.tokens = key, parent, tokens
                    self._index.add(block)
                    if self.store_on_release:
                        self._stage_for_stores(block, seq.priority)
                    if self._events is not None:
                        self._event_stored(block, kv_events.MEDIUM_GPU)
            else:
                key = block.key
            if self._sightings is not None:
                self._sightings.seen(key)
            block.priority = seq.priority  # ref_count > 0: not in a queue, safe to change
            parent = key
        # Last block first, so that a prefix is evicted after the blocks that extend it.
        for block in reversed(seq.blocks):
            self._unref(block)
        if self._staged:  # store_on_release: the copies and writes start now, not at the next
            self._timed_issue()  # step (there may be none for a while)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's primary block indices, in token order (issues queued transfers)."""
        seq = self._seq(seq_id)
        self._timed_issue()
        return [b.slot for b in seq.blocks]

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seq(seq_id).tokens)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """What `add_sequence(token_ids)` would reuse, without allocating anything."""
        tokens = check_token_ids("token_ids", token_ids)
        match = self._match(tokens)
        full, partial = match.pool_blocks(), match.partial
        store_partial = match.store_partial
        return PrefixMatch(
            match.tokens, sum(b.is_primary for b in full), sum(not b.is_primary for b in full),
            len(store_partial.chain[0][2]) if store_partial else partial[1] if partial else 0,
            partial[0].is_primary if partial else None, match.store_blocks(),
            store_partial is not None)

    # -- step boundary and introspection ----------------------------------------------------

    def sync_transfers(self, block: bool = True) -> None:
        """Issues the queued transfers and joins them (the step boundary).

        TensorRT-LLM: `syncTransfers` after allocation, before the forward pass.

        Args:
          block: wait on the host until they are done; False: return at once, the GPU makes
            the next step wait for the onboards it reads (KVCacheTransferManager.sync_transfers).
        """
        t0 = time.perf_counter()
        self._issue()
        self.transfer_manager.sync_transfers(block=block)
        self._stats.transfer_seconds += time.perf_counter() - t0
        if self._events:
            self._publish_events()

    def prefetch(self, token_ids: Sequence[int]) -> int:
        """Starts reading, in the background, the blocks of this prompt's prefix that only a
        store holds into host rows, and returns at once the number of tokens they hold (0:
        nothing to read). Serve other requests meanwhile; `add_sequence` with this prefix then
        onboards them like host hits (waiting for the read if it is still running).

        Raises:
          TypeError, ValueError: bad token ids.
        """
        tokens = check_token_ids("token_ids", token_ids)
        match = self._match(tokens)
        blocks = []
        for run in match.runs:
            if isinstance(run, _StoreRun):
                blocks += self._read_store_blocks(run.store, run.chain,
                                                  priority=DEFAULT_PRIORITY, wait=False)
        return len(blocks) * self.tokens_per_block

    def prefetch_pending(self, token_ids: Sequence[int]) -> bool:
        """Whether a `prefetch` of this prompt's prefix is still reading, without waiting for
        it (`match_prefix` and `add_sequence` wait).

        Raises:
          TypeError, ValueError: bad token ids.
        """
        tokens = check_token_ids("token_ids", token_ids)
        if not self._prefetching:
            return False
        t, key = self.tokens_per_block, ROOT_KEY
        for start in range(0, len(tokens) - t, t):  # the last token is never matched
            key = block_key(key, tokens[start:start + t])
            prefetch = self._prefetching.get(key)
            if prefetch is not None and not prefetch.future.done():
                return True
        return False

    def flush(self) -> None:
        """Issues the queued transfers and waits until every block written through to the
        stores so far is durable there (no-op without stores)."""
        if self._tiers is not None:
            self._timed_issue()
            self._tiers.flush()

    def close(self) -> None:
        """Flushes the stores and stops the block manager's store threads (the stores
        themselves stay open: they are the caller's)."""
        if self._tiers is not None:
            self.flush()
            self._tiers.close()
        if self._events:
            self._publish_events()

    def store_stats(self) -> dict[str, StoreStats]:
        """Each store's statistics since the last call, by tier name ("DISK", ...): blocks hit,
        missed and corrupt, bytes and seconds read and written, dropped writes."""
        if self._report is not None:
            return self._report.take_store_stats()
        return self._tiers.stats() if self._tiers is not None else {}

    @property
    def stats(self) -> BlockManagerStats:
        return dataclasses.replace(self._stats)

    def get_and_reset_stats(self) -> BlockManagerStats:
        if self._report is not None:  # the metrics keep what is reset
            return self._report.reset(self._swap_stats)
        return self._swap_stats()

    def _swap_stats(self) -> BlockManagerStats:
        stats, self._stats = self._stats, BlockManagerStats()
        return stats

    @property
    def num_free_primary_blocks(self) -> int:
        """Primary blocks holding nothing (reusable cached blocks are not counted)."""
        return len(self._free[True])

    @property
    def num_free_secondary_blocks(self) -> int:
        return len(self._free[False])

    def reusable_blocks(self, primary: bool = True) -> list[tuple[int, ...]]:
        """Token ids of the cached, unused blocks of one pool, in eviction order."""
        return [b.tokens for b in self._reusable[primary]]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def cached_blocks(self, primary: bool = True) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of every cached block of one pool, in use or not: what its KV
        events say it holds (full blocks; `events.block_hash64(key)` is a block's hash)."""
        return [(b.key, b.tokens) for b in self._index.by_key.values()
                if b.is_primary == primary]

    @property
    def metrics_label(self) -> str | None:
        """The `manager` label of this block manager's metrics (None: it does not report)."""
        return self._report.label if self._report is not None else None

    # -- internals --------------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown seq_id {seq_id!r}") from None

    def _match(self, tokens: tuple[int, ...]) -> _Match:
        """The prompt's full blocks in order, from the GPU and host pools or a store, then an
        optional (block, n) partial match of the pools (a prompt's last, partly filled block
        of an earlier turn, say: its reply's tail)."""
        t, limit = self.tokens_per_block, len(tokens) - 1  # the last token is always computed
        if self._prefetching:  # the prompt's blocks being prefetched join the index first
            key = ROOT_KEY
            for start in range(0, limit - t + 1, t):
                key = block_key(key, tokens[start:start + t])
                self._finish_prefetch(key)
        runs: list[list[CachedBlock] | _StoreRun] = []
        parent, n = ROOT_KEY, 0
        while n + t <= limit:
            run = []  # blocks the pools hold
            while n + t <= limit:
                block = self._index.full_block(parent, tokens[n:n + t])
                if block is None:
                    break
                run.append(block)
                parent, n = block.key, n + t
            if run:
                runs.append(run)
            if self._tiers is None or n + t > limit:
                break
            chain, key = [], parent  # blocks only a store may hold: up to one the pools hold
            for start in range(n, limit - t + 1, t):
                chunk = tokens[start:start + t]
                child = block_key(key, chunk)
                if child in self._index.by_key:
                    break
                chain.append((child, key, chunk))
                key = child
            which, found = self._tiers.lookup([c[0] for c in chain]) if chain else (0, 0)
            if not found:
                break
            runs.append(_StoreRun(which, chain[:found]))
            parent, n = chain[found - 1][0], n + found * t
            if found < len(chain):
                break
        partial = store_partial = None
        if self.enable_partial_reuse and n < limit:
            block, common = self._index.longest_partial(parent, tokens[n:min(n + t, limit)])
            if block is not None:
                partial, n = (block, common), n + common
            elif self._tiers is not None:  # a partly filled block of the prompt's tokens
                for m in range(min(t - 1, limit - n), 0, -1):  # (a store matches keys only)
                    chunk = tokens[n:n + m]
                    key = block_key(parent, chunk)
                    which, found = self._tiers.lookup([key])
                    if found:
                        store_partial, n = _StoreRun(which, [(key, parent, chunk)]), n + m
                        break
        return _Match(runs, partial, n, store_partial)

    def _read_store_blocks(self, which: int, chain: list, *, priority: int,
                           wait: bool = True) -> list[CachedBlock]:
        """Reads the chain's blocks from store `which` into free host rows (as many as the
        host pool can give, at this priority); with `wait`, returns the blocks that arrived
        intact, from the first, referenced and in the index. Without it, see `prefetch`."""
        slots = []
        for _ in chain:
            slot = self._secondary_slot(priority)
            if slot is None and self._queue.frees_secondary():
                self._timed_issue()  # queued onboards give their source rows back
                slot = self._secondary_slot(priority)
            if slot is None:
                break
            slots.append(slot)
        chain = chain[:len(slots)]
        if not chain:
            return []
        # A slot may have been taken from a host block whose offload is still queued: issue
        # it now, so that it lands before the read writes the row (the read waits for it).
        self._timed_issue()
        future = self._tiers.read(which, [c[0] for c in chain], slots)
        blocks = []
        for (key, parent, tokens), slot in zip(chain, slots):
            blocks.append(CachedBlock(self._next_block_id, slot, False, key, parent, tokens,
                                      priority, ref_count=1))
            self._next_block_id += 1
        if not wait:
            prefetch = _Prefetch(future, blocks)
            for block in blocks:
                self._prefetching[block.key] = prefetch
            return blocks
        return self._store_blocks_arrived(future.result(), blocks)

    def _store_blocks_arrived(self, intact: int, blocks: list[CachedBlock]) -> list[CachedBlock]:
        """The first `intact` blocks read from a store join the index (a block the host or GPU
        pool got meanwhile is not stored twice); the rest give their host rows back."""
        kept = []
        for i, block in enumerate(blocks):
            if i < intact and block.key not in self._index.by_key:
                self._index.add(block)
                kept.append(block)
                if self._events is not None:
                    self._event_stored(block, kv_events.MEDIUM_CPU)
            else:
                self._free[False].append(block.slot)
                block.key = None
        return kept

    def _finish_prefetch(self, key: bytes) -> None:
        """Waits for the prefetch reading `key`, if any; its blocks join the index as reusable
        host blocks."""
        prefetch = self._prefetching.get(key)
        if prefetch is None:
            return
        for block in prefetch.blocks:
            self._prefetching.pop(block.key, None)
        for block in self._store_blocks_arrived(prefetch.future.result(), prefetch.blocks):
            block.ref_count = 0
            self._reusable[False].push(block)

    def _available_primary(self) -> int:
        return len(self._free[True]) + len(self._reusable[True])

    def _ref(self, block: CachedBlock) -> None:
        if block.ref_count == 0 and block.key is not None:
            self._reusable[block.is_primary].remove(block)
        block.ref_count += 1

    def _unref(self, block: CachedBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self._reusable[block.is_primary].push(block)
            else:
                self._free[block.is_primary].append(block.slot)

    def _new_block(self) -> CachedBlock:
        block = CachedBlock(self._next_block_id, self._primary_slot(), True, ref_count=1)
        self._next_block_id += 1
        return block

    def _onboard(self, block: CachedBlock) -> None:
        """Moves a matched (referenced) secondary block back into a primary slot."""
        dst = self._primary_slot()
        # Its secondary slot is freed once the onboard reading it is issued.
        self._queue.onboard(block, dst, 0, free_secondary_slot=block.slot)
        if self._reuse is not None:  # a host hit, or a block an offload wrote to a store
            self._reuse.reused(block.key)
        block.slot, block.is_primary = dst, True
        if self._events is not None:  # the block moves: gone from the host, on the GPU
            self._event_removed(block, kv_events.MEDIUM_CPU)
            self._event_stored(block, kv_events.MEDIUM_GPU)
        self._stats.onboarded_blocks += 1

    def _primary_slot(self) -> int:
        """A free primary slot, evicting (offloading or dropping) a reusable block if needed."""
        if self._free[True]:
            return self._free[True].popleft()
        victim = self._reusable[True].peek()
        assert victim is not None, "callers check _available_primary first"
        self._reusable[True].remove(victim)
        if self._queue.writes_primary(victim.slot):
            # Queued offloads are issued before queued onboards; this offload must read what
            # a queued onboard writes, so issue the queue first.
            self._timed_issue()
        dst = None
        if (self.enable_offload and self.num_secondary_blocks
                and victim.priority >= self.secondary_offload_min_priority
                and self.admission.admit(victim.key)):
            dst = self._secondary_slot(victim.priority)
        slot = victim.slot
        if self._events is not None:
            self._event_removed(victim, kv_events.MEDIUM_GPU)
        if dst is None:
            self._index.remove(victim)
            self._stats.dropped_primary_blocks += 1
            return slot
        self._queue.offload(victim, dst)
        if self._tiers is not None:
            self._to_store.append((victim.key, dst))
        victim.slot, victim.is_primary = dst, False
        if self._events is not None:  # on the host now, and written through to the stores
            self._event_stored(victim, kv_events.MEDIUM_CPU)
            for tier in dict.fromkeys(s.tier for s in self._tiers.stores) if self._tiers else ():
                self._event_stored(victim, tier)
        self._reusable[False].push(victim)
        self._stats.offloaded_blocks += 1
        return slot

    def _secondary_slot(self, priority: int) -> int | None:
        """A free secondary slot; else drops the secondary LRU block of priority <= `priority`.
        A store write still reading the slot's row finishes first."""
        if self._free[False]:
            slot = self._free[False].popleft()
        else:
            victim = self._reusable[False].peek()
            if victim is None or victim.priority > priority:
                return None
            self._stats.dropped_secondary_blocks += 1
            slot = self._drop_secondary(victim, free_slot=False)
        if self._tiers is not None:
            self._tiers.wait_written(slot)
        return slot

    def _stage_for_stores(self, block: CachedBlock, priority: int) -> None:
        """store_on_release: queues a copy of a primary block into a host row, written
        through to the stores once issued; the row is free again after that (a later user
        waits for the write). Blocks of a priority that is not offloaded, or with no row to
        spare, reach the stores only if evicted."""
        if not block.is_primary or priority < self.secondary_offload_min_priority:
            return
        dst = self._secondary_slot(priority)
        if dst is None:
            return
        self._queue.offload(block, dst)
        self._to_store.append((block.key, dst))
        self._staged.append(dst)

    def _drop_secondary(self, block: CachedBlock, free_slot: bool = True) -> int:
        if self._events is not None:
            self._event_removed(block, kv_events.MEDIUM_CPU)
        self._reusable[False].remove(block)
        self._index.remove(block)
        if any(slot == block.slot for _, slot in self._to_store):
            # Its offload is still queued: issue it, so that the block is written through
            # before the row is reused (the next user of the slot waits for that write).
            self._timed_issue()
        if free_slot:
            self._free[False].append(block.slot)
        return block.slot

    def _issue(self) -> None:
        pins, slots, rows = self._queue.issue(self.transfer_manager)
        for block in pins:
            self._unref(block)
        self._free[False].extend(slots)
        if self._tiers is not None and rows:
            # the host rows these transfers touch: a store read into one waits for them
            self._tiers.touched(rows)
        if self._to_store:  # the offloads into these rows are issued: write them through
            self._tiers.write_through(*zip(*self._to_store))
            self._to_store = []
        if self._staged:  # store_on_release's rows: reused only once written (wait_written)
            self._free[False].extend(self._staged)
            self._staged = []

    def _timed_issue(self) -> None:
        t0 = time.perf_counter()
        self._issue()
        self._stats.transfer_seconds += time.perf_counter() - t0

    # -- events and metrics -------------------------------------------------------------------

    def _event_stored(self, block: CachedBlock, medium: str) -> None:
        """A full block is now held on `medium` (partly filled blocks are not published: a
        router matches whole blocks, and Dynamo's rejects shorter ones)."""
        if len(block.tokens) == self.tokens_per_block:
            parent = None if block.parent_key == ROOT_KEY else block.parent_key
            self._events.append((kv_events.STORED, medium, block.key, parent, block.tokens,
                                 self.tokens_per_block))

    def _event_removed(self, block: CachedBlock, medium: str) -> None:
        if len(block.tokens) == self.tokens_per_block:
            self._events.append((kv_events.REMOVED, medium, block.key))

    def _publish_events(self) -> None:
        events, self._events = self._events, []
        self._publisher.publish(events)

    def _metric_gauges(self) -> dict:
        """The pools' use (and the stores' where they tell), read by a metrics scrape."""
        out = {}
        for tier, primary, total in (("GPU", True, self.num_primary_blocks),
                                     ("CPU", False, self.num_secondary_blocks)):
            free = len(self._free[primary])
            out[tier] = {"usage": (total - free) / total if total else 0.0, "free": free,
                         "reusable": len(self._reusable[primary])}
        if self._tiers is not None:
            used = ((s.tier, getattr(s, "used_bytes", None)) for s in self._tiers.stores)
            out["stores"] = {tier: n for tier, n in used if isinstance(n, int)}
        return out
