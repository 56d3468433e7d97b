"""FileStore: the disk tier, one file per block under a directory per namespace and layout.

On disk, under `path/<fingerprint, 32 hex>/<the key's first byte, 2 hex>/` (256 folders, so
that creating and renaming files, which a directory serialises, run in parallel):

- `<key, 32 hex>.kvb`: one block: its 64-byte header (`encode_header`) zero-padded to 4096
  bytes, then the payload (the host row of `row_nbytes` bytes) zero-padded to a multiple of
  4096 bytes. Every file of a directory has the same size.
- `.<key hex>.<pid>.<n>.tmp`: a write in progress (created with O_EXCL, renamed onto the final
  name when complete): a crash leaves at most such a file, never a torn block under a final
  name; a later store removes those of processes no longer running.

The directory is named by the store's `fingerprint` (its namespace and the layout the block
manager binds), which every header repeats: namespaces and layouts never mix. Files of other
names in the directory are left alone.
"""

from __future__ import annotations

import collections
import errno
import itertools
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .base import (
    HEADER_NBYTES,
    KEY_NBYTES,
    CorruptBlock,
    Countdown,
    Store,
    StoreStats,
    check_keys,
    check_value,
    encode_header,
)

ALIGN = 4096  # O_DIRECT's alignment of addresses, offsets and lengths (and the page size)
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
# Disk I/O wants a queue deeper than the cores (an NVMe drive serves many requests at once),
# while the checksums want cores: twice the cores, at least 8, at most 16 (vLLM's fs tier: 16).
DEFAULT_THREADS = min(16, max(8, 2 * (os.cpu_count() or 1)))
STALE_TMP_S = 3600.0  # a temporary file this old is removed even if its process still runs
_NAME_LEN = 2 * KEY_NBYTES + len(SUFFIX)
_SUBDIRS = tuple(f"{i:02x}" for i in range(256))
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_rows(count: int, row_nbytes: int) -> np.ndarray:
    """A zeroed `(count, row_nbytes)` uint8 array whose first row starts on a 4096-byte
    boundary (every row does when `row_nbytes` is a multiple of 4096): rows that FileStore
    reads and writes with O_DIRECT as they are, without a bounce buffer."""
    raw = np.zeros(count * row_nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + count * row_nbytes].reshape(count, row_nbytes)


