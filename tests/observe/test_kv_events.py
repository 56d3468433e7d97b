"""KV events over real ZMQ sockets, decoded with msgspec against vLLM's schema written out here
(vllm/distributed/kv_events.py, v0.11 to v0.23: tagged, array-like structs), and checked
against the block manager's own view of what each medium holds; replay of missed batches; a
slow subscriber and a full queue show as gaps in the sequence numbers, and publishing never
waits."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

import itertools

import jax_kvxfer as kvx
from jax_kvxfer.cache import BlockManager
from jax_kvxfer.observe import events as kv_events
from jax_kvxfer.stores import FileStore

T = 4  # tokens per block


# vLLM's documented schema (vllm/distributed/kv_events.py; examples/online_serving/
# kv_events_subscriber.py), written here independently of jax_kvxfer.observe.events.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def chain_hashes(tokens) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent hash, tokens) of a prompt's full blocks, as the docs derive them: the
    chained key is BLAKE2b-128 of the parent's key and the block's int64 token ids, the hash its
    first 8 bytes big-endian."""
    out, parent, parent_hash = [], bytes(16), None
    for i in range(0, len(tokens) - len(tokens) % T, T):
        block = tuple(tokens[i:i + T])
        key = hashlib.blake2b(parent + np.asarray(block, "<i8").tobytes(),
                              digest_size=16).digest()
        h = int.from_bytes(key[:8], "big")
        out.append((h, parent_hash, block))
        parent, parent_hash = key, h
    return out


def make_pool(num_primary: int, num_secondary: int) -> kvx.KVCacheBlockPool:
    return kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=T, dtype=jnp.float32,
                                       num_primary_blocks=num_primary,
                                       num_secondary_blocks=num_secondary, kv_factor=1)


