"""MooncakeStore against real mooncake_master processes (the binaries the mooncake wheel ships,
started on 127.0.0.1 on free ports by `start_local_master`, with a holder process lending the
pool its memory): round trips, lookups, two processes through a BlockManager, namespaces,
foreign values, a master killed, restarted, frozen or full, a master down at construction,
and bad arguments. No mocks. Skipped only where the wheel cannot be imported, and never in CI
(CI=true), where .ci/run installs what it links."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from mooncake_servers import start_master
from store_checks import (
    check_killed_mid_run_then_restarted,
    check_namespaces_are_isolated,
    get_rows,
    new_keys,
    random_rows,
    wait_for,
)

from jax_kvxfer.stores import MooncakeStore, start_local_master
from jax_kvxfer.stores.base import HEADER_NBYTES

LAYOUT = ("mooncake-test", 1)
MiB = 1 << 20


os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the client's INFO lines


def _client_module():
    try:
        from mooncake import store
    except ImportError as e:
        if os.environ.get("CI"):
            raise  # CI installs the wheel and its libraries: it must run these tests
        pytest.skip(f"the mooncake wheel cannot be imported here ({e}); "
                    "pip install -e '.[test]' and apt-get install libibverbs1")
    return store


@pytest.fixture(autouse=True)
def _needs_mooncake():
    _client_module()


@pytest.fixture(scope="module")
def master() -> Iterator:
    """A master with a 256 MiB holder, shared by a module's tests (each its own namespace)."""
    _client_module()
    with start_local_master(256 * MiB) as m:
        yield m


@pytest.fixture
def new_master() -> Iterator:
    """A factory of private masters, stopped at the end of the test."""
    masters = []

    def make(segment_bytes: int = 64 * MiB, **kw):
        m = start_master(segment_bytes, **kw)
        masters.append(m)
        return m

    yield make
    for m in masters:
        m.stop()


def make(address: str, row_nbytes: int, namespace: str = "model-a", layout=LAYOUT,
         **kw) -> MooncakeStore:
    store = MooncakeStore(address, namespace=namespace, **kw)
    store.bind(layout, row_nbytes)
    return store


def raw_client(address: str):
    """Mooncake's own client on the same master, for values the store did not write."""
    client = _client_module().MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", address) == 0
    return client


@pytest.mark.parametrize("row_nbytes,max_batch_bytes", [(5000, 12000), (2 * MiB, 5 * MiB)])
def test_round_trip_lookup_and_batches(master, rng, row_nbytes, max_batch_bytes):
    """Random rows come back bit for bit (several batch calls per put and get); absent keys
    miss and leave their rows untouched; lookup is the longest stored prefix; a block put
    again is not a drop."""
    store = make(master.address, row_nbytes, namespace=f"rt-{row_nbytes}",
                 max_batch_bytes=max_batch_bytes)
    n = 24 if row_nbytes < MiB else 10
    chain = new_keys(rng, n)
    rows = random_rows(rng, n, row_nbytes)
    assert store.lookup(chain) == 0
    store.put(chain[:n - 3], list(rows[:n - 3])).result(timeout=60)
    store.flush()
    assert store.lookup(chain) == n - 3
    assert store.lookup(chain[:4]) == 4 and store.lookup([]) == 0
    found, out = get_rows(store, chain)
    assert found == [True] * (n - 3) + [False] * 3
    assert np.array_equal(out[:n - 3], rows[:n - 3]) and (out[n - 3:] == 7).all()
    store.put(chain, list(rows)).result(timeout=60)  # n - 3 stored already: no drop
    store.flush()
    found, out = get_rows(store, chain)
    assert all(found) and np.array_equal(out, rows)
    s = store.stats()
    assert (s.written, s.dropped_writes, s.hits, s.misses, s.corrupt) == (2 * n - 3, 0,
                                                                           2 * n - 3, 3, 0)
    assert s.read_bytes == (2 * n - 3) * row_nbytes
    assert store.available is True
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.lookup(chain)


def test_concurrent_callers(master, rng):
    """Four threads put and get their own blocks at once through one store: all exact."""
    store = make(master.address, 30000, namespace="concurrent", threads=3)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            keys = new_keys(r, 20)
            rows = random_rows(r, 20, 30000)
            for _ in range(3):
                store.put(keys, list(rows)).result(timeout=60)
                store.flush()
                found, out = get_rows(store, keys)
                assert all(found) and np.array_equal(out, rows)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    s = store.stats()
    assert (s.written, s.hits, s.dropped_writes) == (240, 240, 0)
    store.close()