def _fsync_dir(folder: str) -> None:
    """fsync of a folder (its entries' names durable); an error is ignored: the files are
    written, only their names' durability is in doubt."""
    try:
        fd = os.open(folder, os.O_RDONLY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class _Buffers(threading.local):
    """Each I/O thread's page-aligned buffers: a header page, and a bounce buffer of a padded
    payload (made on first use) for rows O_DIRECT cannot use in place."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, ALIGN)
        self.bounce: mmap.mmap | None = None


class FileStore(Store):
    """A disk tier: one file per block under `path`, written by a pool of I/O threads.

    - put() returns at once; its future is done when every row has been read (copied into a
      bounce buffer or the page cache, or written). flush() makes every write queued before
      it durable: each new file, then the folders naming them, fsynced.
    - get() returns a future of per-key booleans: True where the block was read and its header
      and checksum verified. A row whose key missed is left as it was when the block is absent;
      when the block was found but refused (torn, corrupt, foreign), or a read failed, the
      row's bytes are unspecified (a read with O_DIRECT into an aligned row may have filled
      part of it): only rows reported True hold data.
    - Values are read and written with O_DIRECT where the directory supports it (probed at
      construction; `io_mode` says which), so that the disk tier does not fill the page
      cache; elsewhere with buffered I/O, the cached pages dropped after each write (once
      fsynced) and read (`posix_fadvise(DONTNEED)`).
    - `capacity_bytes` bounds the files' bytes (headers and padding included): the least
      recently put or got blocks are removed to make room (`evicted`). A write that finds no
      room (everything else still being written) is dropped.
    - A new store on the same path and namespace, once bound, finds every block a finished
      flush() made durable: bind() lists the directory (no manifest: the directory is the
      index), least recently written first by modification time.
    - A block found but refused is a miss, counted in `corrupt` (not in `misses`) and its file
      is removed. A write that fails (disk full, a read-only file system, an I/O error) is
      dropped and counted in `dropped_writes`; put, get and flush never raise for I/O.
    - Thread safe; close() flushes and joins the I/O threads.
    Several processes may share a directory (each keeps its own index and capacity; a block
    another process removed is a miss).
    """

    tier = "DISK"

    def __init__(self, path: str | os.PathLike, *, namespace: str,
                 capacity_bytes: int | None = None, threads: int = DEFAULT_THREADS,
                 direct_io: bool | None = None) -> None:
        """Args:
          path: an existing, writable directory; the store keeps its files under it.
          namespace: a non-empty string naming what the blocks are (a model id); stores of
            other namespaces never see these blocks.
          capacity_bytes: the most bytes the store's files may take (None: unbounded).
          threads: the I/O threads (>= 1).
          direct_io: None: O_DIRECT where the probe finds it works; False: buffered I/O;
            True: O_DIRECT or a ValueError.

        Raises:
          ValueError: a bad argument (the message names it, with what was expected).
        """
        if not isinstance(namespace, str) or not namespace or len(namespace) > 256 or any(
                not c.isprintable() for c in namespace):
            raise ValueError("namespace must be a non-empty string of at most 256 printable "
                             f"characters (a model id), got {namespace!r}")
        super().__init__(namespace)
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(
                capacity_bytes, (int, np.integer)) or capacity_bytes <= 0):
            raise ValueError("capacity_bytes must be a positive int (bytes) or None (unbounded),"
                             f" got {capacity_bytes!r}")
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if direct_io not in (None, True, False):
            raise ValueError(f"direct_io must be None (probe), True or False, got {direct_io!r}")
        try:
            self.path = os.path.abspath(os.fspath(path))
        except TypeError:
            raise ValueError(f"path must be a path to a directory, got {path!r}") from None
        if not os.path.isdir(self.path):
            what = "does not exist" if not os.path.exists(self.path) else "is not a directory"
            raise ValueError(f"path must be an existing directory, got {self.path!r}, which "
                             f"{what}")
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self.threads = int(threads)
        #: True when values are read and written with O_DIRECT, bypassing the page cache
        self.direct_io = self._probe(direct_io)
        #: "O_DIRECT" or "buffered" (then the page cache is dropped after each I/O)
        self.io_mode = "O_DIRECT" if self.direct_io else "buffered"
        self._lock = threading.Lock()
        # key -> None (on disk) or the Future of its write in flight; least recent first
        self._index: collections.OrderedDict[bytes, Future | None] = collections.OrderedDict()
        self._used = 0  # bytes of the files indexed (written or being written)
        self._stats = StoreStats()
        self._pending: set[Future] = set()
        self._unsynced: set[bytes] = set()  # keys renamed into place since the last flush
        self._dirty_dirs: set[str] = set()  # folders with renames or removals not fsynced
        self._names = itertools.count()
        self._buffers = _Buffers()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvx-disk")
        self._closed = False
        self.dir: str | None = None  # path/<fingerprint hex>, set by bind()
        self.file_nbytes = 0  # header page + padded payload, set by bind()

    # --- construction ---------------------------------------------------------------------

    def _probe(self, want: bool | None) -> bool:
        """Whether O_DIRECT works in `path`: an aligned 4096-byte write and read-back of a
        probe file. Raises ValueError where the directory takes no file at all."""
        probe = os.path.join(self.path, f".probe.{os.getpid()}.{id(self)}{TMP_SUFFIX}")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        except OSError as e:
            raise ValueError(f"path must be a writable directory, but {self.path!r} is not: "
                             f"creating a file there failed ({e.strerror})") from None
        os.close(fd)
        buf = mmap.mmap(-1, ALIGN)
        buf.write(b"kvxfer-probe".ljust(ALIGN, b"\0"))
        works = False
        try:
            if want is not False and _O_DIRECT:
                fd = os.open(probe, os.O_RDWR | _O_DIRECT | _O_CLOEXEC)
                try:
                    if os.pwrite(fd, buf, 0) == ALIGN:
                        back = mmap.mmap(-1, ALIGN)
                        works = os.preadv(fd, [back], 0) == ALIGN and back[:] == buf[:]
                finally:
                    os.close(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # full: cannot tell
                works = want is not False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        if want is True and not works:
            raise ValueError(f"direct_io=True, but O_DIRECT does not work in {self.path!r}; "
                             "pass direct_io=None to fall back to buffered I/O")
        return works

    def bind(self, layout: Any, row_nbytes: int) -> None:
        """The layout of the rows (see `Store.bind`); lists the directory of this namespace
        and layout, and indexes the blocks found there.

        Raises:
          ValueError: bound already to another layout; a row that is not a positive number of
            bytes; a capacity smaller than one block's file.
        """
        if self.fingerprint is not None:
            super().bind(layout, row_nbytes)
            return
        if isinstance(row_nbytes, bool) or not isinstance(row_nbytes, (int, np.integer)) or \
                row_nbytes <= 0:
            raise ValueError(f"row_nbytes must be a positive int, got {row_nbytes!r}")
        file_nbytes = ALIGN + round_up(int(row_nbytes))
        if self.capacity_bytes is not None and self.capacity_bytes < file_nbytes:
            raise ValueError(f"capacity_bytes={self.capacity_bytes} holds no block: one block "
                             f"of {row_nbytes} bytes takes {file_nbytes} bytes on disk")
        super().bind(layout, row_nbytes)
        assert self.fingerprint is not None
        self.file_nbytes = file_nbytes
        self.dir = os.path.join(self.path, self.fingerprint.hex())
        try:
            os.makedirs(self.dir, exist_ok=True)
            for sub in _SUBDIRS:
                os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
            for folder in (self.dir, self.path):
                _fsync_dir(folder)
        except OSError:
            return  # nothing stored; writes will be dropped and counted
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        """The index from the directory: every block file of the right size, by modification
        time; stale temporary files and files of the wrong size removed, then the least
        recent blocks beyond the capacity."""
        assert self.dir is not None
        found: list[tuple[int, bytes]] = []
        now = time.time()
        dirty = set()
        for sub in _SUBDIRS:
            folder = os.path.join(self.dir, sub)
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                name = e.name
                try:
                    if name.endswith(TMP_SUFFIX) and name.startswith("."):
                        if self._stale_tmp(name, e.stat().st_mtime, now):
                            os.unlink(e.path)
                            dirty.add(folder)
                        continue
                    if len(name) != _NAME_LEN or not name.startswith(sub) or \
                            not name.endswith(SUFFIX):
                        continue
                    key = bytes.fromhex(name[:-len(SUFFIX)])
                    st = e.stat()
                except (ValueError, OSError):
                    continue  # not ours, or gone meanwhile
                if st.st_size != self.file_nbytes:  # torn by a crash of the disk, or not ours
                    self._stats.corrupt += 1
                    try:
                        os.unlink(e.path)
                        dirty.add(folder)
                    except OSError:
                        pass
                    continue
                found.append((st.st_mtime_ns, key))
        found.sort()
        with self._lock:
            for _, key in found:
                self._index[key] = None
            self._used = len(self._index) * self.file_nbytes
            self._dirty_dirs |= dirty
            victims = self._make_room(0)
        for key in victims or ():
            self._unlink(key)

    @staticmethod
    def _stale_tmp(name: str, mtime: float, now: float) -> bool:
        """A temporary file of a process no longer running here, or an old one."""
        if now - mtime > STALE_TMP_S:
            return True
        parts = name.split(".")  # "", key hex, pid, n, "tmp"
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    # --- the contract -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are stored or being written (the in-memory
        index: no disk access)."""
        keys = check_keys(keys)
        self._check_open()
        with self._lock:
            self._stats.lookups += len(keys)
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
        return n

    def put(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Queues `rows[i]` under `keys[i]`: a key stored already (or being written) is only
        marked recently used. The future (result None) is done once every row has been read.

        Raises:
          ValueError: a key that is not 16 bytes, rows of another count or size, or rows that
            are not C-contiguous buffers.
          RuntimeError: not bound, or closed.
        """
        self._check_open()
        self._check_bound()
        keys = check_keys(keys)
        views = self._row_views(keys, rows, writable=False)
        done = Countdown(len(keys))
        with self._lock:
            for key, view in zip(keys, views):
                if key in self._index:
                    self._index.move_to_end(key)
                    done.done_one()
                    continue
                victims = self._make_room(self.file_nbytes)
                if victims is None:
                    self._stats.dropped_writes += 1
                    done.done_one()
                    continue
                written: Future = Future()
                self._index[key] = written
                self._used += self.file_nbytes
                self._pending.add(written)
                # submitted under the lock: a get() that finds this write in the index queues
                # its read behind it, so a read never waits for a write still in the queue
                self._pool.submit(self._write, key, view, written, victims, done.done_one)
        return done.future

    def get(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Reads `keys[i]` into `rows[i]` (writable C-contiguous buffers of `row_nbytes`,
        filled in place). The future's result: per key, True where the block was found and
        verified. See the class docstring for what a row that missed holds.

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
        done = Countdown(len(keys), found)
        with self._lock:
            for i, (key, view) in enumerate(zip(keys, views)):
                if key not in self._index:
                    self._stats.misses += 1
                    done.done_one()
                    continue
                writing = self._index[key]
                self._index.move_to_end(key)
                self._pool.submit(self._read, i, key, view, writing, found, done.done_one)
        return done.future

    def flush(self) -> None:
        """Waits for every write queued so far, then makes them durable: each new file, then
        the folders naming them, fsynced. Never raises for I/O: a file whose fsync fails is removed and
        counted as a dropped write."""
        if self._closed:
            return
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        with self._lock:
            keys, self._unsynced = self._unsynced, set()
        if keys:  # the files first, then the folders that name them
            wait([self._pool.submit(self._fsync, key) for key in keys])
        with self._lock:
            folders, self._dirty_dirs = self._dirty_dirs, set()
        if folders:
            wait([self._pool.submit(_fsync_dir, folder) for folder in folders])

    @property
    def num_blocks(self) -> int:
        """Blocks in the index: on disk, or being written."""
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed blocks' files (what `capacity_bytes` bounds)."""
        with self._lock:
            return self._used

    def stats(self) -> StoreStats:
        with self._lock:
            out, self._stats = self._stats, StoreStats()
        return out

    def close(self) -> None:
        """Flushes, then joins the I/O threads; later calls raise RuntimeError (close again:
        nothing)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._pool.shutdown(wait=True)

    # --- helpers on the calling thread ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("FileStore is closed")

    def _make_room(self, nbytes: int) -> list[bytes] | None:
        """Under the lock: removes the least recently used blocks on disk from the index until
        `nbytes` more fit; their keys (files to remove), or None when they cannot fit."""
        if self.capacity_bytes is None:
            return []
        excess = self._used + nbytes - self.capacity_bytes
        if excess <= 0:
            return []
        victims = []
        for key, writing in self._index.items():
            if writing is None:
                victims.append(key)
                excess -= self.file_nbytes
                if excess <= 0:
                    break
        if excess > 0:
            return None
        for key in victims:
            del self._index[key]
        self._used -= len(victims) * self.file_nbytes
        self._stats.evicted += len(victims)
        return victims

    def _file(self, key: bytes) -> str:
        assert self.dir is not None
        name = key.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def _unlink(self, key: bytes) -> None:
        """Removes an evicted block's file unless the key was put again meanwhile (its new
        file would be the one removed): under the lock, so that no put slips in between."""
        with self._lock:
            if key in self._index:
                return
            try:
                os.unlink(path := self._file(key))
                self._dirty_dirs.add(os.path.dirname(path))
            except OSError:
                pass

    # --- on the I/O threads -----------------------------------------------------------------

    def _iov(self, view: np.ndarray, bufs: _Buffers) -> tuple[list[Any], np.ndarray | None]:
        """The buffers one file's I/O goes through, header page first, and the bounce
        buffer's payload when the row cannot be used in place (O_DIRECT and an unaligned
        row; an aligned row of a length not a multiple of 4096 bounces only its tail)."""
        n = view.nbytes
        aligned = view.ctypes.data % ALIGN == 0
        if not self.direct_io or (aligned and n % ALIGN == 0):
            return [bufs.header, view], None
        if bufs.bounce is None:
            bufs.bounce = mmap.mmap(-1, self.file_nbytes - ALIGN)
        bounce = np.frombuffer(bufs.bounce, np.uint8)
        if not aligned:
            return [bufs.header, bounce], bounce[:n]
        body = n - n % ALIGN
        iov: list[Any] = [bufs.header, view[:body]] if body else [bufs.header]
        iov.append(bounce[:ALIGN])
        return iov, None

    def _write(self, key: bytes, view: np.ndarray, written: Future, victims: list[bytes],
               release: Any) -> None:
        t0 = time.perf_counter()
        ok = False
        released = False
        tmp = None
        try:
            for victim in victims:
                self._unlink(victim)
            bufs = self._buffers
            iov, bounce = self._iov(view, bufs)
            payload: Any = view
            n = view.nbytes
            if bounce is not None:  # the whole row through the bounce buffer
                np.copyto(bounce, view)
                iov[-1][n:] = 0  # padding: zeros, not what an earlier read left there
                payload = bounce
            elif self.direct_io and n % ALIGN:  # an aligned row's tail
                iov[-1][:n % ALIGN] = view[n - n % ALIGN:]
                iov[-1][n % ALIGN:] = 0
            bufs.header[:] = encode_header(self.fingerprint, key, payload).ljust(ALIGN, b"\0")
            if bounce is not None:
                release()
                released = True
            final = self._file(key)
            tmp = os.path.join(os.path.dirname(final), f".{key.hex()}.{os.getpid()}."
                                                       f"{next(self._names)}{TMP_SUFFIX}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
            fd = os.open(tmp, flags | (_O_DIRECT if self.direct_io else 0), 0o644)
            try:
                expect = self.file_nbytes if self.direct_io else ALIGN + view.nbytes
                if os.pwritev(fd, iov, 0) != expect:
                    raise OSError("a short write")  # a full disk or a file size limit
                if not self.direct_io:
                    if expect != self.file_nbytes:  # the padding, so every file has one size
                        os.ftruncate(fd, self.file_nbytes)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # starts the writeback
            finally:
                os.close(fd)
                if not released:
                    release()
                    released = True
            os.replace(tmp, final)
            tmp = None
            ok = True
        except BaseException:  # noqa: BLE001 - a failed write is dropped, never raised
            ok = False
        finally:
            if not released:
                release()
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            seconds = time.perf_counter() - t0
            with self._lock:
                self._pending.discard(written)
                s = self._stats
                s.write_seconds += seconds
                if ok:
                    s.written += 1
                    s.written_bytes += view.nbytes
                    self._unsynced.add(key)
                    self._dirty_dirs.add(os.path.dirname(self._file(key)))
                    if self._index.get(key, False) is written:
                        self._index[key] = None
                else:
                    s.dropped_writes += 1
                    if self._index.get(key, False) is written:
                        del self._index[key]
                        self._used -= self.file_nbytes
            written.set_result(ok)

    def _read(self, i: int, key: bytes, view: np.ndarray, writing: Future | None,
              found: list[bool], release: Any) -> None:
        t0 = time.perf_counter()
        outcome = "miss"
        try:
            if writing is not None and not writing.result():
                return  # its write was dropped
            try:
                fd = os.open(self._file(key),
                             os.O_RDONLY | _O_CLOEXEC | (_O_DIRECT if self.direct_io else 0))
            except OSError:
                outcome = "gone"  # removed by another store on the same directory
                return
            try:
                bufs = self._buffers
                iov, bounce = self._iov(view, bufs)
                outcome = "corrupt"
                if os.fstat(fd).st_size != self.file_nbytes:
                    return
                expect = self.file_nbytes if self.direct_io else ALIGN + view.nbytes
                if os.preadv(fd, iov, 0) != expect:
                    return
                if self.direct_io and bounce is None and view.nbytes % ALIGN:
                    tail = view.nbytes % ALIGN
                    view[view.nbytes - tail:] = iov[-1][:tail]
                check_value(bufs.header[:HEADER_NBYTES], view if bounce is None else bounce,
                            self.fingerprint, key, view.nbytes)
                if bounce is not None:
                    np.copyto(view, bounce)
                if not self.direct_io:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                outcome = "hit"
            finally:
                os.close(fd)
        except CorruptBlock:
            outcome = "corrupt"
        except BaseException:  # noqa: BLE001 - an I/O error is a miss, never raised
            outcome = "gone" if outcome == "miss" else outcome
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                s = self._stats
                s.read_seconds += seconds
                if outcome == "hit":
                    s.hits += 1
                    s.read_bytes += view.nbytes
                    found[i] = True
                elif outcome == "corrupt":
                    s.corrupt += 1
                    self._forget(key, remove_file=True)
                else:
                    s.misses += 1
                    if outcome == "gone":
                        self._forget(key, remove_file=False)
            release()

    def _forget(self, key: bytes, remove_file: bool) -> None:
        """Under the lock: drops a block on disk from the index (not a write in flight: the
        file it will put in place is another), and removes its file."""
        writing = self._index.get(key, False)
        if writing is not None and writing is not False:
            return
        if writing is None:
            del self._index[key]
            self._used -= self.file_nbytes
        if remove_file:
            try:
                os.unlink(path := self._file(key))
                self._dirty_dirs.add(os.path.dirname(path))
            except OSError:
                pass

    def _fsync(self, key: bytes) -> None:
        try:
            fd = os.open(self._file(key), os.O_RDONLY | _O_CLOEXEC)
        except OSError:
            return  # removed since (evicted, or refused)
        try:
            os.fsync(fd)
            if not self.direct_io:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: dropped
        except OSError:
            with self._lock:
                self._stats.dropped_writes += 1
                self._forget(key, remove_file=True)
        finally:
            os.close(fd)