def workload(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing prefixes: a few system prompts, turns that extend earlier ones."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, 50, 2 * T + 1)) for _ in range(3)]
    prompts, chats = [], []
    for _ in range(n):
        base = chats[rng.integers(len(chats))] if chats and rng.random() < 0.5 else []
        if not base or len(base) > 4 * T:
            base = systems[rng.integers(len(systems))]
        prompt = [int(t) for t in base] + [int(t) for t in rng.integers(0, 50, rng.integers(1, 7))]
        prompts.append(prompt)
        chats.append(prompt)
    return prompts


def receive(sub, until_quiet: float = 1.0) -> list[tuple[bytes, int, bytes]]:
    """Every message until none arrives for `until_quiet` seconds."""
    out = []
    while sub.poll(int(until_quiet * 1000)):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER socket (a REQ socket's framing, all replies)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def subscriber(endpoint: str, topic: str = "kv-events", rcvhwm: int | None = None):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher (what it misses, replay brings)
    return sub


def test_events_match_the_block_managers_view(tmp_path):
    """A serving run over GPU, host and disk: the router's view rebuilt from the decoded
    events equals, per medium, the full blocks the block manager and the store hold."""
    pool = make_pool(8, 6)
    store = FileStore(tmp_path, namespace="events-test")
    with kv_events.KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                    data_parallel_rank=3) as pub:
        sub = subscriber(pub.endpoint)
        bm = BlockManager(pool, stores=[store], events=pub)
        prompts = workload(0, 60)
        known: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        for i, prompt in enumerate(prompts):
            for h, parent, block in chain_hashes(prompt):
                known[h] = (parent, block)
            bm.add_sequence(i, prompt)
            bm.sync_transfers()
            bm.append_tokens(i, [7, 8, 9])
            bm.sync_transfers()
            bm.release_sequence(i)
            for h, parent, block in chain_hashes(prompt + [7, 8, 9]):
                known[h] = (parent, block)
        bm.close()
        messages = receive(sub)
        sent = pub.sent_batches
        assert pub.dropped_batches == 0
        assert messages, "no event received"
        seqs = [s for _, s, _ in messages]
        assert all(topic == b"kv-events" for topic, _, _ in messages)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap without a drop"
        payloads = {s: p for _, s, p in messages}
        if seqs[0] > 0:  # the subscription was late: the replay socket has the first ones
            early = replay(pub.replay_endpoint, 0)
            assert [s for s, _ in early][:seqs[0]] == list(range(seqs[0]))
            for s, p in early:
                assert payloads.setdefault(s, p) == p
        assert sorted(payloads) == list(range(sent)), (sorted(payloads)[-3:], sent)
        sub.close()

    views: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set()}
    stored = removed = 0
    for i, s in enumerate(sorted(payloads)):
        raw = msgspec.msgpack.decode(payloads[s])  # the array form itself
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 3, raw
        assert all(isinstance(e, list) and isinstance(e[0], str) for e in raw[1]), raw[1]
        batch = DECODER.decode(payloads[s])
        assert batch.data_parallel_rank == 3 and batch.ts > 0
        if i == 0:
            assert isinstance(batch.events[0], AllBlocksCleared)
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                for v in views.values():
                    v.clear()
            elif isinstance(ev, BlockStored):
                stored += len(ev.block_hashes)
                assert ev.block_size == T and ev.lora_id is None and ev.lora_name is None
                assert len(ev.token_ids) == T * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for j, h in enumerate(ev.block_hashes):  # a chain: hashes match the tokens
                    assert known[h] == (parent, tuple(ev.token_ids[j * T:(j + 1) * T])), h
                    parent = h
                views[ev.medium].update(ev.block_hashes)
            else:
                removed += len(ev.block_hashes)
                assert set(ev.block_hashes) <= views[ev.medium], "removed what was not stored"
                views[ev.medium].difference_update(ev.block_hashes)
    assert stored and removed
    for medium, primary in (("GPU", True), ("CPU", False)):
        held = {kv_events.block_hash64(key) for key, tokens in bm.cached_blocks(primary)
                if len(tokens) == T}
        assert views[medium] == held, medium
        assert held, medium
    on_disk = set()
    for h, (parent, block) in known.items():  # the store's own view, key by key
        chain, key = [], bytes(16)
        while True:  # rebuild the key from the root down
            chain.append(block)
            if parent is None:
                break
            parent, block = known[parent]
        for b in reversed(chain):
            key = hashlib.blake2b(key + np.asarray(b, "<i8").tobytes(), digest_size=16).digest()
        if store.lookup([key]):
            on_disk.add(h)
    assert views["DISK"] == on_disk and on_disk
    store.close()


def test_replay_returns_the_missed_batches_from_a_bounded_buffer():
    with kv_events.KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                    buffer_steps=4) as pub:
        key = bytes(range(16))
        for i in range(10):  # nobody subscribed: every batch is missed
            assert pub.publish([(kv_events.REMOVED, "CPU", key)], ts=float(i)) == i
        deadline = time.monotonic() + 10
        while pub.sent_batches < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = replay(pub.replay_endpoint, 3)
        assert [s for s, _ in got] == [6, 7, 8, 9]  # the newest 4 from 3 on
        for s, payload in got:
            batch = DECODER.decode(payload)
            assert batch.ts == float(s)
            assert batch.events == [BlockRemoved([kv_events.block_hash64(key)], "CPU")]
        assert [s for s, _ in replay(pub.replay_endpoint, 8)] == [8, 9]
        assert replay(pub.replay_endpoint, 10) == []


