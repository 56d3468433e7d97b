"""FileStore in one process: round trips, lookups, LRU capacity, corruption, restarts, bad
arguments and threads, each against a plain reference (a dict of rows, an LRU model) on
fresh random data."""

from __future__ import annotations

import collections
import glob
import hashlib
import os
import shutil
import threading

import numpy as np
import pytest

from jax_kvxfer.stores import FileStore, StoreStats, aligned_rows
from jax_kvxfer.stores.base import HEADER_NBYTES

LAYOUT = ("test-layout", 1)
# a row that is a multiple of 4096 bytes, and rows that are not (a tail past the last page)
ROW_SIZES = (16384, 5000, 100)
MODES = (None, False)  # direct_io: probed (O_DIRECT here), buffered


def new_keys(rng: np.random.Generator, n: int) -> list[bytes]:
    return [rng.bytes(16) for _ in range(n)]


def random_rows(rng: np.random.Generator, n: int, row_nbytes: int, aligned: bool) -> np.ndarray:
    rows = aligned_rows(n, row_nbytes) if aligned else np.empty((n, row_nbytes), np.uint8)[:, :]
    rows[:] = rng.integers(0, 256, (n, row_nbytes), dtype=np.uint8)
    if not aligned and rows.ctypes.data % 4096 == 0:  # make sure: off the page boundary
        raw = np.empty(n * row_nbytes + 64, np.uint8)
        off = raw[64:].reshape(n, row_nbytes)
        off[:] = rows
        rows = off
    return rows


def make(path, row_nbytes: int, namespace: str = "model-a", **kw) -> FileStore:
    store = FileStore(path, namespace=namespace, **kw)
    store.bind(LAYOUT, row_nbytes)
    return store


def block_files(store: FileStore) -> list[str]:
    return sorted(glob.glob(os.path.join(store.dir, "*", "*.kvb")))


def get_rows(store: FileStore, keys: list[bytes], fill: int = 0) -> tuple[list[bool], np.ndarray]:
    out = np.full((len(keys), store.row_nbytes), fill, np.uint8)
    return store.get(keys, list(out)).result(timeout=60), out


