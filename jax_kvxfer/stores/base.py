"""The contract every tier below the host pool implements, and the block format they share.

A store keeps KV-cache blocks by key. Keys are the block manager's chained block hashes (16
bytes, the same in every process that sees the same tokens). A value is a *host row*: the
bytes of one block in every pool of a block manager, in pool order, as the pools' secondary
(pinned host) arrays hold them. Its primitives, in the order a block meets them:

- `bind(layout, row_nbytes)`: once, by the block manager: the layout its rows have (a
  description of every pool's block). With the store's own `namespace` (a model id) it makes
  the store's `fingerprint`; a store returns only blocks written under the same fingerprint.
- `lookup(keys) -> int`: how many keys of a chain, from the first, are stored (the longest
  stored prefix); `lookup_each(keys) -> list[bool]`: per key, whether it is stored (the
  candidates for one partly filled block, asked at once: a server store answers in one round
  trip).
- `put(keys, rows) -> Future`: queues the writes and returns at once; the future is done when
  every row has been read (the host rows may be reused then). Writes that fail (disk full, a
  server down) are dropped and counted, never raised.
- `get(keys, rows) -> Future[list[bool]]`: reads the blocks into the given host rows; per key,
  whether it was found intact. A missing, torn, foreign or corrupt block is a miss (counted),
  never an exception and never wrong data.
- `flush()`: waits until every queued write is durable (or dropped).
- `close()`: flushes and releases the store's threads and handles.
- `stats()`: a `StoreStats` since the last call.

Every block's value starts with the same 64-byte header (`encode_header`): magic, format
version, the namespace fingerprint, the key, the payload's length and its CRC-32, so that a
value from another namespace or layout, a torn write or flipped bits are recognised wherever it
is stored (RedisStore keeps small blocks' values inside larger ones, each with its header).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Self

import numpy as np

KEY_NBYTES = 16  # the block manager's chained block hashes (cache/block_cache.py: block_key)
MAGIC = b"KVXB"
FORMAT_VERSION = 1
# magic, version, reserved, fingerprint, key, payload length, CRC-32 of the payload, reserved
_HEADER = struct.Struct("<4sHH16s16sQI12x")
HEADER_NBYTES = _HEADER.size
assert HEADER_NBYTES == 64


class CorruptBlock(ValueError):
    """A stored value that is not a whole, intact block of this namespace and key."""


@dataclasses.dataclass
class StoreStats:
    """What a store did since the last `stats()` call (bytes: payload bytes)."""

    lookups: int = 0  # keys asked for by lookup
    hits: int = 0  # blocks get found intact
    misses: int = 0  # blocks get did not find (absent, expired, evicted)
    corrupt: int = 0  # values found but refused: torn, bad checksum, foreign, not ours
    written: int = 0  # blocks made durable (or handed to the server)
    dropped_writes: int = 0  # writes given up: store full, disk full, I/O error, server down
    read_bytes: int = 0
    written_bytes: int = 0
    read_seconds: float = 0.0  # wall time of the reads, summed over threads
    write_seconds: float = 0.0
    evicted: int = 0  # blocks the store removed to stay within its capacity

    def add(self, other: StoreStats) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def layout_fingerprint(namespace: str, layout: Any) -> bytes:
    """16 bytes naming what a store's rows mean: the user's namespace (a model id) and the
    layout of a host row (each pool's block shape, dtype and byte count, in order). Stores
    keep and return only blocks of their own fingerprint."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string (a model id), got {namespace!r}")
    return hashlib.blake2b(repr((FORMAT_VERSION, namespace, layout)).encode(),
                           digest_size=16).digest()


try:  # ISA-L's CRC-32 (the `isal` package): zlib's value at 40+ GB/s instead of 4-5
    from isal.isal_zlib import crc32 as _crc32
except ImportError:
    _crc32 = zlib.crc32


def checksum(payload: Any) -> int:
    """CRC-32 of a row (any buffer), with the GIL released: ISA-L's where `isal` is installed,
    else zlib's; both give the same value, so stores written with one read with the other."""
    return _crc32(payload) & 0xFFFFFFFF


def encode_header(fingerprint: bytes, key: bytes, payload: Any) -> bytes:
    """The 64-byte header of a value holding `payload` (a buffer) under `key`."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, memoryview(payload).nbytes,
                        checksum(payload))


def check_header(header: Any, fingerprint: bytes, key: bytes, row_nbytes: int) -> int:
    """Raises CorruptBlock unless `header` (a buffer) is the header of a block of this
    fingerprint and key, of `row_nbytes` bytes; returns the CRC-32 it gives the payload (a
    store that reads the payload straight into a row checks it after: `checksum`)."""
    if memoryview(header).nbytes < HEADER_NBYTES:
        raise CorruptBlock(f"a header of {memoryview(header).nbytes} bytes, expected "
                           f"{HEADER_NBYTES}")
    magic, version, _, found_fp, found_key, length, crc = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptBlock("not a jax_kvxfer block (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, expected {FORMAT_VERSION}")
    if found_fp != fingerprint:
        raise CorruptBlock("written under another namespace or layout")
    if found_key != key:
        raise CorruptBlock("stored under another key")
    if length != row_nbytes:
        raise CorruptBlock(f"a payload of {length} bytes (by its header), expected {row_nbytes}")
    return crc


# The bytes of a header that check_header compares: magic and version [0, 6), fingerprint, key
# and payload length [8, 48) (not the reserved bytes nor the CRC-32, which only the payload can
# confirm). A reader that receives the header first compares them before it writes a row.
HEADER_MASK = np.zeros(HEADER_NBYTES, np.uint8)
HEADER_MASK[0:6] = HEADER_MASK[8:48] = 1
HEADER_CRC_OFFSET = 48  # where the payload's CRC-32 sits (little-endian)


def expected_header(fingerprint: bytes, key: bytes, row_nbytes: int) -> bytes:
    """The header of a block of this fingerprint and key, of `row_nbytes` bytes, but its
    CRC-32 (0): what a block's header is where `HEADER_MASK` is 1."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, row_nbytes, 0)


