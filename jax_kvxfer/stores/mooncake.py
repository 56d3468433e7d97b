"""MooncakeStore: a tier on Mooncake Store (a `mooncake_master` and the memory its clients
lend it), shared by every process that reaches the same master, over TCP.

Mooncake Store keeps objects in *segments*: memory that clients mount into the master's pool
(`segment_bytes` of a MooncakeStore, or a standalone holder such as the `mooncake_client`
process that `start_local_master()` starts beside its master). The master keeps the metadata
and evicts (LRU-like) when the segments fill up; a client writes to and reads from the segment
that holds an object directly (the transfer engine, here over TCP). A segment's blocks go when
the process that lent it does.

In the store, one object per block:

- key `<key_prefix>:<fingerprint, 32 hex>:<block key, 32 hex>` (`kvx:…:…` by default): the
  fingerprint names the namespace (a model id) and the host rows' layout, so stores of other
  models or layouts on the same master never see each other's blocks;
- value: the 64-byte header (`encode_header`: magic, version, fingerprint, key, payload length,
  CRC-32) followed by the host row, as for every store. A value that is not a whole, intact
  block of this fingerprint and key is a miss counted in `corrupt`, and is removed.

Every put and get is a few batch calls (`batch_put_from` / `batch_get_into`) of at most
`max_batch_bytes` each, from and into staging buffers of the store's own (the header and the row
side by side), on a pool of worker threads. Every wait on the master or a segment is bounded by
`timeout_s`: the client's own calls wait up to 30 s for a master that stopped answering (about
4 s for one that is down), so they run on I/O threads of their own and a call that outlives its
wait is abandoned to finish there, its staging buffer with it: nothing it does later reaches a
caller's row. Faults (a master down, killed, slow, full, or one that evicted a block) are
counted misses and dropped writes, never exceptions.

The client is the PyPI wheel `mooncake-transfer-engine-non-cuda` (or `mooncake-transfer-engine`
where CUDA is installed: the same `mooncake` module), imported only when a MooncakeStore is made
or a master started; it links Debian's `libibverbs1` (and `libnuma1`, `libcurl4`) even for TCP.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Self

import numpy as np

from .base import HEADER_NBYTES, CorruptBlock, check_value
from .shared import LocalServer, SharedStore, free_port, int_at_least, spawn_server, stop_server

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_RETRY_S = 1.0
DEFAULT_THREADS = 2
DEFAULT_MAX_BATCH_BYTES = 16 * MiB
DEFAULT_LOCAL_BUFFER_BYTES = 16 * MiB
DEFAULT_HOLDER_BYTES = 1 * GiB
MIN_SEGMENT_BYTES = 16 * MiB  # Mooncake refuses smaller segments
LOOKUP_BATCH = 4096
_FREE_SLOTS = 8  # staging buffers kept for reuse
INSTALL_HINT = ('pip install "jax_kvxfer[mooncake]" (the mooncake-transfer-engine-non-cuda '
                'wheel), and on Debian or Ubuntu: apt-get install libibverbs1 libnuma1 libcurl4')

# Mooncake's error codes (mooncake-store/include/types.h), as the Python client returns them
NO_AVAILABLE_HANDLE = -200  # no room in any segment
INVALID_PARAMS = -600  # e.g. a stored object larger than the buffer given to a get
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_MASTER_FAULTS = (RPC_FAIL, RPC_TIMEOUT)


def import_client() -> Any:
    """The `mooncake.store` module; a clear ImportError naming the install where it is not."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the client's own INFO lines: not ours
    try:
        from mooncake import store
    except ImportError as e:
        raise ImportError(f"MooncakeStore needs Mooncake's store client: {INSTALL_HINT} "
                          f"({type(e).__name__}: {e})") from e
    return store


def _package_binary(name: str) -> str:
    """A binary the mooncake wheel ships (mooncake_master, mooncake_client)."""
    import_client()
    import mooncake

    for folder in getattr(mooncake, "__path__", []):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    raise ImportError(f"the mooncake package has no {name} binary here; {INSTALL_HINT}")


def _segment_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0 or \
            0 < value < MIN_SEGMENT_BYTES:
        raise ValueError(f"segment_bytes must be 0 (none) or a number of bytes >= "
                         f"{MIN_SEGMENT_BYTES} (16 MiB, Mooncake's least), got {value!r}")
    return int(value)


