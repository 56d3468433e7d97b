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

Its private machinery lives beside it, one module per responsibility (`prefix_match`,
`gpu_blocks`, `host_tiers`, `step_issue`, `kv_reporting`), as base classes over its state.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Hashable, Sequence

from ..connector import OffloadingManager, OffloadingWorker
from ..connector.admission import AdmissionPolicy, admission_policy
from ..connector.lru import (
    DEFAULT_PRIORITY,
    DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
    EvictionQueue,
    check_priority,
)
from ..connector.tiers import check_recompute_cost
from ..observe import events as kv_events
from ..observe.metrics import check_metrics_choice, check_name
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
from .gpu_blocks import GpuBlocks
from .host_tiers import HostTiers, StoreRead
from .kv_reporting import EventsAndMetrics
from .prefix_match import Match, PrefixMatching, StoreRun
from .step_issue import TransferIssuing


def _checked_publisher(events: object) -> kv_events.KVEventPublisher | None:
    """The publisher given, else the process's default (None where none is set)."""
    if events is not None and not isinstance(events, kv_events.KVEventPublisher):
        raise TypeError("events must be a jax_kvxfer.observe.events.KVEventPublisher or None, "
                        f"got {type(events).__name__}")
    return events if events is not None else kv_events.default_publisher()


def _checked_read_prior(prior: object) -> tuple[float, float] | None:
    """`store_read_prior`: None, or (bytes per second > 0, seconds per read >= 0)."""
    if prior is None:
        return None
    if (not isinstance(prior, (tuple, list)) or len(prior) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in prior)):
        raise TypeError("store_read_prior must be (bytes per second, seconds per read) or "
                        f"None, got {prior!r}")
    throughput, latency = map(float, prior)
    if not (0 < throughput and 0 <= latency < math.inf):
        raise ValueError("store_read_prior must be (bytes per second > 0, seconds per read "
                         f">= 0 and finite), got {prior!r}")
    return throughput, latency


@dataclasses.dataclass(eq=False)
class _Sequence:
    tokens: list[int]
    blocks: list[CachedBlock]
    priority: int