@pytest.mark.parametrize("direct_io", MODES, ids=["probed", "buffered"])
@pytest.mark.parametrize("row_nbytes", ROW_SIZES)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip_misses_and_lookup(tmp_path, rng, direct_io, row_nbytes, aligned):
    store = make(tmp_path, row_nbytes, threads=3, direct_io=direct_io)
    assert store.io_mode in ("O_DIRECT", "buffered")
    assert store.direct_io == (store.io_mode == "O_DIRECT")
    if direct_io is False:
        assert store.io_mode == "buffered"
    ref: dict[bytes, np.ndarray] = {}
    chain = new_keys(rng, 24)
    rows = random_rows(rng, 24, row_nbytes, aligned)
    # the chain's first 10 in one put, 6 more later, the rest never
    store.put(chain[:10], list(rows[:10])).result(timeout=60)
    store.put(chain[10:16], list(rows[10:16])).result(timeout=60)
    store.flush()
    for k, r in zip(chain[:16], rows[:16]):
        ref[k] = r.copy()
    rows[:] = 0  # the rows may be reused once put's future is done
    assert store.lookup(chain) == 16
    assert store.lookup(chain[:5]) == 5
    assert store.lookup(chain[16:]) == 0
    assert store.lookup([chain[0], chain[20], chain[1]]) == 1
    assert store.lookup([]) == 0

    order = list(rng.permutation(24))
    asked = [chain[i] for i in order]
    assert store.lookup_each(asked) == [k in ref for k in asked]  # per key, in any order
    assert store.lookup_each([]) == []
    out = random_rows(rng, 24, row_nbytes, aligned)
    before = out.copy()
    found = store.get(asked, list(out)).result(timeout=60)
    assert found == [k in ref for k in asked]
    for k, row, was, hit in zip(asked, out, before, found):
        if hit:
            np.testing.assert_array_equal(row, ref[k])
        else:  # absent: the row is left as it was
            np.testing.assert_array_equal(row, was)
    s = store.stats()
    assert (s.hits, s.misses, s.corrupt, s.written, s.dropped_writes) == (16, 8, 0, 16, 0)
    assert s.read_bytes == s.written_bytes == 16 * row_nbytes
    assert s.lookups == 24 + 5 + 8 + 3 + 24
    assert store.stats() == StoreStats()  # counting anew
    # every file: a header page, then the payload padded to pages
    files = block_files(store)
    assert len(files) == 16
    assert {os.path.getsize(f) for f in files} == {4096 + -(-row_nbytes // 4096) * 4096}
    store.close()


def test_put_skips_keys_stored_and_repeated(tmp_path, rng):
    store = make(tmp_path, 8192)
    k = new_keys(rng, 2)
    rows = random_rows(rng, 3, 8192, True)
    store.put([k[0], k[0], k[1]], list(rows)).result(timeout=60)
    store.put([k[0]], [rows[2]]).result(timeout=60)  # stored already: kept as it was
    store.flush()
    found, out = get_rows(store, [k[0], k[1]])
    assert found == [True, True]
    np.testing.assert_array_equal(out[0], rows[0])
    np.testing.assert_array_equal(out[1], rows[2])
    assert store.stats().written == 2
    store.close()


def test_get_waits_for_writes_in_flight(tmp_path, rng):
    """A get right after a put (no flush) finds the rows: a read queued behind its write."""
    store = make(tmp_path, 65536, threads=1)
    keys = new_keys(rng, 32)
    rows = random_rows(rng, 32, 65536, False)
    store.put(keys, list(rows))
    found, out = get_rows(store, keys)
    assert all(found)
    np.testing.assert_array_equal(out, rows)
    store.close()


@pytest.mark.parametrize("direct_io", MODES, ids=["probed", "buffered"])
def test_restart_finds_every_flushed_block(tmp_path, rng, direct_io):
    """A few thousand blocks written, flushed and closed; a new store indexes them all (the
    lookup of the whole chain), reads them bit-exact, and keeps the newest by modification
    time when its capacity is smaller."""
    n, row = 3000, 100
    keys = new_keys(rng, n)
    rows = random_rows(rng, n, row, False)
    with make(tmp_path, row, direct_io=direct_io) as a:
        a.put(keys, list(rows)).result(timeout=60)
        a.flush()
        files = {os.path.basename(f)[:32]: f for f in block_files(a)}
    assert len(files) == n
    b = make(tmp_path, row, direct_io=direct_io)
    assert b.lookup(keys) == n
    found, out = get_rows(b, keys)
    assert all(found)
    np.testing.assert_array_equal(out, rows)
    b.close()
    # modification times in a known order (newest last), then a capacity of 1,000 blocks
    for i, k in enumerate(keys):
        os.utime(files[k.hex()], ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    c = make(tmp_path, row, capacity_bytes=1000 * 8192, direct_io=direct_io)
    assert c.stats().evicted == n - 1000
    assert [c.lookup([k]) for k in keys] == [0] * (n - 1000) + [1] * 1000
    assert len(block_files(c)) == 1000
    c.close()


def test_other_namespaces_and_layouts_never_mix(tmp_path, rng):
    keys = new_keys(rng, 4)
    rows = random_rows(rng, 4, 4096, True)
    with make(tmp_path, 4096, namespace="model-a") as a:
        a.put(keys, list(rows)).result(timeout=60)
    other_ns = make(tmp_path, 4096, namespace="model-b")
    other_layout = FileStore(tmp_path, namespace="model-a")
    other_layout.bind(("another layout",), 4096)
    for store in (other_ns, other_layout):
        assert store.lookup(keys) == 0
        found, _ = get_rows(store, keys)
        assert found == [False] * 4
        store.close()
    with make(tmp_path, 4096, namespace="model-a") as again:
        assert again.lookup(keys) == 4


class LRUModel:
    """The reference: capacity in blocks, least recently put or got evicted first."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.od: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.evicted = 0

    def put(self, key: bytes, row: bytes) -> None:
        if key in self.od:
            self.od.move_to_end(key)
            return
        while len(self.od) >= self.blocks:
            self.od.popitem(last=False)
            self.evicted += 1
        self.od[key] = row

    def get(self, key: bytes) -> bytes | None:
        if key in self.od:
            self.od.move_to_end(key)
            return self.od[key]
        return None


def test_capacity_evicts_least_recently_used(tmp_path, rng):
    row = 5000  # 12 KiB per file
    blocks = 7
    store = make(tmp_path, row, capacity_bytes=blocks * 12288 + 100)
    model = LRUModel(blocks)
    universe = new_keys(rng, 20)
    data = {k: rng.integers(0, 256, row, dtype=np.uint8) for k in universe}
    evicted = 0
    for step in range(120):
        batch = [universe[i] for i in rng.integers(0, 20, int(rng.integers(1, 4)))]
        if rng.random() < 0.5:
            store.put(batch, [data[k] for k in batch]).result(timeout=60)
            store.flush()
            for k in batch:
                model.put(k, data[k].tobytes())
        else:
            found, out = get_rows(store, batch)
            expect = [model.get(k) for k in batch]
            assert found == [e is not None for e in expect], step
            for row_out, e in zip(out, expect):
                if e is not None:
                    assert row_out.tobytes() == e
        evicted += store.stats().evicted
        assert {k for k in universe if store.lookup([k])} == set(model.od), step
        assert len(block_files(store)) == len(model.od), step
    assert evicted == model.evicted > 0


def test_capacity_smaller_than_a_block_is_refused(tmp_path):
    store = FileStore(tmp_path, namespace="m", capacity_bytes=8191)
    with pytest.raises(ValueError, match="capacity_bytes=8191 holds no block: one block of "
                                         "100 bytes takes 8192 bytes"):
        store.bind(LAYOUT, 100)


# --- corruption ---------------------------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def _write(path: str, data: bytes, mode: str = "wb") -> None:
    with open(path, mode) as f:
        f.write(data)


CORRUPTIONS = {
    "payload bit flip": lambda p, row: _flip(p, 4096 + row // 2),
    "last payload byte": lambda p, row: _flip(p, 4096 + row - 1),
    "header checksum": lambda p, row: _flip(p, 49),
    "header version": lambda p, row: _flip(p, 4),
    "header key": lambda p, row: _flip(p, 30),
    "header fingerprint": lambda p, row: _flip(p, 10),
    "header magic": lambda p, row: _flip(p, 0),
    "header length": lambda p, row: _flip(p, 44),
    "truncated into the payload": lambda p, row: _truncate(p, 4096 + row // 2),
    "truncated to the header": lambda p, row: _truncate(p, HEADER_NBYTES),
    "empty": lambda p, row: _truncate(p, 0),
    "garbage of the right size": lambda p, row: _write(
        p, np.random.default_rng(len(p)).bytes(os.path.getsize(p))),
    "garbage, longer": lambda p, row: _write(p, b"x" * 4096, "ab"),
}


@pytest.mark.parametrize("direct_io", MODES, ids=["probed", "buffered"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_blocks_are_misses_counted_and_removed(tmp_path, rng, how, aligned, direct_io):
    row = 10000
    store = make(tmp_path, row, direct_io=direct_io)
    keys = new_keys(rng, 3)
    rows = random_rows(rng, 3, row, aligned)
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()
    store.stats()
    bad = block_files(store)[0]
    bad_key = bytes.fromhex(os.path.basename(bad)[:32])
    CORRUPTIONS[how](bad, row)
    out = random_rows(rng, 3, row, aligned)
    before = out.copy()
    found = store.get(keys, list(out)).result(timeout=60)
    assert found == [k != bad_key for k in keys]
    for r, o, b, hit in zip(rows, out, before, found):
        if hit:
            np.testing.assert_array_equal(o, r)
        elif store.direct_io and not aligned:  # read through the bounce buffer: untouched
            np.testing.assert_array_equal(o, b)
    s = store.stats()
    assert (s.corrupt, s.hits, s.misses) == (1, 2, 0)
    assert not os.path.exists(bad)
    assert store.lookup([bad_key]) == 0
    # the key can be stored again
    i = keys.index(bad_key)
    store.put([bad_key], [rows[i]]).result(timeout=60)
    found, out2 = get_rows(store, [bad_key])
    assert found == [True]
    np.testing.assert_array_equal(out2[0], rows[i])
    store.close()


def test_a_block_of_another_namespace_under_the_same_key(tmp_path, rng):
    row = 4096
    key = new_keys(rng, 1)
    mine, theirs = random_rows(rng, 2, row, True)
    with make(tmp_path, row, namespace="model-b") as b:
        b.put(key, [theirs]).result(timeout=60)
        b.flush()  # put's future: the row read; flush: the file in place
        their_file = block_files(b)[0]
    a = make(tmp_path, row, namespace="model-a")
    a.put(key, [mine]).result(timeout=60)
    a.flush()
    my_file = block_files(a)[0]
    assert os.path.basename(my_file) == os.path.basename(their_file)
    shutil.copyfile(their_file, my_file)  # same name, same size, a valid block of model-b
    found, _ = get_rows(a, key)  # the refused row's bytes are unspecified: an O_DIRECT read
    assert found == [False]     # into a row that happens to be page-aligned fills it in place
    assert a.stats().corrupt == 1
    assert not os.path.exists(my_file)
    a.close()


def test_restart_refuses_files_of_the_wrong_size_and_leaves_others_alone(tmp_path, rng):
    row = 4096
    keys = new_keys(rng, 4)
    rows = random_rows(rng, 4, row, True)
    with make(tmp_path, row) as a:
        a.put(keys, list(rows)).result(timeout=60)
        a.flush()
        files = block_files(a)
        sub = os.path.dirname(files[0])
    _truncate(files[0], 5000)
    torn = bytes.fromhex(os.path.basename(files[0])[:32])
    strangers = [os.path.join(sub, "README"), os.path.join(sub, "zz" * 16 + ".kvb"),
                 os.path.join(os.path.dirname(sub), "notes.txt")]
    for p in strangers:
        with open(p, "wb") as f:
            f.write(b"not a block")
    b = make(tmp_path, row)
    assert b.stats().corrupt == 1
    assert not os.path.exists(files[0])
    assert all(os.path.exists(p) for p in strangers)
    assert [b.lookup([k]) for k in keys] == [int(k != torn) for k in keys]
    found, out = get_rows(b, keys)
    assert found == [k != torn for k in keys]
    for r, o, hit in zip(rows, out, found):
        if hit:
            np.testing.assert_array_equal(o, r)
    b.close()


# --- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"namespace": ""}, r"namespace must be a non-empty string .* got ''"),
    ({"namespace": 7}, r"namespace must be a non-empty string .* got 7"),
    ({"namespace": "a\nb"}, r"namespace must be .* printable .* got 'a\\nb'"),
    ({"capacity_bytes": 0}, r"capacity_bytes must be a positive int .* got 0"),
    ({"capacity_bytes": -5}, r"capacity_bytes must be a positive int .* got -5"),
    ({"capacity_bytes": 1.5e9}, r"capacity_bytes must be a positive int .* got 1500000000.0"),
    ({"capacity_bytes": "1G"}, r"capacity_bytes must be a positive int .* got '1G'"),
    ({"capacity_bytes": True}, r"capacity_bytes must be a positive int .* got True"),
    ({"threads": 0}, r"threads must be an int >= 1, got 0"),
    ({"threads": 2.0}, r"threads must be an int >= 1, got 2.0"),
    ({"direct_io": "yes"}, r"direct_io must be None \(probe\), True or False, got 'yes'"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    args = {"namespace": "m", **kwargs}
    with pytest.raises(ValueError, match=message):
        FileStore(tmp_path, **args)


def test_bad_paths(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"path must be an existing directory, got "
                                         r"'.*nope', which does not exist"):
        FileStore(missing, namespace="m")
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"path must be an existing directory, got "
                                         r"'.*file', which is not a directory"):
        FileStore(a_file, namespace="m")
    with pytest.raises(ValueError, match=r"path must be a path to a directory, got 3"):
        FileStore(3, namespace="m")
    # a directory that takes no file, even for root
    with pytest.raises(ValueError, match=r"path must be a writable directory, but '/proc' is "
                                         r"not: creating a file there failed"):
        FileStore("/proc", namespace="m")


def test_bad_calls(tmp_path, rng):
    store = FileStore(tmp_path, namespace="m")
    with pytest.raises(RuntimeError, match="not bound to a layout yet"):
        store.put(new_keys(rng, 1), [np.zeros(4096, np.uint8)])
    with pytest.raises(ValueError, match="row_nbytes must be a positive int, got 0"):
        store.bind(LAYOUT, 0)
    store.bind(LAYOUT, 4096)
    store.bind(LAYOUT, 4096)  # the same again: nothing
    with pytest.raises(ValueError, match="bound to another layout already"):
        store.bind(("other",), 4096)
    with pytest.raises(ValueError, match=r"keys\[1\] must be 16 bytes"):
        store.put([b"k" * 16, b"short"], [np.zeros(4096, np.uint8)] * 2)
    with pytest.raises(ValueError, match="rows: 1 rows for 2 keys"):
        store.get(new_keys(rng, 2), [np.zeros(4096, np.uint8)])
    with pytest.raises(ValueError, match=r"rows\[0\] must be a C-contiguous buffer of "
                                         r"row_nbytes=4096 bytes, got 4000 bytes"):
        store.put(new_keys(rng, 1), [np.zeros(4000, np.uint8)])
    with pytest.raises(ValueError, match=r"not contiguous"):
        store.put(new_keys(rng, 1), [np.zeros(8192, np.uint8)[::2]])
    ro = np.zeros(4096, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"rows\[0\] must be writable"):
        store.get(new_keys(rng, 1), [ro])
    store.put(new_keys(rng, 1), [ro]).result(timeout=60)  # reading it is fine
    store.put(new_keys(rng, 1), [bytearray(4096)]).result(timeout=60)  # any buffer
    with pytest.raises(ValueError, match=r"rows\[0\] must be a buffer .* got object"):
        store.put(new_keys(rng, 1), [object()])
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="FileStore is closed"):
        store.lookup(new_keys(rng, 1))


def test_concurrent_callers(tmp_path, rng):
    """Four threads put, get, look up and read statistics at once, on keys of their own and
    on keys they share; every row read is the row put."""
    row = 12288
    store = make(tmp_path, row, threads=4)
    shared = new_keys(rng, 8)
    shared_rows = random_rows(rng, 8, row, False)
    data = {k: r for k, r in zip(shared, shared_rows)}
    errors = []
    totals = StoreStats()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            mine = [r.bytes(16) for _ in range(40)]
            rows = r.integers(0, 256, (40, row), dtype=np.uint8)
            for i in range(0, 40, 5):
                ks = mine[i:i + 5] + shared[i // 5:i // 5 + 1]
                rs = list(rows[i:i + 5]) + [data[ks[-1]]]
                store.put(ks, rs).result(timeout=60)
                found, out = get_rows(store, ks)
                assert all(found)
                for o, want in zip(out, rs):
                    np.testing.assert_array_equal(o, want)
                assert store.lookup(mine[:i + 5]) == i + 5
                with lock:
                    totals.add(store.stats())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.flush()
    totals.add(store.stats())
    assert totals.written == 4 * 40 + 8
    assert totals.hits == 4 * 8 * 6 and totals.corrupt == totals.misses == 0
    store.close()


def test_crc_header_names_the_layout(tmp_path, rng):
    """The header of a file holds the store's fingerprint and the key (an independent parse)."""
    store = make(tmp_path, 4096)
    key = new_keys(rng, 1)
    row = random_rows(rng, 1, 4096, True)
    store.put(key, list(row)).result(timeout=60)
    store.flush()
    with open(block_files(store)[0], "rb") as f:
        head = f.read(4096)
        payload = f.read()
    import struct
    import zlib
    magic, version, _, fp, k, length, crc = struct.unpack_from("<4sHH16s16sQI", head)
    assert (magic, version, fp, k, length) == (b"KVXB", 1, store.fingerprint, key[0], 4096)
    assert crc == zlib.crc32(row[0]) and payload == row[0].tobytes()
    assert head[HEADER_NBYTES:] == bytes(4096 - HEADER_NBYTES)
    assert os.path.basename(os.path.dirname(block_files(store)[0])) == key[0].hex()[:2]
    assert store.fingerprint == hashlib.blake2b(
        repr((1, "model-a", LAYOUT)).encode(), digest_size=16).digest()
    store.close()