def check_value(header: Any, payload: Any, fingerprint: bytes, key: bytes,
                row_nbytes: int) -> None:
    """Raises CorruptBlock unless `header` + `payload` are an intact block of this
    fingerprint and key, of `row_nbytes` bytes."""
    crc = check_header(header, fingerprint, key, row_nbytes)
    if memoryview(payload).nbytes != row_nbytes:
        raise CorruptBlock(f"a payload of {memoryview(payload).nbytes} bytes (header: "
                           f"{row_nbytes}), expected {row_nbytes}")
    if checksum(payload) != crc:
        raise CorruptBlock("checksum mismatch")


class Countdown:
    """A future completed with `result` once `n` parts are done (at once when n is 0): a
    store's put or get over several I/O tasks."""

    def __init__(self, n: int, result: Any = None) -> None:
        self.future: Future = Future()
        self.result = result
        self._left = n
        self._lock = threading.Lock()
        if n == 0:
            self.future.set_result(result)

    def done_one(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.future.set_result(self.result)


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
            raise ValueError(f"keys[{i}] must be {KEY_NBYTES} bytes, got {key!r}")
    return keys


class Store(abc.ABC):
    """A tier below the host pool (see the module's docstring for the contract)."""

    #: the tier's name in statistics and KV events ("DISK", ...)
    tier: str = "STORE"

    def __init__(self, namespace: str) -> None:
        layout_fingerprint(namespace, None)  # checks the namespace
        self.namespace = namespace
        self.fingerprint: bytes | None = None
        self.row_nbytes: int | None = None

    def bind(self, layout: Any, row_nbytes: int) -> None:
        """The layout of the rows this store will be given (any repr-stable description); once
        (the same again is a no-op). Sets `fingerprint` from the namespace and the layout.

        Raises:
          ValueError: bound already to another layout.
        """
        fingerprint = layout_fingerprint(self.namespace, layout)
        if self.fingerprint is not None and (self.fingerprint, self.row_nbytes) != (
                fingerprint, row_nbytes):
            raise ValueError(f"{type(self).__name__} is bound to another layout already; use "
                             "one store per block manager layout")
        self.fingerprint, self.row_nbytes = fingerprint, int(row_nbytes)

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain), from the first, are stored."""

    def lookup_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key (not a chain), whether it is stored. Here one `lookup` a key; a store that
        can ask for many keys in one round trip overrides it."""
        return [self.lookup([key]) == 1 for key in check_keys(keys)]

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Queues `rows[i]` (writable buffers of `row_nbytes`) under `keys[i]`; the future is
        done once every row has been read."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], rows: Sequence[Any]) -> Future:
        """Reads `keys[i]` into `rows[i]`; the future's result: per key, found intact."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Waits until every write queued so far is durable (or dropped)."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """The statistics since the last call, and starts counting anew."""

    def close(self) -> None:
        """Flushes; the store takes no more calls."""
        self.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _row_views(self, keys: list[bytes], rows: Sequence[Any], writable: bool) -> list[np.ndarray]:
        """Each of a put's or get's rows as a flat uint8 array over the same memory (no
        copy), checked against `keys` and `row_nbytes`; raises ValueError naming the row."""
        rows = list(rows)
        if len(rows) != len(keys):
            raise ValueError(f"rows: {len(rows)} rows for {len(keys)} keys")
        out = []
        for i, row in enumerate(rows):
            try:
                a = row if isinstance(row, np.ndarray) else np.frombuffer(row, np.uint8)
            except (TypeError, ValueError):
                raise ValueError(f"rows[{i}] must be a buffer (a numpy uint8 array, a "
                                 f"bytearray, ...), got {type(row).__name__}") from None
            if not a.flags.c_contiguous or a.nbytes != self.row_nbytes:
                raise ValueError(f"rows[{i}] must be a C-contiguous buffer of row_nbytes="
                                 f"{self.row_nbytes} bytes, got {a.nbytes} bytes"
                                 + ("" if a.flags.c_contiguous else ", not contiguous"))
            if writable and not a.flags.writeable:
                raise ValueError(f"rows[{i}] must be writable (get fills it in place)")
            out.append(a.reshape(-1).view(np.uint8))
        return out

    def _check_bound(self) -> None:
        if self.fingerprint is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a layout yet: pass it "
                               "to BlockManager(..., stores=[...]), or call bind() first")
