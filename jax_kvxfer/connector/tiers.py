"""The worker's tiers below the host pool: its stores, and the host rows they read and write in
place.

A block that reaches the host pool is written through to every store in the background; a
block found only in a store is read into a host row and loaded from there like a host block.
Three ordering rules keep the rows exact:

- a store write of a host row starts only after the offload into that row has landed (the
  writer thread waits on the transfer manager's fence first);
- a host row a store write still reads is not written again (`wait_written` before the worker
  offloads into it, or a store reads into it);
- a store read into a host row starts only after every transfer issued so far is done (a freed
  row may still be the source of an onboard in flight), and the onboard from that row is
  issued only once the read is done.

Every read is timed, from the store's `get` to its last block, with the bytes in flight it
waited behind (`read_rate(store)`): the block manager, and the connector's manager once told
what a token costs to recompute, read a store only where that is expected to beat recomputing
the blocks.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np

from ..stores.base import Store, StoreStats
from ..transfer.manager import KVCacheTransferManager
from ..transfer.pool import KVCacheBlockPool


def longest_stored(stores: Sequence[Store], keys: Sequence[bytes]) -> tuple[int, int]:
    """(which store, how many of `keys` from the first it holds): the store holding the longest
    prefix (the first such); (0, 0) when none holds the first key."""
    best, best_n = 0, 0
    if keys:
        for i, store in enumerate(stores):
            n = store.lookup(keys)
            if n > best_n:
                best, best_n = i, n
    return best, best_n


MIN_READS = 3  # reads of a store measured before its estimate is trusted
# One lookup in this many that would skip a store's read reads it all the same: the read
# estimate moves only with reads, and one measured slow (a cold first read, a busy moment)
# would otherwise never be measured again. At most 1/32 of the skipped reads' loss.
READ_PROBE_EVERY = 32


def check_recompute_cost(s_per_token: object) -> float | None:
    """`recompute_s_per_token`: None, or a finite number of seconds > 0 (as a float)."""
    if s_per_token is None:
        return None
    if isinstance(s_per_token, bool) or not isinstance(s_per_token, (int, float)):
        raise TypeError("recompute_s_per_token must be a number of seconds or None, got "
                        f"{type(s_per_token).__name__}")
    if not 0 < s_per_token < math.inf:
        raise ValueError(f"recompute_s_per_token must be finite and > 0 seconds, got "
                         f"{s_per_token!r}")
    return float(s_per_token)


class ReadRate:
    """How long a store's reads take, as measured: seconds = latency + bytes / throughput,
    fitted by least squares to its reads (wall seconds from `get` to the last block), each read
    weighing `decay` times the one after it, so that the estimate follows the store as it
    changes. Reads report from the stores' I/O threads.

    A read waits behind the reads in flight when it starts (they share the store's
    connections and threads), so its bytes are counted with theirs: after a burst of reads,
    a read's time stays that of a read started alone, and `seconds` answers for a read started
    now, behind the reads in flight now."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.reads = 0
        self.in_flight_bytes = 0  # of the reads begun and not ended
        self._sums = (0.0,) * 5  # weight, bytes, seconds, bytes², bytes * seconds
        self._lock = threading.Lock()

    def begin(self, nbytes: int) -> int:
        """A read of `nbytes` starts now: the bytes in flight ahead of it (for `end`)."""
        with self._lock:
            ahead = self.in_flight_bytes
            self.in_flight_bytes += nbytes
        return ahead

    def end(self, nbytes: int, seconds: float | None, ahead: int) -> None:
        """The read that `begin(nbytes)` started, with `ahead` bytes before it, took `seconds`
        (None: it did not run, and measures nothing)."""
        with self._lock:
            self.in_flight_bytes -= nbytes
        if seconds is not None:
            self.add(nbytes + ahead, seconds)

    def add(self, nbytes: int, seconds: float) -> None:
        """A read took `seconds` until its `nbytes` were served (its own and those it waited
        behind)."""
        d, x, y = self.decay, float(nbytes), float(seconds)
        with self._lock:
            w, b, s, bb, bs = self._sums
            self._sums = (d * w + 1, d * b + x, d * s + y, d * bb + x * x, d * bs + x * y)
            self.reads += 1

    def estimate(self) -> tuple[float, float] | None:
        """(throughput in bytes per second, latency in seconds per read), once `MIN_READS`
        reads of more than one size were measured (else None: `seconds` still answers)."""
        fit = self._fit()
        return fit[0] if fit else None

    def seconds(self, nbytes: int) -> float | None:
        """The expected wall seconds of a read of `nbytes` started now, behind the bytes in
        flight, once `MIN_READS` reads were measured, else None. Reads of one size do not tell
        latency from rate: a read of another size gets the shorter of the two extremes (all
        latency, or none), so that it is made where it may pay, and measured."""
        fit = self._fit()
        if fit is None:
            return None
        nbytes += self.in_flight_bytes
        line, (mean_b, mean_s) = fit
        if line is None:
            return min(mean_s, mean_s * nbytes / mean_b)
        throughput, latency = line
        return latency + nbytes / throughput

    def marginal_seconds(self, nbytes: int) -> float | None:
        """The seconds each further `nbytes` adds to a long read (its share of the throughput,
        no latency), once reads of more than one size were measured, else None."""
        estimate = self.estimate()
        return None if estimate is None else nbytes / estimate[0]

    def _fit(self) -> tuple[tuple[float, float] | None, tuple[float, float]] | None:
        """((throughput, latency) or None for reads of one size, (mean bytes, mean seconds))
        of the weighted reads; None before `MIN_READS`."""
        with self._lock:
            if self.reads < MIN_READS:
                return None
            w, b, s, bb, bs = self._sums
        mean_b, mean_s = b / w, s / w
        var_b = bb / w - mean_b * mean_b
        if not var_b > (0.01 * mean_b) ** 2:
            return None, (mean_b, mean_s)
        slope = (bs / w - mean_b * mean_s) / var_b  # seconds per byte
        if slope <= 0:  # bigger reads no slower (noise, or all latency): each takes the mean
            return (math.inf, mean_s), (mean_b, mean_s)
        latency = mean_s - slope * mean_b
        if latency < 0:  # noise about a latency near 0: the line through the mean and 0
            return (mean_b / mean_s, 0.0), (mean_b, mean_s)
        return (1 / slope, latency), (mean_b, mean_s)