# The base classes are this class's private parts, split by responsibility so that each can
# be read alone; they share the state that `__init__` sets and call each other's methods.
class BlockManager(PrefixMatching, GpuBlocks, HostTiers, TransferIssuing, EventsAndMetrics):
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

    A store never slows serving once the cost of recomputing a token is known
    (`recompute_s_per_token`, `set_recompute_cost`): a run of blocks only a store holds is
    read only where its read is expected to finish before recomputing its tokens would, by
    the store's measured reads (`connector.tiers.read_rate`: latency + bytes / throughput,
    fitted to what its reads took, recent ones weighing most; `store_read_prior` until
    `connector.tiers.MIN_READS` are measured). Otherwise the match stops before it and the
    prompt recomputes it (`BlockManagerStats.store_skipped_blocks`); one such match in
    `connector.tiers.READ_PROBE_EVERY` is read anyway, so that the estimate follows a
    store that got faster. By the same estimate, `store_on_release` does not write a block
    that no store could read back faster than the model recomputes it
    (`BlockManagerStats.store_declined_blocks`; one in READ_PROBE_EVERY written anyway).
    """

    def __init__(self, pools: KVCacheBlockPool | Sequence[KVCacheBlockPool], *,
                 transfer_manager: KVCacheTransferManager | None = None,
                 secondary_offload_min_priority: int = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY,
                 enable_offload: bool = True, enable_partial_reuse: bool = True,
                 admission: str | AdmissionPolicy | None = None,
                 stores: Sequence[Store] = (), store_on_release: bool = False,
                 events: kv_events.KVEventPublisher | None = None,
                 metrics: bool | None = None, name: str | None = None,
                 recompute_s_per_token: float | None = None,
                 store_read_prior: tuple[float, float] | None = None) -> None:
        """Args:
          pools: the pool(s) a block spans (their block counts and tokens per block agree).
          transfer_manager: moves the blocks (default: `KVCacheTransferManager(pools)`).
          secondary_offload_min_priority: evicted blocks of lower priority are not offloaded.
          enable_offload: False never offloads (TensorRT-LLM's `onboard_blocks=false`).
          enable_partial_reuse: False ignores partially matched blocks.
          admission: which evicted blocks of an offloaded priority are offloaded:
            "reuse[:rate]" (None), "always", "second-sighting[:k]" or a policy object; what
            each does is in jax_kvxfer.connector.admission.
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
          recompute_s_per_token: seconds the model takes to compute one prompt token's K/V
            (the serving loop's measured prefill rate, inverted; `set_recompute_cost` updates
            it): store blocks are read only where that is expected to be faster. None: always
            read them.
          store_read_prior: (bytes/s, seconds a read) a store is assumed to read at until
            `connector.tiers.MIN_READS` reads are measured; None: read it until then.
        """
        self._init_store_reads(recompute_s_per_token, store_read_prior)
        if isinstance(stores, Store):  # one store where a sequence is expected: one tier
            stores = (stores,)
        events = _checked_publisher(events)
        report = check_metrics_choice(metrics)
        self.name = check_name(name)
        pools = checked_pools(pools)
        first = pools[0]
        self.tokens_per_block = first.tokens_per_block
        self._row_nbytes = sum(p.block_nbytes for p in pools)  # what a store read moves a block
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
        # blocks the host pool took since the queued stores were last handed over: a bound on
        # how many of its blocks are behind the first one whose store is queued
        self._host_pushes = 0
        self._host, self._worker = self._connect(pools, stores, admission)
        self.admission = self._host.admission if self._host else admission_policy(admission)
        self._has_stores = bool(self._worker and self._worker.stores)
        self.store_on_release = bool(store_on_release) and self._has_stores
        # KV events: this step's raw events (events.STORED, ...), published at the boundary
        self._publisher = events
        self._events: list[tuple] | None = [(kv_events.CLEARED,)] if events is not None else None
        self._report = self._metrics_report() if report else None

    def _init_store_reads(self, recompute_s_per_token: float | None,
                          store_read_prior: tuple[float, float] | None) -> None:
        """The state of reading blocks from the stores: whether a read pays, and the reads in
        flight."""
        self.set_recompute_cost(recompute_s_per_token)
        self.store_read_prior = _checked_read_prior(store_read_prior)
        self._reads_skipped = 0  # matches read that skipped a store read (for the probes)
        self._writes_declined = 0  # store_on_release's blocks that did not pay (the probes)
        self._store_answers: dict = {}  # the stores' lookups this step (`_asked_stores`)
        self._jobs = itertools.count()  # the worker's job ids
        self._reads: dict[int, StoreRead] = {}  # by job, until the worker reports it finished
        self._prefetching: dict[bytes, StoreRead] = {}  # by the key of each block it reads

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
        pinned, need = self._pin_match(match, num_blocks)
        if need > self._available_primary() and len(pinned) > num_blocks - need:
            # GPU blocks past the first run hold slots that a short store read would not give
            # back: the first run alone is reused, the rest computed
            for block in pinned:
                self._unref(block)
            kept = 1 if match.runs and isinstance(match.runs[0], list) else 0
            match = Match(match.runs[:kept], None, len(match.runs[0]) * self.tokens_per_block
                          if kept else 0, None, match.skipped)
            pinned, need = self._pin_match(match, num_blocks)
        available = self._available_primary()
        if need > available:
            for block in pinned:
                self._unref(block)
            raise PoolExhaustedError(
                f"add_sequence({seq_id!r}): needs {need} free primary blocks but only "
                f"{available} can be freed (the rest are in use by running sequences, or "
                f"held for this prompt's reuse); release sequences or use a larger primary "
                f"pool")
        blocks, partial, reused = self._reuse(match, priority)
        s = self._stats
        s.prompt_tokens += len(tokens)
        s.reused_tokens += reused
        s.store_skipped_blocks += match.skipped
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
        for i, block in enumerate(seq.blocks if store_for_reuse else ()):
            if block.key is None:  # (a reused block's key and tokens are its own already)
                tokens = tuple(seq.tokens[i * t:(i + 1) * t])
                if not tokens:  # a block allocated ahead of its first token
                    break
                key = block_key(parent, tokens)
                old = self._index.by_key.get(key)
                if old is not None and old.ref_count == 0 and not old.is_primary:
                    self._drop_host_copy(old)  # the same content, now on the device: keep this
                    old = None
                if old is None:
                    block.key, block.parent_key, block.tokens = key, parent, tokens
                    self._index.add(block)
                    if self.store_on_release and self._store_writes_pay():
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

    def _pin_match(self, match: Match, num_blocks: int) -> tuple[list[CachedBlock], int]:
        """References the match's GPU blocks (so that nothing evicts them); returns them and
        the free primary blocks the sequence needs: only the first run's GPU blocks surely
        save a slot (a short store read drops the rest)."""
        pinned = [b for b in (*match.pool_blocks(), *([match.partial[0]] if match.partial
                                                      else [])) if b.is_primary]
        for block in pinned:
            self._ref(block)
        first = match.runs[0] if match.runs and isinstance(match.runs[0], list) else []
        return pinned, num_blocks - sum(b.is_primary for b in first)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """What `add_sequence(token_ids)` would reuse, without allocating anything. The stores
        are asked once a step: their answers hold until the next `sync_transfers` (or
        `flush`), so `add_sequence` after it does not ask them again; poll across steps."""
        tokens = check_token_ids("token_ids", token_ids)
        match = self._match(tokens, reading=False)
        full, partial = match.pool_blocks(), match.partial
        store_partial = match.store_partial
        return PrefixMatch(
            match.tokens, sum(b.is_primary for b in full), sum(not b.is_primary for b in full),
            len(store_partial.chain[0][2]) if store_partial else partial[1] if partial else 0,
            partial[0].is_primary if partial else None, match.store_blocks(),
            store_partial is not None, match.skipped)

    def set_recompute_cost(self, s_per_token: float | None) -> None:
        """Seconds the model takes to compute one prompt token's K/V (the measured prefill
        rate, inverted), for deciding whether a store read pays (see the class docstring);
        None: always read. Call it again as the measurement changes.

        Raises:
          TypeError, ValueError: not None nor a finite number > 0 (nothing changes).
        """
        self.recompute_s_per_token = check_recompute_cost(s_per_token)

    # -- step boundary and introspection ----------------------------------------------------

    def sync_transfers(self, block: bool = True, layer_wise: bool = False) -> None:
        """Issues the queued transfers and joins them (the step boundary).

        TensorRT-LLM: `syncTransfers` after allocation, before the forward pass.

        Args:
          block: wait on the host until they are done; False: return at once, the GPU makes
            the next step wait for the onboards it reads (KVCacheTransferManager.sync_transfers).
          layer_wise: with block=False, the next step waits for them itself, layer by layer
            (`wait_for_layers`; KVCacheTransferManager.sync_transfers).
        """
        t0 = time.perf_counter()
        self._store_answers.clear()
        self._issue()
        self.transfer_manager.sync_transfers(block=block, layer_wise=layer_wise)
        self._stats.transfer_seconds += time.perf_counter() - t0
        if self._worker is not None:
            self._collect_finished()
        if self._events:
            self._publish_events()

    def publish_events(self) -> None:
        """Publishes the KV events gathered since the last step boundary now, not at the next
        `sync_transfers`: a released sequence's blocks are stored at its release, and a
        router deciding where the next request goes learns of them at once, even where no
        step follows soon. Nothing without a publisher or events."""
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
            if isinstance(run, StoreRun):
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
        full = (len(tokens) - 1) // t  # the last token is never matched
        for key in self._key_chains.keys(tokens, full)[:full]:
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
            self._store_answers.clear()  # what the stores hold changed

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

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown seq_id {seq_id!r}") from None