@pytest.mark.slow
def test_another_process_reuses_a_prefix_through_a_block_manager(master):
    """Process A (a subprocess, its own pools and block manager) serves prompts until their
    blocks leave its GPU and host pools, flushes and exits; this process, with new pools,
    reuses their prefixes from the shared store, every reused position checked."""
    here = os.path.dirname(os.path.abspath(__file__))
    cache_tests = os.path.join(os.path.dirname(here), "cache")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {cache_tests!r})
        import numpy as np
        from test_block_manager_stores import make_pool, serve, BlockManager, MAX_LEN
        from jax_kvxfer.stores import MooncakeStore
        rng = np.random.default_rng(5)
        store = MooncakeStore({master.address!r}, namespace="two-procs")
        pool = make_pool(4, 2)
        bm = BlockManager(pool, stores=[store])
        prompts = [list(map(int, rng.integers(0, 50, MAX_LEN))) for _ in range(6)]
        for i, p in enumerate(prompts):
            serve(bm, pool, i, p)
        for i in range(6):  # evicts every block from the GPU and the host
            serve(bm, pool, 100 + i, list(map(int, rng.integers(50, 99, MAX_LEN))))
        bm.close()
        s = store.stats()
        store.close()
        print("written", s.written, "dropped", s.dropped_writes)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    words = out.stdout.split()
    assert int(words[words.index("written") + 1]) > 0, out.stdout
    assert int(words[words.index("dropped") + 1]) == 0, out.stdout

    sys.path.insert(0, os.path.join(os.path.dirname(here), "cache"))
    try:
        from test_block_manager_stores import MAX_LEN, BlockManager, T, make_pool, serve
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 50, MAX_LEN))) for _ in range(6)]
    store = MooncakeStore(master.address, namespace="two-procs")
    pool = make_pool(8, 4)
    bm = BlockManager(pool, stores=[store])
    reused = [serve(bm, pool, i, p) for i, p in enumerate(prompts)]
    assert all(r >= T for r in reused), reused  # serve() checked every reused position
    assert bm.stats.store_hit_blocks >= len(prompts)
    assert bm.store_stats()["MOONCAKE"].hits >= len(prompts)
    bm.close()
    assert store.stats().corrupt == 0
    store.close()


def test_namespaces_and_layouts_are_isolated(master, rng):
    check_namespaces_are_isolated(lambda row, **kw: make(master.address, row, **kw), rng)


def test_foreign_values_under_our_keys_are_counted_misses_and_removed(master, rng):
    """Values a raw Mooncake client wrote under the store's keys: junk of the right size, a
    short value, a longer one, a flipped payload bit, another key's block, another namespace's
    block. Each is a miss counted in `corrupt`, the row untouched, and the value removed (a
    later put stores the block); the good blocks beside them are hits."""
    row = 2048
    store = make(master.address, row, namespace="foreign")
    other = make(master.address, row, namespace="foreign-other")
    keys = new_keys(rng, 7)
    rows = random_rows(rng, 7, row)
    store.put(keys[3:5], list(rows[3:5])).result(timeout=60)
    other.put(keys[5:6], list(rows[5:6])).result(timeout=60)
    store.flush()
    other.flush()
    raw = raw_client(master.address)

    def name(s, key):
        return f"{s.key_prefix}{key.hex()}"

    good3 = raw.get(name(store, keys[3]))
    assert len(good3) == HEADER_NBYTES + row
    flipped = bytearray(good3)
    flipped[HEADER_NBYTES + 100] ^= 0x10
    assert raw.remove(name(store, keys[3]), True) == 0
    values = {0: rng.bytes(HEADER_NBYTES + row),  # junk of the right size
              1: good3[:-1],  # short
              2: good3 + b"x",  # long
              3: bytes(flipped),  # a bad checksum
              6: raw.get(name(store, keys[4]))}  # another key's block
    for i, v in values.items():
        assert raw.put(name(store, keys[i]), v) == 0
    assert raw.put(name(store, keys[5]), raw.get(name(other, keys[5]))) == 0  # another ns'
    store.stats()
    found, out = get_rows(store, keys)
    assert found == [False] * 4 + [True, False, False]  # keys[4]: intact
    assert (out[:4] == 7).all() and (out[5:] == 7).all()
    assert np.array_equal(out[4], rows[4])
    s = store.stats()
    assert (s.corrupt, s.misses, s.hits) == (6, 0, 1)
    # removed in the background: then a put stores the real blocks
    assert wait_for(lambda: raw.batch_is_exist([name(store, k) for k in keys[:4] + keys[5:]])
                    == [0] * 6)
    assert store.lookup(keys) == 0
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    found, out = get_rows(store, keys)
    assert all(found) and np.array_equal(out, rows)
    raw.close()
    store.close()
    other.close()


