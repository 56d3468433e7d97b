"""`OffloadingWorker`: the worker side of the connector. It moves the blocks the scheduler side
placed: GPU pages of the engine's own arrays to host rows and back, host rows to the stores
and back, on the transfer manager's lanes, beside the engine's step.

vLLM v1: the offloading connector's worker (`submit` a transfer with a job id,
`get_finished`, `wait`). Jobs take effect in the order submitted: a load whose blocks a store
must first read waits for that read, and jobs submitted after it wait behind it; the engine's
arrays, read through `kv_caches`, are ordered after every load issued. A prefetch (a load with
no GPU pages) writes only host rows that the manager gave it and no other job touches, so
nothing waits behind it: it ends when its reads do.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..stores.base import Store, StoreStats
from ..transfer.manager import KVCacheTransferManager
from ..transfer.pool import KVCacheBlockPool
from .specs import HostSpec, JobId, LoadSpec, StoreSpec, store_key
from .tiers import StoreTiers


@dataclasses.dataclass(eq=False)
class _Job:
    job_id: JobId
    is_load: bool
    host_slots: np.ndarray
    gpu_pages: np.ndarray
    reads: list[tuple[int, concurrent.futures.Future]]  # (blocks expected, future of intact)
    num_tokens: np.ndarray | None = None  # a load's tokens per page (None: whole blocks)
    store_keys: list[bytes] | None = None  # a store job's keys, to write through to the stores
    fence: Any = None  # set once issued
    success: bool = True
    prefetch: bool = False  # store reads into host rows only

    def reads_done(self) -> bool:
        return all(future.done() for _, future in self.reads)

    def reads_intact(self) -> bool:
        """Every block of every read arrived intact (the reads are done)."""
        return all(future.result() == n for n, future in self.reads)


class OffloadingWorker:
    """Moves blocks between an engine's KV-cache arrays (GPU pages), a pinned host pool and the
    stores, as the `OffloadingManager`'s specs say."""

    def __init__(self, kv_caches: Any, *, num_host_blocks: int, token_axis: int,
                 block_axis: int = 0, stores: Store | Sequence[Store] = (),
                 dma: bool | str = "auto", layer_groups: int = 1) -> None:
        """Args:
          kv_caches: the engine's arrays, one per layer (or per layer and K/V), as
            `KVCacheBlockPool.from_layers` takes them (one device, or split by heads); their
            blocks are the engine's pages.
          num_host_blocks: rows of the pinned host pool (the manager's number).
          token_axis, block_axis: where the arrays keep a page's tokens and their pages.
          stores: the tiers below the host pool, bound here to the host rows' layout; give
            the manager the same (`stores=worker.stores`).
          dma, layer_groups: as for `KVCacheTransferManager` (a load lands in groups of
            arrays, for a step that waits for them layer by layer: `kv_caches_by_layer`).

        Raises:
          TypeError, ValueError: arrays or arguments that do not fit, named.
          MemoryError: the host pool does not fit the pinned-host limit.
        """
        pool = KVCacheBlockPool.from_layers(kv_caches, token_axis=token_axis,
                                            block_axis=block_axis,
                                            num_secondary_blocks=num_host_blocks)
        self._setup([pool], KVCacheTransferManager([pool], dma=dma, layer_groups=layer_groups),
                    stores)

    @classmethod
    def over_pools(cls, pools: Sequence[KVCacheBlockPool], *,
                   transfer_manager: KVCacheTransferManager | None = None,
                   stores: Store | Sequence[Store] = ()) -> OffloadingWorker:
        """A worker over pools made already (`KVCacheBlockPool.create`'s, one or several, a
        block spanning all): their primary blocks are the pages, their secondary arrays the
        host rows. `transfer_manager`: the one moving these pools (default: a new one)."""
        pools = [pools] if isinstance(pools, KVCacheBlockPool) else list(pools)
        worker = cls.__new__(cls)
        worker._setup(pools, transfer_manager or KVCacheTransferManager(pools), stores)
        return worker

    def _setup(self, pools: list[KVCacheBlockPool], transfer_manager: KVCacheTransferManager,
               stores: Store | Sequence[Store]) -> None:
        stores = [stores] if isinstance(stores, Store) else list(stores)
        if list(transfer_manager.pools) != pools:
            raise ValueError("transfer_manager must move exactly these pools, in this order")
        self.pools = tuple(pools)
        self.transfer_manager = transfer_manager
        self._tiers = StoreTiers(stores, pools, transfer_manager) if stores else None
        self.stores: tuple[Store, ...] = self._tiers.stores if self._tiers else ()
        self._pending: collections.deque[_Job] = collections.deque()  # not issued yet
        self._issued: list[_Job] = []  # issued, not reported yet
        self._ids: set[JobId] = set()

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_primary_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.pools[0].num_secondary_blocks

    # -- the engine's arrays -------------------------------------------------------------------

    @property
    def kv_caches(self) -> list:
        """The engine's arrays, ordered after every load issued (a load still waiting for a
        store read is not: `wait` for it, or see it in `get_finished`, before reading its
        pages). Assign the step's new arrays back (donated or not)."""
        self._issue_ready()
        return self.pools[0].primary

    @kv_caches.setter
    def kv_caches(self, arrays: Any) -> None:
        self.pools[0].primary = arrays

    def kv_caches_by_layer(self) -> list:
        """The engine's arrays for a step that waits for the loads layer by layer, as vLLM's
        connector calls `wait_for_layer_load` in each layer: inside its jitted step, the
        engine passes array i through `jax_kvxfer.wait_for_layers(array, i + 1)` before
        reading it, so that its first layers compute while the later ones still land (with
        `layer_groups`). Not waiting for an array reads pages still being written: the step
        must wait for every array it reads, and be the next thing that reads them. Ordered
        after the loads issued, as `kv_caches`; assign the step's new arrays back."""
        self._issue_ready()
        self.transfer_manager.sync_transfers(block=False, layer_wise=True)
        return self.pools[0].primary

    # -- jobs ----------------------------------------------------------------------------------

    def submit_store(self, job_id: JobId, store_spec: StoreSpec, gpu_pages: Any) -> None:
        """Copies GPU pages `gpu_pages[i]` into the spec's host rows (then, with stores, writes
        the rows through to them). Returns at once.

        Raises:
          TypeError, ValueError, IndexError: a spec of another kind, pages that do not match
            it or are out of range, a job id in use; nothing is submitted.
        """
        job = self._checked_job(job_id, store_spec, StoreSpec, gpu_pages, is_load=False)
        if self._tiers is not None:
            job.store_keys = [store_key(h) for h in store_spec.block_hashes]
        self._submit(job)

    def submit_load(self, job_id: JobId, load_spec: LoadSpec, gpu_pages: Any,
                    num_tokens: Any = None) -> None:
        """Copies the spec's host rows into GPU pages `gpu_pages[i]`, after reading the rows a
        store holds (`load_spec.store_reads`). Returns at once; a block that does not arrive
        intact from its store fails the job, and nothing of it is copied.

        `gpu_pages=None` runs the store reads only (a prefetch into host rows): once the job
        succeeded, `complete_load` makes the blocks ready in the host pool, to load later.

        `num_tokens`: per page, copy only the block's first `num_tokens[i]` tokens (0, or the
        tokens per block: all of them), for a request that reuses part of a block; None: whole
        blocks.

        Raises:
          TypeError, ValueError, IndexError: as for `submit_store`, or a `num_tokens` that is
            not one integer per page; nothing is submitted.
        """
        job = self._checked_job(job_id, load_spec, LoadSpec, gpu_pages, is_load=True)
        if num_tokens is not None:
            job.num_tokens = _checked_tokens(num_tokens, len(job.gpu_pages),
                                             self.pools[0].tokens_per_block)
        if load_spec.store_reads and self._tiers is None:
            raise ValueError("load_spec reads from stores, but this worker has none")
        for read in load_spec.store_reads:
            if not 0 <= read.store < len(self.stores) or not (
                    0 <= read.start < read.stop <= len(load_spec)):
                raise ValueError(f"load_spec.store_reads: {read} does not fit this worker's "
                                 f"{len(self.stores)} stores and the spec's {len(load_spec)} "
                                 "blocks")
        for read in load_spec.store_reads:
            keys = [store_key(h) for h in load_spec.block_hashes[read.start:read.stop]]
            slots = job.host_slots[read.start:read.stop].tolist()
            job.reads.append((read.stop - read.start, self._tiers.read(read.store, keys, slots)))
        self._submit(job)

    def get_finished(self) -> list[tuple[JobId, bool]]:
        """The jobs finished since the last call: (job id, success), in submission order."""
        self._issue_ready()
        done, still = [], []
        for job in self._issued:
            finished = (job.reads_done() if job.prefetch else
                        job.fence is None or job.fence.done())
            (done if finished else still).append(job)
        self._issued = still
        for job in done:
            if job.prefetch:
                job.success = job.reads_intact()
            self._ids.discard(job.job_id)
        return [(job.job_id, job.success) for job in done]

    def wait(self, job_ids: Sequence[JobId]) -> None:
        """Waits until these jobs are finished (`get_finished` still reports them).

        Raises:
          KeyError: a job id not submitted, or already reported.
        """
        wanted = set(job_ids)
        unknown = wanted - self._ids
        if unknown:
            raise KeyError(f"job_ids: {sorted(map(repr, unknown))} are not running")
        while any(job.job_id in wanted for job in self._pending):
            head = self._pending[0]
            for _, future in head.reads:
                future.result()
            self._issue_ready()
        for job in self._issued:
            if job.job_id in wanted:
                for _, future in job.reads:  # a prefetch's
                    future.result()
                if job.fence is not None:
                    job.fence.wait()

    def store_stats(self) -> dict[str, StoreStats]:
        """Each store's statistics since the last call, by tier name ("DISK", ...)."""
        return self._tiers.stats() if self._tiers is not None else {}

    def flush(self) -> None:
        """Issues what can be, and waits until every block written through to the stores is
        durable there."""
        self._issue_ready()
        if self._tiers is not None:
            self._tiers.flush()

    def close(self) -> None:
        """Waits for every job, flushes the stores and stops the worker's store threads (the
        stores stay open: they are the caller's)."""
        self.wait([job.job_id for job in (*self._pending, *self._issued)])
        if self._tiers is not None:
            self._tiers.close()

    # -- internals -----------------------------------------------------------------------------

    def _checked_job(self, job_id: JobId, spec: HostSpec, kind: type, gpu_pages: Any, *,
                     is_load: bool) -> _Job:
        try:
            hash(job_id)
        except TypeError:
            raise TypeError(f"job_id must be hashable, got {job_id!r}") from None
        if job_id in self._ids:
            raise ValueError(f"job_id {job_id!r} is in use: pick a new one per job")
        if not isinstance(spec, kind):
            raise TypeError(f"{'load' if is_load else 'store'}_spec must be a {kind.__name__} "
                            f"(from OffloadingManager), got {type(spec).__name__}")
        _check_range("spec.host_slots", spec.host_slots, self.num_host_blocks)
        if gpu_pages is None and is_load:  # a prefetch: store reads only
            return _Job(job_id, is_load, spec.host_slots, np.zeros(0, np.int32), [],
                        prefetch=True)
        pages = np.asarray(gpu_pages)
        if pages.dtype.kind not in "iu" and (pages.size or pages.dtype == np.bool_):
            raise TypeError(f"gpu_pages must hold integers, got dtype {pages.dtype}")
        if pages.ndim > 1:
            raise ValueError(f"gpu_pages must be 1-D, got shape {pages.shape}")
        pages = pages.reshape(-1)
        if len(pages) != len(spec):
            raise ValueError(f"gpu_pages holds {len(pages)} pages for a spec of {len(spec)} "
                             "blocks: one page per block")
        _check_range("gpu_pages", pages, self.num_pages)
        if is_load and len(set(pages.tolist())) != len(pages):
            raise ValueError("gpu_pages holds a page twice: a load writes each page once")
        return _Job(job_id, is_load, spec.host_slots, pages.astype(np.int32), [])

    def _submit(self, job: _Job) -> None:
        self._ids.add(job.job_id)
        # a prefetch's rows are its own (the manager reserved them): nothing waits behind it
        (self._issued if job.prefetch else self._pending).append(job)
        self._issue_ready()

    def _issue_ready(self) -> None:
        """Issues pending jobs in order, up to the first whose store reads are still running."""
        while self._pending:
            job = self._pending[0]
            if not job.reads_done():
                return
            self._pending.popleft()
            job.success = job.reads_intact()
            if len(job.gpu_pages) and job.success:
                if self._tiers is not None and not job.is_load:
                    for slot in job.host_slots.tolist():  # a row a store write still reads
                        self._tiers.wait_written(slot)
                if job.is_load:
                    self.transfer_manager.onboard_indices(job.host_slots, job.gpu_pages,
                                                          job.num_tokens)
                else:
                    self.transfer_manager.offload_indices(job.gpu_pages, job.host_slots)
                job.fence = self.transfer_manager.fence()
                if self._tiers is not None:
                    self._tiers.touched(job.host_slots.tolist())
                    if job.store_keys:  # once the copies into the rows have landed
                        self._tiers.write_through(job.store_keys, job.host_slots.tolist())
            self._issued.append(job)


