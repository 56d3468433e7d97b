"""`BlockManager`: the GPU pool's allocator and prefix index (prefix reuse, LRU eviction with
priorities, partial reuse), standing on the connector for everything below the GPU.

TensorRT-LLM: `BlockManager` / `WindowBlockManager` around its `KVCacheTransferManager`. The
host pool and the stores are the connector's (`jax_kvxfer.connector`), driven through the calls
an engine that owns its GPU pages makes: an evicted block is offered to the
`OffloadingManager` (`prepare_store`: its row, the admission policy, priorities, the host pool's
own eviction), the host blocks a prompt reuses are protected with `prepare_load` until their
copies are issued, and one `OffloadingWorker` moves them (GPU pages to host rows and back, host
rows to the stores and back). The connector knows a block by its 16-byte chained key; the
block index keeps every block's tokens, on the GPU or on the host, for matching.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Hashable, Sequence

from ..connector import LoadSpec, OffloadingManager, OffloadingWorker, StoreSpec
from ..connector.admission import AdmissionPolicy, admission_policy
from ..connector.lru import (
    DEFAULT_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    EvictionQueue,
    check_priority,
)
from ..observe import events as kv_events
from ..observe.metrics import BlockManagerReport, check_metrics_choice, check_name
from ..stores.base import Store, StoreStats
from ..transfer.manager import KVCacheTransferManager
from ..transfer.pool import KVCacheBlockPool
from .block_cache import (
    ROOT_KEY,
    BlockIndex,
    BlockManagerStats,
    CachedBlock,
    KeyChains,
    PoolExhaustedError,
    PrefixMatch,
    StepTransfers,
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
    """Full blocks of a prompt that only a store holds: per block its key, parent key and
    tokens."""

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
    # of whose tokens the prompt repeats: its key, parent key and tokens
    store_partial: _StoreRun | None = None

    def pool_blocks(self) -> list[CachedBlock]:
        return [b for run in self.runs if isinstance(run, list) for b in run]

    def store_blocks(self) -> int:
        return sum(len(run.chain) for run in self.runs if isinstance(run, _StoreRun))


@dataclasses.dataclass(eq=False)
class _Read:
    """A read of store blocks into host rows: the worker's job, and the blocks it reads (not yet
    in the index)."""

    job: int
    blocks: list[CachedBlock]
    success: bool | None = None  # None: still reading


class BlockManager:
    """Allocates KV-cache blocks to sequences and reuses cached prefixes across them.

    TensorRT-LLM: `BlockManager` (reuse, eviction policy, `onboardBlock`, `offloadBlock`).

    Blocks are found by a chained hash of (parent block's hash, the block's token ids). When the
    primary pool is full, the least recently used reusable block of the lowest priority is
    evicted: offered to the connector's host pool (`OffloadingManager.prepare_store`), which
    keeps it when its priority is at least `secondary_offload_min_priority` and the admission
    policy takes it (evicting its own LRU block of no higher priority if full), dropped
    otherwise. A prompt's matched host blocks are onboarded and leave the host pool (a block
    is kept in one place); a partially matched block is copied into a fresh block
    (copy-on-partial-reuse). Transfers are queued during allocation and handed to the
    connector's worker (and the transfer manager, for copies within the GPU pool) in batches;
    call `sync_transfers()` at the step boundary, after allocating and before the forward pass.

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
                 metrics: bool | None = None, name: str | None = None) -> None:
        """Args:
          pools: the pool(s) a block spans (their block counts and tokens per block agree).
          transfer_manager: moves the blocks (default: `KVCacheTransferManager(pools)`).
          secondary_offload_min_priority: evicted blocks of lower priority are not offloaded.
          enable_offload: False never offloads (TensorRT-LLM's `onboard_blocks=false`).
          enable_partial_reuse: False ignores partially matched blocks.
          admission: which evicted blocks of an offloaded priority are offloaded
            (jax_kvxfer.connector.admission): "reuse[:rate]" (None: every block while the blocks
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
            in vLLM's format, one batch per `sync_transfers` (jax_kvxfer.observe.events); None: the
            publisher of `events.publish_by_default`, if one is set.
          metrics: report the statistics to the process-wide Prometheus registry
            (jax_kvxfer.observe.metrics); None: when a metrics server has been started.
          name: the `manager` label of its metrics and its transfer manager's (None: a
            number); a name a live manager has gets "#2", "#3", ... (see `metrics_label`).
        """
        if isinstance(stores, Store):  # one store where a sequence is expected: one tier
            stores = (stores,)
        if events is not None and not isinstance(events, kv_events.KVEventPublisher):
            raise TypeError("events must be a jax_kvxfer.observe.events.KVEventPublisher or None, got "
                            f"{type(events).__name__}")
        events = events if events is not None else kv_events.default_publisher()
        report = check_metrics_choice(metrics)
        self.name = check_name(name)
        pools = checked_pools(pools)
        first = pools[0]
        self.tokens_per_block = first.tokens_per_block
        self.num_primary_blocks = first.num_primary_blocks
        self.num_secondary_blocks = first.num_secondary_blocks
        self.secondary_offload_min_priority = check_priority(secondary_offload_min_priority)
        self.enable_offload = bool(enable_offload)
        self.enable_partial_reuse = bool(enable_partial_reuse)
        self.transfer_manager = transfer_manager or KVCacheTransferManager(pools, metrics=report)
        self._free = collections.deque(range(self.num_primary_blocks))  # GPU pages unused
        self._reusable = EvictionQueue()  # cached GPU blocks no sequence uses
        self._index = BlockIndex()  # cached blocks on the GPU and on the host
        self._key_chains = KeyChains(self.tokens_per_block)  # recent prompts' block keys
        self._seqs: dict[Hashable, _Sequence] = {}
        self._next_block_id = 0
        self._stats = BlockManagerStats()
        self._queue = StepTransfers()
        # GPU blocks evicted since the host pool was last asked, offered to it together
        # (_offer_evicted): (block, the GPU page it leaves), all of one priority
        self._evicted: list[tuple[CachedBlock, int]] = []
        self._evicted_room = 0  # host rows their priority could have when the first was evicted
        # blocks the host pool's eviction queue took since the queued stores were last handed
        # over: a bound on how many of its blocks are behind the first one whose store is queued
        self._host_pushes = 0
        self._host, self._worker = self._connect(pools, stores, admission)
        self.admission = self._host.admission if self._host else admission_policy(admission)
        self._has_stores = bool(self._worker and self._worker.stores)
        self.store_on_release = bool(store_on_release) and self._has_stores
        self._jobs = itertools.count()  # the worker's job ids
        self._reads: dict[int, _Read] = {}  # by job, until the worker reports it finished
        self._prefetching: dict[bytes, _Read] = {}  # by the key of each block it reads
        # KV events: this step's raw events (events.STORED, ...), published at the boundary
        self._publisher = events
        self._events: list[tuple] | None = [(kv_events.CLEARED,)] if events is not None else None
        self._report = self._metrics_report() if report else None

    def _connect(self, pools: list[KVCacheBlockPool], stores: Sequence[Store],
                 admission: str | AdmissionPolicy | None
                 ) -> tuple[OffloadingManager | None, OffloadingWorker | None]:
        """The host pool and the stores: the connector's scheduler side, and its worker over
        these pools and this transfer manager (neither without a host pool)."""
        if not (self.num_secondary_blocks or stores):
            return None, None
        worker = OffloadingWorker.over_pools(pools, transfer_manager=self.transfer_manager,
                                             stores=stores)
        host = OffloadingManager(self.num_secondary_blocks, block_size=self.tokens_per_block,
                                 stores=worker.stores, admission=admission,
                                 offload_min_priority=self.secondary_offload_min_priority)
        return host, worker

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
        num_blocks = math.ceil(len(tokens) / self.tokens_per_block)
        pinned = [b for b in (*match.pool_blocks(), *([match.partial[0]] if match.partial
                                                      else [])) if b.is_primary]
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
        blocks, partial, reused = self._reuse(match, priority)
        s = self._stats
        s.prompt_tokens += len(tokens)
        s.reused_tokens += reused
        if partial:
            blocks.append(self._copy_partial(*partial))
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
        self._offer_evicted()
        parent, keys = ROOT_KEY, []
        t = self.tokens_per_block
        for i, block in enumerate(seq.blocks):
            tokens = tuple(seq.tokens[i * t:(i + 1) * t])
            if not store_for_reuse or not tokens:
                break
            if block.key is None:
                key = block_key(parent, tokens)
                old = self._index.by_key.get(key)
                if old is not None and old.ref_count == 0 and not old.is_primary:
                    self._drop_host_copy(old)  # the same content, now on the device: keep this
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
            keys.append(key)
            block.priority = seq.priority  # ref_count > 0: not in a queue, safe to change
            parent = key
        if keys and self.admission.counts_sightings and self._host is not None:
            # the blocks are on the GPU (one place per block): touching them only counts
            # sightings, for an admission policy that counts them
            self._host.touch(keys)
        # Last block first, so that a prefix is evicted after the blocks that extend it.
        for block in reversed(seq.blocks):
            self._unref(block)
        if self._queue.staged:  # store_on_release: the copies and writes start now, not at
            self._timed_issue()  # the next step (there may be none for a while)

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
        if self._worker is not None:
            self._collect_finished()
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
                blocks += self._read_store_blocks(run.chain, priority=DEFAULT_PRIORITY,
                                                  wait=False)
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
        self._collect_finished()
        t = self.tokens_per_block
        chains, full = self._key_chains, (len(tokens) - 1) // t
        for key in chains.extend(tokens, chains.chain(tokens), full)[:full]:  # the last token is never matched
            read = self._prefetching.get(key)
            if read is not None and read.success is None:
                return True
        return False

    def flush(self) -> None:
        """Issues the queued transfers and waits until every block written through to the
        stores so far is durable there (no-op without stores)."""
        if self._has_stores:
            self._timed_issue()
            self._worker.flush()

    def close(self) -> None:
        """Flushes the stores and stops the block manager's store threads (the stores
        themselves stay open: they are the caller's)."""
        if self._worker is not None:
            self._timed_issue()
            self._worker.close()
        if self._events:
            self._publish_events()

    def store_stats(self) -> dict[str, StoreStats]:
        """Each store's statistics since the last call, by tier name ("DISK", ...): blocks hit,
        missed and corrupt, bytes and seconds read and written, dropped writes."""
        if self._report is not None:
            return self._report.take_store_stats()
        return self._worker.store_stats() if self._worker is not None else {}

    @property
    def stats(self) -> BlockManagerStats:
        self._offer_evicted()  # the blocks evicted so far counted as offloaded or dropped
        return dataclasses.replace(self._stats)

    def get_and_reset_stats(self) -> BlockManagerStats:
        self._offer_evicted()
        if self._report is not None:  # the metrics keep what is reset
            return self._report.reset(self._swap_stats)
        return self._swap_stats()

    def _swap_stats(self) -> BlockManagerStats:
        stats, self._stats = self._stats, BlockManagerStats()
        return stats

    @property
    def num_free_primary_blocks(self) -> int:
        """Primary blocks holding nothing (reusable cached blocks are not counted)."""
        return len(self._free)

    @property
    def num_free_secondary_blocks(self) -> int:
        self._offer_evicted()
        return self._host.num_free_host_blocks if self._host is not None else 0

    def reusable_blocks(self, primary: bool = True) -> list[tuple[int, ...]]:
        """Token ids of the cached, unused blocks of one pool, in eviction order."""
        if primary:
            return [b.tokens for b in self._reusable]
        if self._host is None:
            return []
        self._offer_evicted()
        return [self._index.by_key[key].tokens for key in self._host.eviction_order()]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def cached_blocks(self, primary: bool = True) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of every cached block of one pool, in use or not: what its KV
        events say it holds (full blocks; `events.block_hash64(key)` is a block's hash)."""
        self._offer_evicted()
        return [(b.key, b.tokens) for b in self._index.by_key.values()
                if b.is_primary == primary]

    @property
    def metrics_label(self) -> str | None:
        """The `manager` label of this block manager's metrics (None: it does not report)."""
        return self._report.label if self._report is not None else None

    # -- matching ---------------------------------------------------------------------------

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
        self._offer_evicted()  # evicted blocks are matched where the host pool put them
        chains = self._key_chains
        keys = chains.chain(tokens)  # block i's key: keys[i], once extended that far
        if self._prefetching:  # the prompt's blocks being prefetched join the index first
            for key in chains.extend(tokens, keys, limit // t)[:limit // t]:
                self._finish_prefetch(key)
        runs: list[list[CachedBlock] | _StoreRun] = []
        parent, n = ROOT_KEY, 0
        while n + t <= limit:
            run = []  # blocks the pools hold
            while n + t <= limit:
                if n // t >= len(keys):  # hashed as far as the match goes (a miss: once)
                    chains.extend(tokens, keys, n // t + 1)
                block = self._index.block_of(keys[n // t], tokens[n:n + t])
                if block is None:
                    break
                run.append(block)
                parent, n = block.key, n + t
            if run:
                runs.append(run)
            if not self._has_stores or n + t > limit:
                break
            chain, key = [], parent  # blocks only a store may hold: up to one the pools hold
            chains.extend(tokens, keys, limit // t)
            for start in range(n, limit - t + 1, t):
                chunk = tokens[start:start + t]
                child = keys[start // t]
                if child in self._index.by_key:
                    break
                chain.append((child, key, chunk))
                key = child
            found = self._host.lookup_stores([c[0] for c in chain]) if chain else 0
            if not found:
                break
            runs.append(_StoreRun(chain[:found]))
            parent, n = chain[found - 1][0], n + found * t
            if found < len(chain):
                break
        partial = store_partial = None
        if self.enable_partial_reuse and n < limit:
            block, common = self._index.longest_partial(parent, tokens[n:min(n + t, limit)])
            if block is not None:
                partial, n = (block, common), n + common
            elif self._has_stores:  # a partly filled block of the prompt's tokens
                for m in range(min(t - 1, limit - n), 0, -1):  # (a store matches keys only)
                    chunk = tokens[n:n + m]
                    key = block_key(parent, chunk)
                    if self._host.lookup_stores([key]):
                        store_partial, n = _StoreRun([(key, parent, chunk)]), n + m
                        break
        return _Match(runs, partial, n, store_partial)

    def _reuse(self, match: _Match, priority: int
               ) -> tuple[list[CachedBlock], tuple[CachedBlock, int] | None, int]:
        """Takes a match's blocks for a new sequence (its GPU blocks are referenced already):
        onboards its host blocks, reads and onboards its store blocks, up to the first that
        does not arrive. Returns the blocks, the partial match still to copy (its source
        pinned) and the tokens reused."""
        partial, reused = match.partial, match.tokens
        on_host = [b for b in match.pool_blocks() if not b.is_primary]
        # Protected in the host pool before anything is evicted; a partially matched block is
        # counted as reused only once copied (a short store read may drop it).
        if on_host:
            self._pin_on_host(on_host)
        if partial and not partial[0].is_primary:
            self._pin_on_host([partial[0]], count_reuse=False)
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
                # read into host rows, then onboarded like host hits
                found = self._read_store_blocks(run.chain, priority=priority)
                s.store_hit_blocks += len(found)
                whole = len(found) == len(run.chain)
                if found:
                    self._pin_on_host(found)
                for block in found:
                    self._onboard(block)
                blocks += found
            elif whole:
                blocks += run
            else:  # after a block that did not arrive: not a prefix any more
                for block in run:
                    self._unref(block)
        if whole and match.store_partial is not None:
            found = self._read_store_blocks(match.store_partial.chain, priority=priority)
            if found:  # its pin is released once its copy is issued
                self._pin_on_host(found, count_reuse=False)
                partial = (found[0], len(found[0].tokens))
            else:
                reused -= len(match.store_partial.chain[0][2])
        if not whole:
            if partial:
                (self._unref if partial[0].is_primary else self._unpin)(partial[0])
                partial = None
            reused = len(blocks) * self.tokens_per_block
        return blocks, partial, reused

    # -- GPU blocks -------------------------------------------------------------------------

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

    # -- the host pool and the stores (the connector) ---------------------------------------

    def _offer_evicted(self) -> None:
        """Offers the blocks evicted from the GPU since the last call to the host pool: those
        it keeps (priority, admission, room) are queued to be stored there, the others are
        dropped. They are ready in the host pool at once: the worker runs their store before
        any job that reads their rows, and evicting one first issues the queue
        (_drop_evicted)."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
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
            read = _Read(next(self._jobs), [])
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

    def _store_blocks_arrived(self, reads: list[_Read]) -> list[CachedBlock]:
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

    def _issue(self) -> None:
        """Hands the queued transfers over: stores and loads to the worker, then copies within
        the GPU pool to the transfer manager. The worker runs them before any job handed over
        later, so the connector counts them done at once: loaded blocks leave the host pool,
        store_on_release's copies too."""
        self._offer_evicted()
        queue = self._queue
        if not queue:
            return
        self._queue = StepTransfers()
        staged = self._submit_stores(queue)
        if queue.load_keys:
            self._worker.submit_load(next(self._jobs), LoadSpec(tuple(queue.load_keys),
                                                                queue.load_rows),
                                     queue.load_pages,
                                     queue.load_tokens if queue.host_pins else None)
            self._host.complete_load(queue.load_keys)
            self._host_pushes += len(queue.host_pins)
            for block in queue.host_pins:
                block.ref_count -= 1
            if queue.moved:
                self._host.remove(queue.moved)
            self._publish_host_events()
        if queue.copies:
            self.transfer_manager.onboard_blocks(queue.copies, queue.copy_tokens)
            for block in queue.gpu_pins:
                self._unref(block)
        self._release_staged(staged)

    def _issue_stores(self) -> None:
        """Hands the queued stores over alone, loads and copies left queued: exact at any time,
        as no queued store reads a GPU page that a queued load or copy writes (an eviction
        from such a page issues the queue first). Blocks evicted from the GPU but not offered
        to the host pool yet keep their pages until their stores are queued: the loads that
        write those pages must wait for them."""
        self._release_staged(self._submit_stores(self._queue))

    def _submit_stores(self, queue: StepTransfers) -> list[bytes]:
        """Submits a queue's stores (taking them out of it); returns store_on_release's."""
        keys, pages, rows, staged = queue.take_stores()
        self._host_pushes = 0
        if keys:
            self._worker.submit_store(next(self._jobs), StoreSpec(tuple(keys), rows), pages)
        return staged

    def _release_staged(self, staged: list[bytes]) -> None:
        """store_on_release's copies, handed over: their rows are free again (the worker makes
        the rows' next users wait for the writes to the stores)."""
        if staged:  # kept on the GPU: not announced on the host (nor the stores)
            self._host.complete_store(staged)
            self._host.remove(staged)
            self._host.take_events()

    def _timed_issue(self) -> None:
        t0 = time.perf_counter()
        self._issue()
        self._stats.transfer_seconds += time.perf_counter() - t0

    # -- events and metrics -------------------------------------------------------------------

    def _publish_host_events(self) -> None:
        """The connector's events since its last call (blocks stored on or removed from the
        host pool, stored in the stores), published as the block manager's, with each
        block's parent and tokens."""
        events = self._host.take_events()
        if self._events is None:
            return
        for event in events:
            for key in event.block_hashes:
                block = self._index.by_key[key]
                if event.removed:
                    self._event_removed(block, event.medium)
                else:
                    self._event_stored(block, event.medium)

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

    def _metrics_report(self) -> BlockManagerReport:
        """Reports to the metrics under `name`, with its transfer manager's counters."""
        return BlockManagerReport(lambda: self._stats, self._metric_gauges,
                                  self._worker.store_stats if self._has_stores else None,
                                  name=self.name, transfers=self.transfer_manager.metrics_report)

    def _metric_gauges(self) -> dict:
        """The pools' use (and the stores' where they tell), read by a metrics scrape."""
        host = self._host
        out = {}
        for tier, total, free, reusable in (
                ("GPU", self.num_primary_blocks, len(self._free), len(self._reusable)),
                ("CPU", self.num_secondary_blocks, host.num_free_host_blocks if host else 0,
                 host.num_evictable_blocks if host else 0)):
            out[tier] = {"usage": (total - free) / total if total else 0.0, "free": free,
                         "reusable": reusable}
        if self._has_stores:
            used = ((s.tier, getattr(s, "used_bytes", None)) for s in self._worker.stores)
            out["stores"] = {tier: n for tier, n in used if isinstance(n, int)}
        return out
