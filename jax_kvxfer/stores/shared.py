"""What the stores on a shared server (`RedisStore`, `MooncakeStore`) have in common.

- The checks of their common arguments, with the same messages.
- The server's availability: a fault (a connection error, a timeout) marks it down for
  `retry_s`, logged once; meanwhile calls answer at once without the network (lookups 0, gets
  misses, puts dropped), and the first call after it tries again.
- The contract's calls around the network: `bind` (the keys' prefix holds the fingerprint),
  `put` and `get` split into batches of at most `max_batch_bytes` spread over the worker
  threads, `flush` and `stats`.

A subclass makes its client, answers `lookup`, sends a batch of writes (`_write`) and of reads
(`_read`) on the worker threads, and closes.

The local servers that `start_local_valkey` (local_valkey.py) and `start_local_master` (mooncake.py)
start on 127.0.0.1 take a free port (`free_port`) and run through `spawn_server`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Self

import numpy as np

from ..ops import stage_values
from .base import (
    HEADER_CRC_OFFSET,
    HEADER_NBYTES,
    Countdown,
    Store,
    StoreStats,
    check_keys,
    expected_header,
)

_MIN_SPLIT_BYTES = 1 << 20  # a call is spread over the threads in batches of at least this much


def positive_seconds(name: str, value: Any, allow_none: bool = False) -> float | None:
    """`value` as a positive number of seconds (or None where allowed), else a ValueError."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