@pytest.mark.slow
def test_master_killed_mid_run_then_restarted(new_master, rng):
    """SIGKILL of the master mid-run, then a restarted master (empty: its metadata went; the
    holder mounts its segment again): see the check."""
    m = new_master(64 * MiB)
    store = make(m.address, 50000, namespace="killed", timeout_s=0.5, retry_s=0.2)
    check_killed_mid_run_then_restarted(store, m.kill_master, m.restart_master, rng,
                                        recover_s=30)


@pytest.mark.slow
def test_frozen_master_is_a_miss_after_timeout_s(new_master, rng):
    """SIGSTOP: the master's connections stay open but nothing answers (the client itself would
    wait 30 s). A get is all misses within about timeout_s, the rows untouched; while
    unavailable, calls answer at once; after SIGCONT, hits come back, exact."""
    m = new_master(32 * MiB)
    store = make(m.address, 30000, namespace="frozen", timeout_s=0.3, retry_s=0.5)
    keys = new_keys(rng, 6)
    rows = random_rows(rng, 6, 30000)
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    assert store.lookup(keys) == 6
    store.stats()
    m.signal_master(signal.SIGSTOP)
    try:
        t = time.monotonic()
        found, out = get_rows(store, keys)
        first = time.monotonic() - t
        assert not any(found) and (out == 7).all()
        assert 0.25 < first < 2.0, first  # waited for the master, not longer than timeout_s+
        assert store.available is False
        t = time.monotonic()
        assert store.lookup(keys) == 0
        store.put(new_keys(rng, 2), list(rows[:2])).result(timeout=60)
        store.flush()
        found, out = get_rows(store, keys)
        assert time.monotonic() - t < 0.2  # within retry_s: no wait on the network
        assert not any(found) and (out == 7).all()
        s = store.stats()
        assert (s.hits, s.misses, s.dropped_writes) == (0, 12, 2)
    finally:
        m.signal_master(signal.SIGCONT)
    assert wait_for(lambda: store.lookup(keys) == 6, 40)
    found, out = get_rows(store, keys)
    assert all(found) and np.array_equal(out, rows)
    store.close()


@pytest.mark.slow
def test_full_store_drops_writes(new_master, rng):
    """A 16 MiB pool and a put of 24 MiB in one call: what does not fit is dropped and
    counted, never raised; every block read back is exact and only written ones are hits."""
    m = new_master(16 * MiB)
    store = make(m.address, MiB, namespace="full", max_batch_bytes=64 * MiB)
    keys = new_keys(rng, 24)
    rows = random_rows(rng, 24, MiB)
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    s = store.stats()
    assert s.written + s.dropped_writes == 24
    assert s.dropped_writes > 0 and s.written > 0, s
    found, out = get_rows(store, keys)
    assert 0 < sum(found) <= s.written
    for i, f in enumerate(found):
        assert np.array_equal(out[i], rows[i]) if f else (out[i] == 7).all()
    s = store.stats()
    assert s.corrupt == 0 and s.hits + s.misses == 24
    assert store.available is True  # a full store is up: not a master fault
    store.close()


@pytest.mark.slow
def test_master_down_at_construction_starts_and_recovers(rng):
    """No master at the address: construction returns within about timeout_s, and every call
    is a counted miss or drop; once a master starts there, the store uses it."""
    from jax_kvxfer.stores.mooncake import free_port

    port = free_port()
    t = time.monotonic()
    store = make(f"127.0.0.1:{port}", 1000, namespace="late", timeout_s=0.3, retry_s=0.1)
    assert time.monotonic() - t < 2.0
    assert store.available is not True and store.ping() is False
    keys = new_keys(rng, 3)
    rows = random_rows(rng, 3, 1000)
    assert store.lookup(keys) == 0
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    found, out = get_rows(store, keys)
    assert not any(found) and (out == 7).all()
    s = store.stats()
    assert (s.dropped_writes, s.misses, s.lookups, s.hits) == (3, 3, 3, 0)
    with start_local_master(16 * MiB, port=port):  # the master comes: the store uses it
        assert wait_for(store.ping)
        store.put(keys, list(rows)).result(timeout=60)
        store.flush()
        found, out = get_rows(store, keys)
        assert all(found) and np.array_equal(out, rows)
        store.close()


