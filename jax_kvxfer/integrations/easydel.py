"""EasyDeL's eSurge with jax_kvxfer's host pool (and stores) below its own prefix cache.

`enable_offloading(engine, num_host_blocks=...)` attaches the connector to an `eSurge` engine
(easydel 0.3.0; docs/easydel-seams.md says where each seam is). eSurge keeps its page
allocator and prefix cache; the connector adds the tier below them.

- **Keys of its own.** The connector keys a page by `page_key`: a digest chained over the
  prefix's token ids, the same in every process and run. eSurge's own page hashes start from
  a random value in each process unless PYTHONHASHSEED is set, so a store keyed by them would
  never be found by another replica, nor after a restart. The keys are computed where eSurge
  hashes a request's pages (its prefix lookup, and when the request finishes, for the pages
  its reply filled), and remembered by eSurge's hash value until the page leaves eSurge's
  cache.
- **Store at eviction.** When eSurge reuses a cached page for new content
  (`PagePool._maybe_evict_cached_page`, which forgets the page's hash), the page's hash and
  id are noted; before the step that overwrites it runs (at the end of `schedule()`, or before
  a load writes the page), the noted pages are copied to host rows (`prepare_store`,
  `submit_store`), made loadable once the copy has landed (`complete_store`).
- **Read a store only where it pays.** The connector times each step that mostly prefills
  (from `schedule()` to `update_from_output`) for the cost of a prompt token, and counts a
  page only a store holds only where its read is expected to beat recomputing it
  (`OffloadingManager.set_recompute_cost`); `recompute_s_per_token` fixes that cost instead.
- **Read ahead for waiting requests.** At the end of each `schedule()`, for the requests still
  waiting (in queue order, up to a quarter of the host pool in flight), the pages only a store
  holds start reading into host rows (a prefetch), so that the reads run beside the steps
  before their admission, which then loads from the host pool (waiting for a read still in
  flight).
- **Load before the prefix lookup.** Where eSurge asks its prefix cache for a request's hits
  (`CacheManager.get_computed_pages`, once per admission), the pages past its hits that the
  host pool holds are loaded into free pages (`lookup`, `prepare_load`, `submit_load`, waited
  for), registered in eSurge's prefix cache under their hashes and freed as cached pages; then
  eSurge's own lookup finds them as ordinary hits. Its hits are held meanwhile, so that the
  allocation does not evict them; a page eSurge still holds is never loaded.

The engine's KV arrays are donated and rebound by every step; the connector takes the current
ones before each transfer and rebinds the engine to the pool's after it. Everything runs on
the engine's scheduling thread, between steps. easydel is imported only when attaching.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import itertools
import operator
import time
from collections.abc import Sequence
from typing import Any

from ..connector import OffloadingManager, OffloadingWorker
from ..connector.tiers import check_recompute_cost
from ..stores.base import Store

ROOT_KEY = bytes(16)  # the parent key of a request's first page
MEASURED = "measured"  # recompute_s_per_token: timed on the engine's steps
PREFILL_SHARE = 0.9  # a step timed for the cost of a prompt token: this share of it prefill
PREFETCH_SHARE = 0.25  # of the host pool, at most, being read ahead for waiting requests
_HASH_VALUE = operator.attrgetter("hash_value")


def page_key(parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """The connector's 16-byte key of a page: a digest of its parent page's key (`ROOT_KEY` for
    a request's first page), its token ids and eSurge's extra keys (a multimodal input's hash,
    a LoRA name; by their `repr`, so an object whose repr names its address only misses). The
    stores add the model's namespace and the rows' layout (their fingerprint)."""
    digest = hashlib.blake2b(parent, digest_size=16, person=b"kvxfer-esurge")
    digest.update(array.array("q", token_ids).tobytes())
    if extra_keys is not None:
        digest.update(b"extra" + repr(extra_keys).encode())
    return digest.digest()


@dataclasses.dataclass
class OffloadingReport:
    """What the connector did for the engine so far (in pages, i.e. blocks)."""

    stored_pages: int = 0  # evicted pages copied to the host pool
    store_declined: int = 0  # evicted pages not stored (no room, held already, or no key:
    # a page filled by a request that was preempted, before it finished)
    lookups: int = 0  # admissions whose pages past eSurge's hits were looked up
    loaded_pages: int = 0  # pages loaded from the host pool (and the stores)
    loaded_from_stores: int = 0  # of those, pages a store read brought into the host pool
    prefetched_pages: int = 0  # store pages read ahead into host rows for waiting requests
    failed_loads: int = 0  # pages whose load failed (recomputed by eSurge)
    loaded_pages_gpu_held: int = 0  # pages loaded that eSurge's prefix cache still held


class EsurgeOffloading:
    """The connector attached to one eSurge engine (made by `enable_offloading`)."""

    def __init__(self, engine: Any, *, num_host_blocks: int,
                 stores: Store | Sequence[Store] = (), admission: Any = "always",
                 recompute_s_per_token: float | str | None = MEASURED) -> None:
        measure = isinstance(recompute_s_per_token, str)
        if measure and recompute_s_per_token != MEASURED:
            raise ValueError(f'recompute_s_per_token must be "{MEASURED}", seconds > 0 or None, '
                             f"got {recompute_s_per_token!r}")
        fixed = None if measure else check_recompute_cost(recompute_s_per_token)
        from easydel.inference.esurge.core.utils import PageHashWithGroupId

        self._key_type = PageHashWithGroupId
        self._scheduler = engine.scheduler
        self._executor = engine.runner.executor_manager
        self._cache_manager = self._scheduler.kv_cache_manager
        self._pool = self._cache_manager.page_pool
        if not self._cache_manager.enable_caching:
            raise ValueError("engine: offloading extends eSurge's prefix cache; make the "
                             "engine with enable_prefix_caching=True")
        if self._cache_manager.num_kv_cache_groups != 1:
            raise ValueError(f"engine: {self._cache_manager.num_kv_cache_groups} KV-cache "
                             "groups (a hybrid model); offloading supports one")
        self.page_size = int(self._cache_manager.page_size)
        self.worker = OffloadingWorker(self._engine_arrays(), num_host_blocks=num_host_blocks,
                                       token_axis=1, block_axis=0, stores=stores)
        self.manager = OffloadingManager(num_host_blocks, block_size=self.page_size,
                                         stores=self.worker.stores, admission=admission,
                                         recompute_s_per_token=fixed)
        # the last step scheduled and when its schedule() returned, while measuring
        self._timing: tuple[Any, float] | None = None
        self._measure = measure
        self._token_seconds: float | None = None
        self.report = OffloadingReport()
        self._noted: dict[int, int] = {}  # evicted page's hash value -> page id, not stored yet
        self._keys: dict[int, bytes] = {}  # eSurge's hash value -> page_key, while cached
        self._keys_limit = 2 * self._pool.num_pages  # then pruned to the pages still cached
        self._storing: dict[Any, list[bytes]] = {}  # store job -> its keys
        self._prefetches: dict[Any, list[bytes]] = {}  # prefetch job -> its keys
        self._prefetched: set[str] = set()  # waiting requests read ahead (until they finish)
        self._jobs = itertools.count()
        # eSurge's methods, wrapped on these objects (not their classes)
        self._originals = {
            (self._pool, "_maybe_evict_cached_page"): self._pool._maybe_evict_cached_page,
            (self._cache_manager, "get_computed_pages"): self._cache_manager.get_computed_pages,
            (self._scheduler, "schedule"): self._scheduler.schedule,
            (self._cache_manager, "free_page_hashes"): self._cache_manager.free_page_hashes,
            (self._scheduler, "update_from_output"): self._scheduler.update_from_output,
        }
        # eSurge's loop calls schedule() and update_from_output() under this lock, and every
        # call of the connector comes from inside them: taking it, attaching and detaching
        # happen between steps
        self._engine_lock = getattr(engine, "_scheduler_lock", None) or contextlib.nullcontext()
        self._attached = True
        with self._engine_lock:
            self._pool._maybe_evict_cached_page = self._evicting
            self._cache_manager.get_computed_pages = self._get_computed_pages
            self._scheduler.schedule = self._schedule
            self._cache_manager.free_page_hashes = self._free_page_hashes
            self._scheduler.update_from_output = self._update_from_output

    def disable(self) -> None:
        """Detaches from the engine (its own methods back, between two of its steps) and
        waits for the transfers; a second call does nothing."""
        with self._engine_lock:
            if not self._attached:
                return
            self._attached = False
            for (owner, name) in self._originals:
                delattr(owner, name)  # the instance attribute shadowed the class's method
            self._flush_stores()
            self.worker.close()
            self._collect()

    # -- the engine's arrays ---------------------------------------------------------------------

    def _engine_arrays(self) -> list:
        return [view.kv_pages for view in self._executor.kv_pages.views]

    def _take_engine_arrays(self) -> None:
        """The worker's pool takes the engine's current arrays (each step made new ones)."""
        arrays = self._engine_arrays()
        if any(a is not b for a, b in zip(arrays, self.worker.kv_caches)):
            self.worker.kv_caches = arrays

    def _give_engine_arrays(self) -> None:
        """The engine takes the pool's arrays (ordered after the transfers just issued)."""
        arrays = self.worker.kv_caches
        cache = self._executor.kv_pages
        if any(a is not v.kv_pages for a, v in zip(arrays, cache.views)):
            self._executor.kv_pages = cache.replace(
                views=[v.replace(kv_pages=a) for v, a in zip(cache.views, arrays)])

    # -- storing at eviction ---------------------------------------------------------------------

    def _evicting(self, page: Any) -> bool:
        page_hash = page.page_hash
        if page_hash is not None and page.page_id in self._pool.cached_page_hash_to_page.get(
                page_hash, ()):
            self._noted.setdefault(page_hash.get_hash_value(), page.page_id)
        return self._originals[(self._pool, "_maybe_evict_cached_page")](page)

    def _schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._originals[(self._scheduler, "schedule")](*args, **kwargs)
        self._collect()
        self._flush_stores()  # before the step that overwrites the evicted pages
        if self.worker.stores:
            self._prefetch_waiting()
        if self._measure:
            self._timing = (output, time.perf_counter())
        return output

    def _update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self._timing is not None and self._timing[0] is scheduler_output:
            self._time_step(scheduler_output, time.perf_counter() - self._timing[1])
        return self._originals[(self._scheduler, "update_from_output")](
            scheduler_output, *args, **kwargs)

    def _time_step(self, output: Any, seconds: float) -> None:
        """A step that ran in `seconds`: if it mostly prefilled, what a token cost in it
        (recent steps weigh more) is the manager's recompute cost."""
        total = output.total_num_scheduled_tokens
        prefill = sum(n for n in output.num_scheduled_tokens.values() if n > 1)
        if total <= 0 or prefill < PREFILL_SHARE * total:
            return  # decodes cost per token far more than a prompt's tokens do
        per_token = seconds / total
        self._token_seconds = per_token if self._token_seconds is None else (
            0.8 * self._token_seconds + 0.2 * per_token)
        self.manager.set_recompute_cost(self._token_seconds)

    def _flush_stores(self) -> None:
        if not self._noted:
            return
        noted, self._noted = self._noted, {}
        pages = {self._keys[h]: page for h, page in noted.items() if h in self._keys}
        out = self.manager.prepare_store(list(pages))
        todo = out.block_hashes_to_store if out is not None else []
        self.report.store_declined += len(noted) - len(todo)
        if not todo:
            return
        job = ("store", next(self._jobs))
        self._take_engine_arrays()
        self.worker.submit_store(job, out.store_spec, [pages[key] for key in todo])
        self._give_engine_arrays()
        self._storing[job] = todo
        self.report.stored_pages += len(todo)

    def _collect(self) -> None:
        """Completes the store and prefetch jobs the worker finished."""
        for job, success in self.worker.get_finished():
            self._complete(job, success)

    def _complete(self, job: Any, success: bool) -> None:
        if job in self._storing:
            self.manager.complete_store(self._storing.pop(job), success)
        else:
            self.manager.complete_load(self._prefetches.pop(job), success)

    # -- reading ahead for waiting requests ------------------------------------------------------

    def _prefetch_waiting(self) -> None:
        """Starts the store reads of the requests waiting after this schedule() (see the
        module's docstring); a request is read ahead once."""
        budget = int(PREFETCH_SHARE * self.manager.num_host_blocks) - sum(
            map(len, self._prefetches.values()))
        for request in self._scheduler.waiting:
            if budget <= 0:
                return
            if request.request_id in self._prefetched or getattr(request, "has_vision", False):
                continue  # a vision request's keys name its images: known once it is hashed
            self._prefetched.add(request.request_id)
            keys = self._token_keys(request.all_token_ids, request.num_tokens)
            n = self.manager.lookup(keys) or 0
            # lookup counts the host pool's blocks first, then a store's: the last is a
            # store's, or there is nothing to read
            if not n or self.manager.host_slot(keys[n - 1]) is not None:
                continue
            # the host pool's blocks before the reads are protected with them, so that the
            # reads' rows are not taken from this prefix
            spec = self.manager.prepare_load(keys[:n], count_reuse=False)  # counted at its load
            job = ("prefetch", next(self._jobs))
            self.worker.submit_load(job, spec, None)  # into host rows only
            self._prefetches[job] = keys[:n]
            self.report.prefetched_pages += spec.num_from_store
            budget -= n

    def _token_keys(self, token_ids: Sequence[int], num_tokens: int) -> list[bytes]:
        """The `page_key`s of a text request's full pages that a prefix lookup may use (up to
        its last token but one), from its tokens: the keys its page hashes will get."""
        keys, parent, size = [], ROOT_KEY, self.page_size
        for start in range(0, (num_tokens - 1) // size * size, size):
            parent = page_key(parent, token_ids[start:start + size])
            keys.append(parent)
        return keys

    def _wait_for_prefetches(self, keys: list[bytes]) -> None:
        """Waits for the prefetches reading any of these keys, and completes them."""
        wanted = set(keys)
        jobs = [job for job, read in self._prefetches.items() if not wanted.isdisjoint(read)]
        if jobs:
            self.worker.wait(jobs)
            self._collect()

    # -- the connector's keys -------------------------------------------------------------------

    def _page_keys(self, page_hashes: Sequence[Any]) -> list[bytes]:
        """The `page_key`s of a request's pages (eSurge's page hashes, from its first page),
        remembered by eSurge's hash value so that an evicted page's key is known then."""
        keys = list(map(self._keys.get, map(_HASH_VALUE, page_hashes)))
        if None in keys:
            parent = ROOT_KEY
            for i, key in enumerate(keys):
                if key is None:
                    page_hash = page_hashes[i]
                    key = keys[i] = self._keys[page_hash.hash_value] = page_key(
                        parent, page_hash.token_ids, page_hash.extra_keys)
                parent = key
            if len(self._keys) > self._keys_limit:
                self._prune_keys()
        return keys

    def _prune_keys(self) -> None:
        """Forgets the keys of pages neither eSurge's prefix cache holds nor waiting to be
        stored (a request's pages are keyed again from its hashes when next looked up)."""
        keep = {k.get_hash_value() for k, pages in self._pool.cached_page_hash_to_page.items()
                if pages}
        keep.update(self._noted)
        self._keys = {h: key for h, key in self._keys.items() if h in keep}
        self._keys_limit = max(self._keys_limit, 2 * len(self._keys))

    def _free_page_hashes(self, request: Any) -> None:
        """Keys the pages of a finished request's reply before its hashes go (its pages are
        freed into eSurge's cache, and may be evicted from the next step on)."""
        page_hashes = self._cache_manager.req_to_page_hashes.get(request.request_id)
        if page_hashes:
            self._page_keys(page_hashes)
        self._prefetched.discard(request.request_id)
        self._originals[(self._cache_manager, "free_page_hashes")](request)

    # -- loading before the prefix lookup --------------------------------------------------------

    def _get_computed_pages(self, request: Any, **kwargs: Any) -> Any:
        original = self._originals[(self._cache_manager, "get_computed_pages")]
        pages, hit_tokens = original(request, **kwargs)
        page_hashes = self._cache_manager.req_to_page_hashes.get(request.request_id) or []
        held = list(pages.pages[0]) if pages.pages else []
        limit = min(len(page_hashes), (request.num_tokens - 1) // self.page_size)
        wanted = []  # past eSurge's hits, up to the first page it still holds
        for page_hash in page_hashes[len(held):limit]:
            if self._pool.cached_page_hash_to_page.get(self._key(page_hash)):
                break
            wanted.append(page_hash)
        if not wanted:
            return pages, hit_tokens
        self._collect()
        self.report.lookups += 1
        keys = self._page_keys(page_hashes[:len(held) + len(wanted)])[len(held):]
        found = self.manager.lookup(keys)
        if found is None:  # a page is still being read: by a prefetch, which it waits for
            self._wait_for_prefetches(keys)
            found = self.manager.lookup(keys)
        n = min(found or 0, self._pool.get_num_free_pages() - len(held))
        if n <= 0:
            return pages, hit_tokens
        self._load(wanted[:n], keys[:n], held)
        return original(request, **kwargs)

    def _load(self, wanted: list, keys: list[bytes], held: list) -> None:
        """Loads the pages of `wanted` (eSurge's page hashes; `keys`, their `page_key`s) into free
        pages and caches them in eSurge's prefix cache; `held`, eSurge's hits before them, are
        kept meanwhile."""
        self._pool.touch((held,))  # out of the free queue: the allocation cannot evict them
        try:
            pages = self._pool.get_new_pages(len(wanted))
            # The host rows first: `lookup` counted them, and the stores of the pages just
            # evicted, submitted next (before the load that writes those pages), could take
            # them (a store read needs a free row).
            spec = self.manager.prepare_load(keys)
            self._flush_stores()
            self.report.loaded_pages_gpu_held += sum(
                bool(self._pool.cached_page_hash_to_page.get(self._key(h))) for h in wanted)
            self.manager.touch(keys)
            job = ("load", next(self._jobs))
            self._take_engine_arrays()
            self.worker.submit_load(job, spec, [p.page_id for p in pages])
            self.worker.wait([job])
            # after the wait: a load reading a store is issued once the read has landed, and
            # the arrays the engine gets must come after it
            self._give_engine_arrays()
            success = True
            for done, ok in self.worker.get_finished():
                if done == job:
                    success = ok
                else:
                    self._complete(done, ok)
            self.manager.complete_load(keys, success)
            if success:
                for page, page_hash in zip(pages, wanted):
                    cache_key = self._key(page_hash)  # eSurge's, for its prefix cache
                    page.page_hash = cache_key
                    self._pool.cached_page_hash_to_page[cache_key][page.page_id] = page
                self.report.loaded_pages += len(pages)
                self.report.loaded_from_stores += spec.num_from_store
            else:
                self.report.failed_loads += len(pages)
            # the last page first, so that a prefix is evicted after what extends it
            self._pool.free_pages(reversed(pages))
        finally:
            self._pool.free_pages(reversed(held))

    def _key(self, page_hash: Any) -> Any:
        """eSurge's prefix-cache key of a page hash (its one KV-cache group is group 0)."""
        return self._key_type(page_hash, 0)


def enable_offloading(engine: Any, *, num_host_blocks: int, stores: Store | Sequence[Store] = (),
                      admission: Any = "always",
                      recompute_s_per_token: float | str | None = MEASURED) -> EsurgeOffloading:
    """Attaches jax_kvxfer's host pool (and `stores` below it) to an eSurge engine's prefix
    cache; returns the attachment (`.report`, `.manager`, `.worker`, `.disable()`).

    Args:
      engine: an `easydel.eSurge` made with `enable_prefix_caching=True`, one KV-cache group.
      num_host_blocks: pages the pinned host pool holds.
      stores: tiers below the host pool (`jax_kvxfer.stores`).
      admission: which evicted pages are stored (`OffloadingManager`'s `admission`).
      recompute_s_per_token: what computing a prompt token costs the engine, against which a
        store read must win to be made: "measured" (the default: timed on the engine's steps
        that mostly prefill), seconds, or None (a store is always read).

    Raises:
      ValueError: an engine without prefix caching, or with several KV-cache groups.
      TypeError, ValueError: `recompute_s_per_token` not "measured", None or seconds > 0.
    """
    return EsurgeOffloading(engine, num_host_blocks=num_host_blocks, stores=stores,
                            admission=admission, recompute_s_per_token=recompute_s_per_token)