def _check_master(master: Any) -> tuple[str, int]:
    if not isinstance(master, str):
        raise TypeError(f"master must be a string 'host:port' (the mooncake_master's RPC "
                        f"address), got a {type(master).__name__}")
    host, colon, port = master.strip().rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(
            c.isspace() or c in "/@" for c in host):
        raise ValueError(f"master must be 'host:port' with a port in 1..65535 (the "
                         f"mooncake_master's RPC address, e.g. '127.0.0.1:50051'), got "
                         f"{master!r}")
    return host, int(port)


def _local_address_towards(host: str) -> str:
    """The address this machine has on the route to `host` (what other clients of the same
    master reach this one's transfer engine at): 127.0.0.1 for a master on the loopback."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
            s.connect((socket.gethostbyname(host), 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class _Slots:
    """Staging buffers (a header and a row per block, side by side), reused. A buffer that a
    call still uses after its wait was given up is returned by that call's I/O thread when the
    call ends, or never (a transfer that failed may still be writing it)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.lost: list[np.ndarray] = []  # kept alive, never reused

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        with self._lock:
            if len(self._free) < _FREE_SLOTS:
                self._free.append(base)

    def lose(self, buf: np.ndarray) -> None:
        with self._lock:
            self.lost.append(buf)


class _Abandoned(Exception):
    """A client call that did not answer within timeout_s."""