# Per store, shared by every worker of this process that reads it (they share its
# connections and threads, so each read's time includes the others' load).
_read_rates: weakref.WeakKeyDictionary[Store, ReadRate] = weakref.WeakKeyDictionary()
_read_rates_lock = threading.Lock()


def read_rate(store: Store) -> ReadRate:
    """What this process measured of `store`'s reads."""
    with _read_rates_lock:
        rate = _read_rates.get(store)
        if rate is None:
            rate = _read_rates[store] = ReadRate()
        return rate


class StoreTiers:
    """The stores of one worker, in order, over the host rows of its pools."""

    def __init__(self, stores: Sequence[Store], pools: Sequence[KVCacheBlockPool],
                 transfer_manager: KVCacheTransferManager) -> None:
        self.stores = tuple(stores)
        for i, store in enumerate(self.stores):
            if not isinstance(store, Store):
                raise TypeError(f"stores[{i}] must be a jax_kvxfer.stores.Store, got "
                                f"{type(store).__name__}")
        if not pools[0].num_secondary_blocks:
            raise ValueError("stores need a host pool to stage their blocks in: the pools "
                             "have 0 secondary blocks")
        self._pools = list(pools)
        self._manager = transfer_manager
        self._host_rows()  # raises for pools split over devices
        self.row_nbytes = sum(p.block_nbytes for p in self._pools)
        layout = tuple(p.host_row_layout for p in self._pools)
        for store in self.stores:
            store.bind(layout, self.row_nbytes)
        # One writer thread: it waits for the offloads' fence, then hands the rows to the
        # stores, whose own threads do the I/O; per secondary slot, the write still reading it.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer-tiers")
        self._writing: dict[int, concurrent.futures.Future] = {}
        # per host row, a fence for the last transfers issued that read or write it
        self._row_fences: dict[int, object] = {}
        self._lock = threading.Lock()

    # -- rows ---------------------------------------------------------------------------------

    def _host_rows(self) -> tuple[list, list[np.ndarray]]:
        """Every pool's secondary array and the byte view of its rows, taken on the serving
        thread. Holding the arrays keeps their buffers alive for the I/O threads even if the
        pools are given other arrays meanwhile (transfers update them in place)."""
        arrays = [p.stored(False) for p in self._pools]
        return arrays, [p.host_rows() for p in self._pools]

    @staticmethod
    def _row(views: list[np.ndarray], slot: int) -> np.ndarray:
        """The host row of `slot`: a view of the pool's own buffer where there is one pool, a
        staging copy of every pool's part otherwise."""
        if len(views) == 1:
            return views[0][slot]
        return np.concatenate([rows[slot] for rows in views])

    @staticmethod
    def _scatter(views: list[np.ndarray], slot: int, row: np.ndarray) -> None:
        """Puts a staged row's parts into every pool's row (several pools only)."""
        offset = 0
        for rows in views:
            n = rows.shape[1]
            rows[slot] = row[offset:offset + n]
            offset += n

    # -- writes -------------------------------------------------------------------------------

    def write_through(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Writes the host rows `slots` (just offloaded into) under `keys` to every store that
        does not hold them, once those offloads have landed; returns at once."""
        if not keys:
            return
        fence = self._manager.fence()
        keys, slots = list(keys), list(slots)
        arrays, views = self._host_rows()

        def write() -> None:
            fence.wait()
            rows = [self._row(views, slot) for slot in slots]
            futures = []
            for store in self.stores:
                new = [i for i, key in enumerate(keys) if store.lookup([key]) == 0]
                if new:
                    futures.append(store.put([keys[i] for i in new], [rows[i] for i in new]))
            for future in futures:
                future.result()  # every row read: the slots may be reused
            arrays.clear()  # held until here

        job = self._writer.submit(write)
        with self._lock:
            for slot in slots:
                self._writing[slot] = job

    def touched(self, slots: Sequence[int]) -> None:
        """Transfers reading or writing these host rows were just issued."""
        fence = self._manager.fence()
        for slot in slots:
            self._row_fences[slot] = fence

    def wait_written(self, slot: int) -> None:
        """Before `slot` is written again: waits for a store write still reading it."""
        with self._lock:
            job = self._writing.pop(slot, None)
        if job is not None:
            job.result()

    # -- reads --------------------------------------------------------------------------------

    def read(self, store_index: int, keys: Sequence[bytes],
             slots: Sequence[int]) -> concurrent.futures.Future:
        """Starts reading `keys` from store `store_index` into the host rows `slots` (free
        rows: no transfer issued later touches them). The future's result: how many blocks,
        from the first, arrived intact. Waits first for the transfers issued that touch these
        rows (usually long done) and for store writes still reading them."""
        store = self.stores[store_index]
        fences = {}
        for slot in slots:  # a free row may still be an onboard's source, or an offload's
            fence = self._row_fences.pop(slot, None)  # destination (its block since dropped)
            if fence is not None:
                fences[id(fence)] = fence
            self.wait_written(slot)
        for fence in fences.values():
            fence.wait()
        arrays, views = self._host_rows()
        staged = [self._row(views, slot) for slot in slots]
        done: concurrent.futures.Future = concurrent.futures.Future()
        rate, nbytes = read_rate(store), len(keys) * self.row_nbytes

        def finished(got: concurrent.futures.Future) -> None:
            rate.end(nbytes, time.perf_counter() - start, ahead)
            try:
                hits = got.result()
            except Exception:  # noqa: BLE001 - stores count their faults as misses; if one
                hits = []  # raises anyway, nothing it read is trusted
            n = 0
            while n < len(hits) and hits[n]:
                n += 1
            if len(views) > 1:
                for slot, row in zip(slots[:n], staged[:n]):
                    self._scatter(views, slot, row)
            arrays.clear()  # held until here
            done.set_result(n)

        ahead, start = rate.begin(nbytes), time.perf_counter()
        try:
            reading = store.get(keys, staged)
        except BaseException:
            rate.end(nbytes, None, ahead)
            raise
        reading.add_done_callback(finished)
        return done

    # -- both ----------------------------------------------------------------------------------

    def flush(self) -> None:
        """Waits until every write handed over so far is durable in every store."""
        with self._lock:
            jobs = set(self._writing.values())
            self._writing.clear()
        for job in jobs:
            job.result()
        for store in self.stores:
            store.flush()

    def stats(self) -> dict[str, StoreStats]:
        """Each store's statistics since the last call, by tier name."""
        out: dict[str, StoreStats] = {}
        for store in self.stores:
            out.setdefault(store.tier, StoreStats()).add(store.stats())
        return out

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