def int_at_least(name: str, value: Any, least: int, what: str = "an int") -> int:
    """`value` as an int >= `least`, else a ValueError saying `what` was expected."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be {what} >= {least}, got {value!r}")
    return int(value)


class SharedStore(Store):
    """The base of the stores on a server that several processes share (see the module)."""

    server = "server"  # what the logs call the other side

    def __init__(self, namespace: str, *, timeout_s: Any, retry_s: Any, threads: Any,
                 max_batch_bytes: Any, key_prefix: Any, thread_name: str) -> None:
        """Checks the common arguments (each message names its argument) and sets up the
        worker threads (started on first use)."""
        if not isinstance(namespace, str) or not namespace or len(namespace) > 256 or any(
                not c.isprintable() for c in namespace):
            raise ValueError("namespace must be a non-empty string of at most 256 printable "
                             f"characters (a model id), got {namespace!r}")
        super().__init__(namespace)
        self.timeout_s = positive_seconds("timeout_s", timeout_s)
        if isinstance(retry_s, bool) or not isinstance(retry_s, (int, float)) or \
                not math.isfinite(retry_s) or retry_s < 0:
            raise ValueError(f"retry_s must be a number of seconds >= 0, got {retry_s!r}")
        self.retry_s = float(retry_s)
        self.threads = int_at_least("threads", threads, 1)
        self.max_batch_bytes = int_at_least("max_batch_bytes", max_batch_bytes, 1)
        if not isinstance(key_prefix, str) or not key_prefix or any(
                not c.isprintable() or c.isspace() for c in key_prefix):
            raise ValueError("key_prefix must be a non-empty string of printable characters "
                             f"without spaces, got {key_prefix!r}")
        self.key_prefix_base = key_prefix
        #: the keys' prefix once bound: `<key_prefix>:<fingerprint hex>:`
        self.key_prefix = ""
        self._log = logging.getLogger(type(self).__module__)
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._pending: set[Future] = set()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=thread_name)
        self._closed = False
        self._available: bool | None = None
        self._down_until = 0.0
        self._failed_at = -math.inf  # time.perf_counter() of the last fault
        self._warned: set[str] = set()

    # --- availability -----------------------------------------------------------------------

    @property
    def where(self) -> str:
        """The server, as logs name it (never with a password)."""
        raise NotImplementedError

    @property
    def available(self) -> bool | None:
        """Whether the server answered the last call that reached for it (None: not asked
        yet). While False, calls answer without the network until `retry_s` has passed."""
        return self._available

    def _down(self) -> bool:
        """Whether calls answer without the network now (marked down less than `retry_s`
        ago)."""
        return self._available is False and time.monotonic() < self._down_until

    def _fault_text(self, e: Any) -> str:
        """How a fault is shown in logs (a subclass hides secrets here)."""
        return e if isinstance(e, str) else f"{type(e).__name__}: {e}"

    def _failed(self, e: Any) -> None:
        with self._lock:
            was = self._available
            self._available = False
            self._failed_at = time.perf_counter()
            self._down_until = time.monotonic() + self.retry_s
        if was is not False:
            self._log.warning("%s at %s: %s unavailable (%s); lookups and gets miss and puts are "
                        "dropped, retried every %.1f s", type(self).__name__, self.where,
                        self.server, self._fault_text(e), self.retry_s)

    def _succeeded(self, since: float) -> None:
        """The server answered a call that started at `since` (`time.perf_counter()`): it is
        available, unless a fault was seen since then (another thread's call, which reached
        the server later, as a batch's readers do; a late success must not hide it)."""
        if self._available is True:
            return
        with self._lock:
            if self._available is False and self._failed_at >= since:
                return
            was, self._available = self._available, True
        if was is False:
            self._log.warning("%s at %s: %s available again", type(self).__name__, self.where,
                        self.server)

    def _warn_once(self, what: str, e: Any) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        self._log.warning("%s at %s: %s (%s); counted, logged once", type(self).__name__,
                    self.where, what, self._fault_text(e))

    # --- the contract -----------------------------------------------------------------------

    def bind(self, layout: Any, row_nbytes: int) -> None:
        """The layout of the rows (see `Store.bind`): sets the keys' prefix. No server call.

        Raises:
          ValueError: bound already to another layout; a row that is not a positive number of
            bytes.
        """
        if self.fingerprint is None and (isinstance(row_nbytes, bool) or not isinstance(
                row_nbytes, (int, np.integer)) or row_nbytes <= 0):
            raise ValueError(f"row_nbytes must be a positive int, got {row_nbytes!r}")
        super().bind(layout, row_nbytes)
        assert self.fingerprint is not None
        self.key_prefix = f"{self.key_prefix_base}:{self.fingerprint.hex()}:"

    def put(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Queues `rows[i]` under `keys[i]`. The future (result None) is done once every row
        has been copied into a request (the rows are free then).

        Raises:
          ValueError: a key that is not 16 bytes, rows of another count or size, or rows that
            are not C-contiguous buffers.
          RuntimeError: not bound, or closed.
        """
        self._check_open()
        self._check_bound()
        keys = check_keys(keys)
        views = self._row_views(keys, rows, writable=False)
        batches = self._batches(len(keys))
        rows_read = Countdown(len(batches))
        with self._lock:
            for start, stop in batches:
                sent: Future = Future()
                self._pending.add(sent)
                self._pool.submit(self._write, keys[start:stop], views[start:stop], sent,
                                  rows_read.done_one)
        return rows_read.future

    def get(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Reads `keys[i]` into `rows[i]` (writable C-contiguous buffers of `row_nbytes`,
        filled in place). The future's result: per key, True where the block was found and
        verified. A row whose block is absent is left untouched; only rows reported True hold
        data (RedisStore receives a value into its row before checking its CRC-32).

        Raises:
          ValueError: a key that is not 16 bytes, rows of another count or size, or rows that
            are not writable C-contiguous buffers.
          RuntimeError: not bound, or closed.
        """
        self._check_open()
        self._check_bound()
        keys = check_keys(keys)
        views = self._row_views(keys, rows, writable=True)
        found = [False] * len(keys)
        batches = self._batches(len(keys))
        done = Countdown(len(batches), found)
        for start, stop in batches:
            self._pool.submit(self._read, start, keys[start:stop], views[start:stop], found,
                              done.done_one)
        return done.future

    def flush(self) -> None:
        """Waits until every write queued so far was acknowledged by the server, or dropped
        (at most about `timeout_s` per batch when the server stalls). Never raises for
        faults."""
        if self._closed:
            return
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def stats(self) -> StoreStats:
        """The statistics since the last call. `evicted` stays 0: the server's expiries and
        evictions are not seen, they show as misses."""
        with self._lock:
            out, self._stats = self._stats, StoreStats()
        return out

    # --- helpers ----------------------------------------------------------------------------

    def _counted_lookup(self, keys: Sequence[bytes]) -> list[bytes]:
        """A lookup's keys, checked, and counted in the statistics."""
        keys = check_keys(keys)
        self._check_open()
        self._check_bound()
        with self._lock:
            self._stats.lookups += len(keys)
        return keys

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _batches(self, n: int) -> list[tuple[int, int]]:
        """[start, stop) of each batch: at most max_batch_bytes of payload (one row at least),
        and as many as the threads when the call is large enough to be worth it."""
        if n == 0:
            return []
        row = (self.row_nbytes or 0) + HEADER_NBYTES
        per = max(1, self.max_batch_bytes // row)
        count = max(-(-n // per), min(self.threads, n, -(-(n * row) // _MIN_SPLIT_BYTES)))
        size = -(-n // count)
        return [(i, min(n, i + size)) for i in range(0, n, size)]

    # --- on the worker threads ---------------------------------------------------------------

    def _pack(self, buf: np.ndarray, keys: list[bytes], views: list[np.ndarray]) -> int:
        """Writes each row's value (header, then the row) one after another into `buf` (uint8,
        room for them all); returns a value's length. The header's checksum is of the copy:
        what is sent is what the header describes."""
        value = HEADER_NBYTES + (self.row_nbytes or 0)
        heads = np.frombuffer(b"".join(expected_header(self.fingerprint, key, view.nbytes)
                                       for key, view in zip(keys, views)), np.uint8)
        # in native code with the GIL released: beside a serving thread that runs Python, a
        # copy and a checksum a row, each giving the GIL up and waiting for it back, slowed
        # puts to a quarter (docs/stores.md)
        stage_values(buf[:len(keys) * value].reshape(len(keys), value),
                     heads.reshape(len(keys), HEADER_NBYTES), views, HEADER_CRC_OFFSET)
        return value

    def _count_write(self, sent: Future, batch: int, written: int, t0: float) -> None:
        """A write batch of `batch` blocks is over (`written` of them acknowledged, the rest
        dropped; started at `t0`): counted, and `sent` completed."""
        seconds = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            s.write_seconds += seconds
            s.written += written
            s.written_bytes += written * (self.row_nbytes or 0)
            s.dropped_writes += batch - written
            self._pending.discard(sent)
        sent.set_result(None)

    def _count_read(self, batch: int, hits: int, corrupt: int, t0: float) -> None:
        """A read batch of `batch` blocks is over: `hits` verified, `corrupt` refused, the rest
        missed (started at `t0`)."""
        seconds = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            s.read_seconds += seconds
            s.hits += hits
            s.read_bytes += hits * (self.row_nbytes or 0)
            s.corrupt += corrupt
            s.misses += batch - hits - corrupt

    # --- the subclass's, on the worker threads -------------------------------------------------

    def _write(self, keys: list[bytes], views: list[np.ndarray], sent: Future,
               release: Any) -> None:
        """Sends one batch of writes: calls `release()` once the rows are copied, records the
        outcome in the stats, removes `sent` from the pending writes and completes it."""
        raise NotImplementedError

    def _read(self, start: int, keys: list[bytes], views: list[np.ndarray], found: list[bool],
              release: Any) -> None:
        """Reads one batch into `views`, sets `found[start + i]` for each verified block,
        records the outcome in the stats, then calls `release()`."""
        raise NotImplementedError


# --- local servers ----------------------------------------------------------------------------


# Runs each server: SIGKILL when its parent dies (Linux's PR_SET_PDEATHSIG, kept across exec),
# so that a test or demo killed outright leaves no server behind; then the binary itself.
_DIE_WITH_PARENT = """
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9)
except Exception:
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """What LocalValkey and LocalMooncake share: once started, this process's exit stops the
    server, and so does leaving a `with` block; `stop()` is the subclass's."""

    _stops_at_exit = False

    def stop(self) -> None:
        raise NotImplementedError

    def _stop_at_exit(self) -> None:
        """Before a server process is spawned: this process's exit will stop it."""
        if not self._stops_at_exit:
            atexit.register(self.stop)
            self._stops_at_exit = True

    def _stopped(self) -> None:
        """At the end of `stop()`: nothing left for the exit to stop."""
        if self._stops_at_exit:
            atexit.unregister(self.stop)
            self._stops_at_exit = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

def stop_server(proc: subprocess.Popen | None) -> None:
    """Ends a process `spawn_server` started, if it still runs: SIGCONT first (a stopped one
    could not act on SIGTERM), SIGTERM, then SIGKILL after 5 s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def spawn_server(exe: str, args: Sequence[str], log_path: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts the binary `exe` with `args` in a session of its own (a Ctrl-C at the terminal
    is its starter's to handle), its output appended to `log_path`, killed when the thread
    that started it ends (Linux; the process's pid is the binary's own, for signals)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, exe, *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