class _IoThreads:
    """Daemon threads that run the client's blocking calls (so that a call stuck on a master
    that stopped answering neither holds a worker nor keeps the interpreter from exiting)."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            item()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def stop(self, timeout: float) -> None:
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class MooncakeStore(SharedStore):
    """A tier on Mooncake Store, shared by every process that uses the same master and
    namespace. Its blocks live in the segments that clients lend the master (this store's
    `segment_bytes`, other stores', a standalone holder's), and go with them.

    - put() returns at once; a worker thread copies each row into a staging buffer (a header
      and the row), after which the put's future is done and the rows are free; then it writes
      the batch with one `batch_put_from`. A block already stored is not written again (its
      key names its contents). A write refused (no room: the segments are full of blocks read
      within the master's lease) or that cannot reach the master is dropped and counted in
      `dropped_writes`; flush() waits until every queued write was acknowledged or dropped.
    - get() returns a future of per-key booleans; each batch is one `batch_get_into` into a
      staging buffer, checked (length, header, CRC-32) before a single copy into the caller's
      row, so a row that missed is left as it was.
    - lookup() asks the master (`batch_is_exist` per 4096 keys): blocks written by other
      processes are found, blocks evicted are not.
    - A value found but refused (foreign, a wrong length, a bad checksum) is a miss counted in
      `corrupt`, and is removed (its key holds our fingerprint, so it is no one else's).
    - Faults never raise from lookup, put, get or flush. Every call's wait is bounded by about
      `timeout_s`; a call that did not answer, or an RPC failure, marks the master unavailable
      (`available` False, logged once): for `retry_s` after that, calls answer at once (lookups
      0, gets misses, puts dropped); the first call after it tries again. The client reconnects
      by itself, so hits come back when the master does (blocks written after its restart:
      a restarted master starts empty).
    - The master need not be up at construction: the client's setup runs in the background,
      waited for up to `timeout_s`; until it succeeds, calls are counted misses and drops.
    - Thread safe; close() flushes, joins the workers and closes the client (unmounting this
      store's segment: the blocks it held go).
    """

    tier = "MOONCAKE"
    server = "master"

    def __init__(self, master: str, *, namespace: str, segment_bytes: int = 0,
                 local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S,
                 threads: int = DEFAULT_THREADS, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
                 key_prefix: str = "kvx", local_hostname: str | None = None,
                 metadata_server: str = "P2PHANDSHAKE") -> None:
        """Args:
          master: the mooncake_master's RPC address, `host:port` (`start_local_master()`'s
            `.address`).
          namespace: a non-empty string naming what the blocks are (a model id); stores of
            other namespaces on the same master never see these blocks.
          segment_bytes: memory this process lends to the store's pool (0: none; the blocks
            then live in other clients' segments, such as the holder `start_local_master()`
            starts). Its blocks go when this store closes or the process ends.
          local_buffer_bytes: the client's own transfer buffer (>= 1 MiB).
          timeout_s: the longest wait for the master or a segment, per call.
          retry_s: after a fault, how long calls answer without the network before the master
            is tried again.
          threads: the worker threads (and as many I/O threads).
          max_batch_bytes: the most payload bytes in one batch call (a put or get of more is
            several, spread over the threads); at least one row per batch.
          key_prefix: the keys' first part (before the fingerprint).
          local_hostname: the address other clients reach this one's transfer engine at (None:
            127.0.0.1 for a master on the loopback, else this machine's address towards the
            master).
          metadata_server: the transfer engine's metadata service: "P2PHANDSHAKE" (none: the
            clients exchange it directly), or an `http://…/metadata` URL (e.g. the master's
            with `--enable_http_metadata_server`), or an etcd address.

        Raises:
          ValueError, TypeError: a bad argument (the message names it, with what was expected).
          ImportError: the mooncake client is not installed (the message says how).
        """
        super().__init__(namespace, timeout_s=timeout_s, retry_s=retry_s, threads=threads,
                         max_batch_bytes=max_batch_bytes, key_prefix=key_prefix,
                         thread_name="kvx-mooncake")
        host, port = _check_master(master)
        self.master = master.strip()
        self._master_addr = (host, port)
        self.segment_bytes = _segment_bytes(segment_bytes)
        self.local_buffer_bytes = int_at_least("local_buffer_bytes", local_buffer_bytes, MiB,
                                               "a number of bytes")
        if local_hostname is not None and (not isinstance(local_hostname, str) or
                                           not local_hostname or any(c.isspace() for c in
                                                                     local_hostname)):
            raise ValueError(f"local_hostname must be None or a host name or address, got "
                             f"{local_hostname!r}")
        self.local_hostname = local_hostname or _local_address_towards(host)
        if not isinstance(metadata_server, str) or not metadata_server:
            raise ValueError(f"metadata_server must be 'P2PHANDSHAKE', an http://…/metadata "
                             f"URL or an etcd address, got {metadata_server!r}")
        self.metadata_server = metadata_server
        self._mc = import_client()
        self._io = _IoThreads(self.threads + 1, "kvx-mooncake-io")
        self._slots = _Slots()
        self._client: Any = None
        self._setup_running = False
        self._setup_done = threading.Event()
        self._start_setup()
        self._setup_done.wait(self.timeout_s)

    def __repr__(self) -> str:
        return (f"MooncakeStore(master={self.master!r}, namespace={self.namespace!r}, "
                f"segment_bytes={self.segment_bytes}, available={self._available})")

    # --- the client and availability --------------------------------------------------------

    @property
    def where(self) -> str:
        return self.master

    def _start_setup(self) -> None:
        """Makes the client in the background (setup() waits about 90 s for a master that is
        down); one attempt at a time."""
        with self._lock:
            if self._setup_running or self._client is not None or self._closed:
                return
            self._setup_running = True
            self._setup_done.clear()

        def run() -> None:
            since = time.perf_counter()
            client = None
            error: BaseException | None = None
            try:
                # the client's setup holds the GIL while it retries a master that is down
                # (about 90 s): it runs only once the master's port accepts a connection
                with socket.create_connection(self._master_addr, timeout=self.timeout_s):
                    pass
                client = self._mc.MooncakeDistributedStore()
                rc = client.setup(self.local_hostname, self.metadata_server, self.segment_bytes,
                                  self.local_buffer_bytes, "tcp", "", self.master)
                if rc != 0:
                    error = ConnectionError(f"setup returned {rc}")
            except BaseException as e:  # noqa: BLE001 - a client that cannot start: a fault
                error = e
            if error is not None:
                with contextlib.suppress(Exception):
                    if client is not None:
                        client.close()
                client = None
            with self._lock:
                self._setup_running = False
                closed = self._closed
                if client is not None and not closed:
                    self._client = client
            if client is not None and closed:
                with contextlib.suppress(Exception):
                    client.close()
            if error is not None:
                self._failed(error)
            elif not closed:
                self._succeeded(since)
            self._setup_done.set()

        threading.Thread(target=run, name="kvx-mooncake-setup", daemon=True).start()

    def _usable(self) -> Any:
        """The client when calls may use the network now, else None."""
        if self._down():
            return None
        client = self._client
        if client is None:
            self._start_setup()
        return client

    def _call(self, fn: Callable[[], Any], slot: np.ndarray | None = None) -> Any:
        """fn() on an I/O thread, waited for up to timeout_s. Raises _Abandoned when it did not
        answer in time: the call goes on there, owning `slot` (returned to the pool when it
        ends), and the master is marked unavailable."""
        done: Future = Future()
        state = {"abandoned": False, "finished": False}
        lock = threading.Lock()

        def run() -> None:
            with lock:
                skip = state["abandoned"]
            result: Any = None
            if not skip:
                try:
                    result = fn()
                except BaseException as e:  # noqa: BLE001 - handed to the waiting worker
                    result = e
            with lock:
                state["finished"] = True
                abandoned = state["abandoned"]
            if abandoned:
                if slot is not None:
                    self._slots.give(slot)
            else:
                done.set_result(result)

        self._io.submit(run)
        try:
            result = done.result(timeout=self.timeout_s)
        except FutureTimeout:
            with lock:
                if not state["finished"]:
                    state["abandoned"] = True
            if state["abandoned"]:
                self._failed(f"no answer within timeout_s={self.timeout_s:g}")
                raise _Abandoned from None
            result = done.result()
        if isinstance(result, BaseException):
            raise result
        return result

    def ping(self) -> bool:
        """Asks the master now (an existence query, bounded by `timeout_s`, whether or not
        `retry_s` has passed); whether it answered. Never raises for faults."""
        client = self._client
        if client is None:
            self._start_setup()
            self._setup_done.wait(self.timeout_s)
            client = self._client
            if client is None:
                return False
        since = time.perf_counter()
        try:
            codes = self._call(lambda: client.batch_is_exist([f"{self.key_prefix_base}:ping"]))
        except _Abandoned:
            return False
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return False
        if any(c in _MASTER_FAULTS for c in codes) or not codes:
            self._failed(f"error {codes[0] if codes else 'none'}")
            return False
        self._succeeded(since)
        return True

    # --- the contract -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds now (one `batch_is_exist` per
        4096 keys, asked until a key is absent; 0 while the master is unavailable)."""
        keys = self._counted_lookup(keys)
        client = self._usable() if keys else None
        if client is None:
            return 0
        n, since = 0, time.perf_counter()
        try:
            for code in self._exist_codes(client, keys):
                if code in _MASTER_FAULTS:
                    self._failed(f"error {code}")
                    return n
                if code != 1:
                    break
                n += 1
        except _Abandoned:
            return n
        except Exception as e:  # noqa: BLE001 - a lookup that failed: what was confirmed
            self._warn_once("a lookup failed", f"{type(e).__name__}: {e}")
            return n
        self._succeeded(since)
        return n

    def lookup_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the store holds it now: one `batch_is_exist` per 4096 keys (all
        False while the master is unavailable or a call fails)."""
        keys = self._counted_lookup(keys)
        client = self._usable() if keys else None
        if client is None:
            return [False] * len(keys)
        since = time.perf_counter()
        try:
            codes = list(self._exist_codes(client, keys))
        except _Abandoned:
            return [False] * len(keys)
        except Exception as e:  # noqa: BLE001 - a lookup that failed: misses
            self._warn_once("a lookup failed", f"{type(e).__name__}: {e}")
            return [False] * len(keys)
        fault = next((code for code in codes if code in _MASTER_FAULTS), None)
        if fault is not None:
            self._failed(f"error {fault}")
            return [False] * len(keys)
        self._succeeded(since)
        return [code == 1 for code in codes]

    def _exist_codes(self, client, keys: list[bytes]):
        """Per key, in order, the master's `batch_is_exist` code (1: held): one call per
        LOOKUP_BATCH keys, each made only once the caller asks past the one before."""
        for start in range(0, len(keys), LOOKUP_BATCH):
            names = [self._name(k) for k in keys[start:start + LOOKUP_BATCH]]
            yield from self._call(lambda names=names: client.batch_is_exist(names))

    def close(self) -> None:
        """Flushes, joins the workers and closes the client (bounded by `timeout_s`); later
        calls raise RuntimeError (close again: nothing)."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        self._pool.shutdown(wait=True)
        if client is not None:
            with contextlib.suppress(Exception):
                self._call(client.close)
        self._io.stop(self.timeout_s)

    # --- helpers on the calling thread ------------------------------------------------------

    def _name(self, key: bytes) -> str:
        return self.key_prefix + key.hex()

    def _remove(self, client: Any, names: list[str]) -> None:
        """Removes refused values, in the background (force: a lease from our own read must
        not keep them)."""
        def run() -> None:
            with contextlib.suppress(Exception):
                client.batch_remove(names, True)
        self._io.submit(run)

    # --- on the worker threads --------------------------------------------------------------

    def _write(self, keys: list[bytes], views: list[np.ndarray], sent: Future,
               release: Any) -> None:
        t0 = time.perf_counter()
        written = 0
        released = False
        slot = None
        try:
            client = self._usable()
            if client is None:
                return
            slot = self._slots.take(len(keys) * (HEADER_NBYTES + (self.row_nbytes or 0)))
            value = self._pack(slot, keys, views)
            release()
            released = True
            names = [self._name(k) for k in keys]
            base = slot.ctypes.data
            ptrs = [base + i * value for i in range(len(keys))]
            try:
                codes = self._call(lambda: client.batch_put_from(names, ptrs,
                                                                 [value] * len(keys)), slot)
            except _Abandoned:
                slot = None  # the call owns it now
                return
            faults = [c for c in codes if c in _MASTER_FAULTS]
            for code in codes:
                if code in (0, OBJECT_ALREADY_EXISTS):
                    written += 1
                elif code == NO_AVAILABLE_HANDLE:
                    self._warn_once("the store is full: writes dropped", f"error {code}")
                elif code == TRANSFER_FAIL:
                    self._slots.lose(slot)  # a failed transfer may still read it
                    slot = None
                    self._warn_once("a transfer to a segment failed", f"error {code}")
                elif code not in _MASTER_FAULTS:
                    self._warn_once("writes refused", f"error {code}")
            if faults and not written:
                self._failed(f"error {faults[0]}")
            else:
                self._succeeded(t0)
        except BaseException as e:  # noqa: BLE001 - a failed write is dropped, never raised
            written = 0
            self._warn_once("a write failed", f"{type(e).__name__}: {e}")
        finally:
            if not released:
                release()
            if slot is not None:
                self._slots.give(slot)
            self._count_write(sent, len(keys), written, t0)

    def _read(self, start: int, keys: list[bytes], views: list[np.ndarray], found: list[bool],
              release: Any) -> None:
        t0 = time.perf_counter()
        hits = corrupt = 0
        slot = None
        try:
            client = self._usable()
            if client is None:
                return
            row = self.row_nbytes or 0
            value = HEADER_NBYTES + row
            slot = self._slots.take(len(keys) * value)
            names = [self._name(k) for k in keys]
            base = slot.ctypes.data
            ptrs = [base + i * value for i in range(len(keys))]
            try:
                codes = self._call(lambda: client.batch_get_into(names, ptrs,
                                                                 [value] * len(keys)), slot)
            except _Abandoned:
                slot = None  # the call owns it now
                return
            refused: list[str] = []
            faults = 0
            for i, (key, view, code) in enumerate(zip(keys, views, codes)):
                if code == OBJECT_NOT_FOUND:
                    continue
                if code in _MASTER_FAULTS:
                    faults += 1
                    continue
                try:
                    if code == INVALID_PARAMS:  # stored, but larger than a block: not ours
                        raise CorruptBlock("a value larger than a block")
                    if code == TRANSFER_FAIL:
                        self._slots.lose(slot)  # a failed transfer may still write it
                        slot = self._slots.take(len(keys) * value)
                        slot[:] = 0
                        self._warn_once("a transfer from a segment failed", f"error {code}")
                        continue
                    if code < 0:
                        self._warn_once("reads refused", f"error {code}")
                        continue
                    if code != value:
                        raise CorruptBlock(f"a value of {code} bytes, expected {value}")
                    off = i * value
                    payload = slot[off + HEADER_NBYTES:off + value]
                    check_value(slot[off:off + HEADER_NBYTES].tobytes(), payload,
                                self.fingerprint, key, row)
                except CorruptBlock:
                    corrupt += 1
                    refused.append(names[i])
                    continue
                if slot is None:
                    continue
                np.copyto(view, payload)
                found[start + i] = True
                hits += 1
            if refused:
                self._remove(client, refused)
            if faults and not hits:
                self._failed(f"error {RPC_FAIL}")
            else:
                self._succeeded(t0)
        except BaseException as e:  # noqa: BLE001 - a failed read is a miss, never raised
            self._warn_once("a read failed", f"{type(e).__name__}: {e}")
        finally:
            if slot is not None:
                self._slots.give(slot)
            self._count_read(len(keys), hits, corrupt, t0)
            release()