def _checked_tokens(num_tokens: Any, count: int, tokens_per_block: int) -> np.ndarray:
    """A load's tokens per page as int32, or a TypeError / ValueError naming `num_tokens`."""
    tokens = np.asarray(num_tokens)
    if tokens.dtype == np.bool_ or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise TypeError(f"num_tokens must hold integers, got dtype {tokens.dtype}")
    if tokens.shape != (count,):
        raise ValueError(f"num_tokens must hold one count per page ({count}), got shape "
                         f"{tokens.shape}")
    bad = np.flatnonzero((tokens < 0) | (tokens > tokens_per_block))
    if len(bad):
        raise ValueError(f"num_tokens[{bad[0]}] = {tokens[bad[0]]} is out of range "
                         f"[0, {tokens_per_block}]")
    return tokens.astype(np.int32)


def _check_range(name: str, values: np.ndarray, bound: int) -> None:
    if len(values) <= 64:  # a step's few blocks: Python's min and max are quicker than NumPy's
        listed = values.tolist()
        if not listed or (min(listed) >= 0 and max(listed) < bound):
            return
    elif values.min() >= 0 and values.max() < bound:
        return
    bad = np.flatnonzero((values < 0) | (values >= bound))
    if len(bad):
        raise IndexError(f"{name}[{bad[0]}] = {values[bad[0]]} is out of range [0, {bound})")