def test_a_slow_subscriber_and_a_full_queue_show_as_gaps_and_never_block():
    tokens = tuple(range(10_000))  # ~30 KB a batch
    ev = [(kv_events.STORED, "GPU", bytes(16), None, tokens, len(tokens))]
    # a subscriber that does not read, high-water marks of 1 message
    with kv_events.KVEventPublisher("tcp://127.0.0.1:*", hwm=1) as pub:
        sub = subscriber(pub.endpoint, rcvhwm=1)
        t0 = time.perf_counter()
        seqs = []
        for _ in range(600):
            seqs.append(pub.publish(ev))
            if len(seqs) % 50 == 0:
                time.sleep(0.02)  # the publisher's thread keeps up with the queue
        publish_s = time.perf_counter() - t0 - 12 * 0.02
        deadline = time.monotonic() + 30
        while pub.sent_batches + pub.dropped_batches < 600 and time.monotonic() < deadline:
            time.sleep(0.02)
        got = [s for _, s, _ in receive(sub, 0.5)]
        sub.close()
    assert publish_s < 0.5, publish_s  # 600 publishes, never waiting for the subscriber
    assert got == sorted(got) and len(got) < 400, len(got)  # the PUB socket dropped
    assert any(b - a > 1 for a, b in itertools.pairwise(got)), "no gap in the sequence numbers"

    # a queue of 1 batch: publish drops (and counts) instead of waiting; numbers skip
    with kv_events.KVEventPublisher("tcp://127.0.0.1:*", max_queue_size=1) as pub:
        sub = subscriber(pub.endpoint)
        t0 = time.perf_counter()
        seqs = [pub.publish(ev) for _ in range(300)]
        publish_s = time.perf_counter() - t0
        ok = [s for s in seqs if s >= 0]
        assert pub.dropped_batches == seqs.count(-1) > 0
        deadline = time.monotonic() + 30
        while pub.sent_batches < len(ok) and time.monotonic() < deadline:
            time.sleep(0.02)
        ok.append(pub.publish(ev))  # the queue is empty again: the next number is 300
        got = [s for _, s, _ in receive(sub, 0.5)]
        sub.close()
    assert publish_s < 0.5, publish_s
    assert got == ok and got[-1] == 300 and len(got) < 300  # the queued ones; numbers skipped


def test_the_wire_format_of_each_event():
    """The array form, field by field (Dynamo's decoder reads them by position)."""
    with kv_events.KVEventPublisher("tcp://127.0.0.1:*") as pub:
        k1, k2, k3 = bytes([1] * 16), bytes([2] * 16), bytes([3] * 16)
        payload = pub.encode(12.5, [
            (kv_events.CLEARED,),
            (kv_events.STORED, "GPU", k1, None, (1, 2, 3, 4), 4),
            (kv_events.STORED, "GPU", k2, k1, (5, 6, 7, 8), 4),  # continues the chain: merged
            (kv_events.STORED, "GPU", k3, k1, (9, 9, 9, 9), 4),  # a sibling: a new event
            (kv_events.REMOVED, "CPU", k1), (kv_events.REMOVED, "CPU", k2)])
    h1, h2, h3 = (int.from_bytes(k[:8], "big") for k in (k1, k2, k3))
    assert msgspec.msgpack.decode(payload) == [12.5, [
        ["AllBlocksCleared"],
        ["BlockStored", [h1, h2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
        ["BlockStored", [h3], h1, [9, 9, 9, 9], 4, None, "GPU", None],
        ["BlockRemoved", [h1, h2], "CPU"]], 0]
    ours = msgspec.msgpack.Decoder(type=kv_events.wire_types()["KVEventBatch"]).decode(payload)
    assert msgspec.msgpack.encode(ours) == payload  # the library's structs decode it too


def test_nothing_is_imported_without_events_or_metrics():
    code = textwrap.dedent("""
        import sys
        import jax.numpy as jnp
        import jax_kvxfer as kvx
        pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
            tokens_per_block=4, dtype=jnp.float32, num_primary_blocks=4,
            num_secondary_blocks=4)
        bm = kvx.BlockManager(pool)
        bm.add_sequence(0, list(range(9)))
        bm.sync_transfers()
        bm.release_sequence(0)
        bm.get_and_reset_stats()
        bm.transfer_manager.get_and_reset_transfer_stats()
        assert bm.metrics_label is None and bm.transfer_manager.metrics_label is None
        print(sorted(m for m in ("zmq", "msgspec", "prometheus_client") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