# --- a local master ---------------------------------------------------------------------------


class LocalMooncake(LocalServer):
    """A `mooncake_master` on 127.0.0.1 and a holder (the wheel's `mooncake_client`, lending
    `segment_bytes` of memory to the pool, so that blocks outlive the processes that wrote
    them), started by `start_local_master()`. `.address` is the master's `host:port`;
    `stop()` (or leaving a `with` block) ends both. Logs go to `log_dir`."""

    def __init__(self, segment_bytes: int = DEFAULT_HOLDER_BYTES, *, port: int | None = None,
                 log_dir: str | None = None, master_args: Sequence[str] = ()) -> None:
        self.segment_bytes = _segment_bytes(segment_bytes)
        if port is not None:
            int_at_least("port", port, 1)
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"log_dir must be None or a folder's path, got {log_dir!r}")
        if isinstance(master_args, str) or not all(isinstance(a, str) for a in master_args):
            raise TypeError("master_args must be a sequence of strings (mooncake_master flags)")
        self._master_exe = _package_binary("mooncake_master")
        self._holder_exe = _package_binary("mooncake_client")
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._own_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvx-mooncake-")
        self.master_args = list(master_args)
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"LocalMooncake(address={self.address!r}, segment_bytes={self.segment_bytes})"

    def _spawn(self, exe: str, args: list[str], name: str) -> subprocess.Popen:
        self._stop_at_exit()  # (spawn_server's processes also die with this one, on Linux)
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "WARNING"))
        return spawn_server(exe, args, os.path.join(self.log_dir, f"{name}.log"), env)

    def capacity(self) -> int | None:
        """The bytes mounted into the master's pool now (None: the master does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=1) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return None

    def _start_master(self, timeout: float) -> None:
        self.master = self._spawn(self._master_exe, [
            f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
            "--enable_metric_reporting=false", *self.master_args], "master")
        # named with its ports: a port in use is the likeliest reason it does not start
        self._wait(lambda: self.capacity() is not None, timeout,
                   f"mooncake_master on {self.address} (metrics port {self.metrics_port})",
                   self.master)

    def start(self, timeout: float = 30.0) -> Self:
        """Starts the master, then the holder; waits until its segment is mounted."""
        self._start_master(timeout)
        if self.segment_bytes:
            self.holder = self._spawn(self._holder_exe, [
                f"--global_segment_size={self.segment_bytes}", "--host=127.0.0.1",
                f"--port={self.holder_port}", f"--master_server_address={self.address}",
                "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"], "holder")
            self._wait(lambda: (self.capacity() or 0) >= self.segment_bytes, timeout,
                       f"mooncake_client (the segment holder) on 127.0.0.1:{self.holder_port}",
                       self.holder)
        return self

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str,
              proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                name = "holder" if proc is self.holder else "master"
                try:  # its last warnings and errors (the folder may go with stop())
                    with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                        tail = [ln.rstrip() for ln in f if ln[:1] in "WEF"][-4:]
                except OSError:
                    tail = []
                self.stop()
                raise RuntimeError(f"{what} did not start within {timeout:g} s (exit code "
                                   f"{proc.poll()}): " + (" | ".join(tail) or "no log"))
            time.sleep(0.05)

    def stop(self) -> None:
        """Ends the holder and the master (SIGTERM, then SIGKILL after 5 s)."""
        for proc in (self.holder, self.master):
            stop_server(proc)
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self._own_dir = False
        self._stopped()


def start_local_master(segment_bytes: int = DEFAULT_HOLDER_BYTES, *, port: int | None = None,
                       log_dir: str | None = None, master_args: Sequence[str] = (),
                       timeout: float = 30.0) -> LocalMooncake:
    """Starts a `mooncake_master` on 127.0.0.1 (`port`, or a free one) and a holder process
    lending `segment_bytes` of memory to its pool (0: none; then the stores lend their own),
    and waits until both are up. Returns a `LocalMooncake`: `.address` for
    `MooncakeStore(address, ...)`, `.stop()`, and a context manager.

    Raises:
      ImportError: the mooncake wheel is not installed (the message says how).
      RuntimeError: a process did not start (the message names the log folder).
    """
    return LocalMooncake(segment_bytes, port=port, log_dir=log_dir,
                         master_args=master_args).start(timeout)