def test_a_store_lending_its_own_segment(new_master, rng):
    """A master without a holder: a store with segment_bytes holds the blocks itself (a store
    without one has nowhere to write: drops, counted); a second store reads them from the
    first one's segment, exact."""
    m = new_master(0)
    lender = make(m.address, 100000, namespace="lend", segment_bytes=32 * MiB)
    reader = make(m.address, 100000, namespace="lend")
    keys = new_keys(rng, 8)
    rows = random_rows(rng, 8, 100000)
    lender.put(keys, list(rows)).result(timeout=60)
    lender.flush()
    assert lender.stats().written == 8
    found, out = get_rows(reader, keys)
    assert all(found) and np.array_equal(out, rows)
    lender.close()  # its segment goes, and the blocks with it
    assert wait_for(lambda: reader.lookup(keys) == 0)
    reader.put(keys, list(rows)).result(timeout=60)
    reader.flush()
    assert reader.stats().dropped_writes == 8
    reader.close()


@pytest.mark.parametrize("kw,match", [
    ({"master": 50051}, "master must be a string"),
    ({"master": "localhost"}, "master must be 'host:port'"),
    ({"master": "h:0"}, "master must be 'host:port'"),
    ({"master": "h:99999"}, "master must be 'host:port'"),
    ({"namespace": ""}, "namespace must be"),
    ({"segment_bytes": -1}, "segment_bytes must be"),
    ({"segment_bytes": 1.5}, "segment_bytes must be"),
    ({"segment_bytes": 1 << 20}, "segment_bytes must be 0 .none. or a number of bytes >= "),
    ({"local_buffer_bytes": 1000}, "local_buffer_bytes must be"),
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ({"timeout_s": "1"}, "timeout_s must be a positive number"),
    ({"retry_s": -1}, "retry_s must be a number of seconds >= 0"),
    ({"threads": 0}, "threads must be an int >= 1"),
    ({"max_batch_bytes": 0}, "max_batch_bytes must be an int >= 1"),
    ({"key_prefix": "a b"}, "key_prefix must be"),
    ({"local_hostname": ""}, "local_hostname must be"),
    ({"metadata_server": None}, "metadata_server must be"),
])
def test_bad_arguments_raise_at_construction(kw, match):
    args = {"master": "127.0.0.1:1", "namespace": "args", **kw}
    master = args.pop("master")
    error = TypeError if "must be a string" in match else ValueError
    with pytest.raises(error, match=match):
        MooncakeStore(master, **args)


def test_bad_calls(master, rng):
    store = MooncakeStore(master.address, namespace="calls")
    with pytest.raises(RuntimeError, match="not bound"):
        store.lookup(new_keys(rng, 1))
    with pytest.raises(ValueError, match="row_nbytes must be a positive int"):
        store.bind(LAYOUT, 0)
    store.bind(LAYOUT, 100)
    with pytest.raises(ValueError, match="bound to another layout"):
        store.bind(("other",), 100)
    with pytest.raises(ValueError, match=r"keys\[0\] must be 16 bytes"):
        store.put([b"short"], [np.zeros(100, np.uint8)])
    with pytest.raises(ValueError, match=r"rows\[0\] must be a C-contiguous buffer"):
        store.get(new_keys(rng, 1), [np.zeros(99, np.uint8)])
    with pytest.raises(ValueError, match=r"rows\[0\] must be writable"):
        ro = np.zeros(100, np.uint8)
        ro.flags.writeable = False
        store.get(new_keys(rng, 1), [ro])
    store.close()
    store.close()  # twice: nothing


def test_without_the_wheel_the_error_names_the_extra(monkeypatch):
    """Where `mooncake` cannot be imported, making a store or starting a master raises an
    ImportError that says what to install."""
    import jax_kvxfer.stores.mooncake as mc

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match=r'pip install "jax_kvxfer\[mooncake\]"'):
        MooncakeStore("127.0.0.1:1", namespace="x")
    with pytest.raises(ImportError, match="libibverbs1"):
        mc.start_local_master(16 * MiB)
