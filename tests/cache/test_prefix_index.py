"""The prefix index a router keeps from several block managers' KV events (cache.PrefixIndex),
over real publishers and ZMQ sockets: after random requests on two block managers, what it
says each holds of a prompt matches each block manager's own `match_prefix`; a subscriber that
joins late catches up from the replay socket, or counts what it lost without one."""

from __future__ import annotations

import itertools
import time

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

import jax_kvxfer as kvx
from jax_kvxfer.cache import BlockManager, PrefixIndex
from jax_kvxfer.observe.events import KVEventPublisher

T = 4  # tokens per block


def make_pool(num_primary: int, num_secondary: int) -> kvx.KVCacheBlockPool:
    return kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=T, dtype=jnp.float32,
                                       num_primary_blocks=num_primary,
                                       num_secondary_blocks=num_secondary, kv_factor=1)


def replica(replay: bool = True) -> tuple[BlockManager, KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*" if replay else None)
    return BlockManager(make_pool(8, 6), events=pub), pub


def serve(bm: BlockManager, sid, prompt: list[int]) -> None:
    bm.add_sequence(sid, prompt)
    bm.sync_transfers()
    bm.release_sequence(sid)
    bm.sync_transfers()  # the release's events published


def held_by_each(bms: dict, prompt: list[int]) -> dict:
    """What each block manager's own prefix match finds of the prompt's full blocks."""
    out = {}
    for name, bm in bms.items():
        m = bm.match_prefix(prompt)
        out[name] = m.primary_blocks + m.secondary_blocks
    return out


def agrees(index: PrefixIndex, bms: dict, prompts: list[list[int]],
           timeout_s: float = 10.0) -> None:
    """The index comes to say, for every prompt, what each block manager holds of it (the
    events travel on their own: polled until they agree, or the test fails)."""
    deadline = time.monotonic() + timeout_s
    while True:
        index.poll(0.02)
        want = [held_by_each(bms, p) for p in prompts]
        got = [index.matched_blocks(p) for p in prompts]
        if got == want:
            return
        assert time.monotonic() < deadline, (got, want)


def prompts_sharing_prefixes(rng, n: int) -> list[list[int]]:
    roots = [list(map(int, rng.integers(0, 40, 3 * T))) for _ in range(3)]
    out = []
    for _ in range(n):
        root = roots[int(rng.integers(len(roots)))]
        keep = int(rng.integers(1, len(root) + 1))
        out.append(root[:keep] + list(map(int, rng.integers(0, 40, int(rng.integers(1, 2 * T))))))
    return out


def test_the_index_says_what_each_block_manager_holds():
    """60 requests, each on one of two block managers at random, over pools small enough to
    evict to the host and out of it: after each, for every prompt so far, the index's count
    of full blocks held per block manager equals that block manager's own match."""
    rng = np.random.default_rng(11)
    bms, pubs = {}, []
    for name in ("a", "b"):
        bms[name], pub = replica()
        pubs.append(pub)
    with PrefixIndex(T) as index:
        for name, pub in zip(bms, pubs):
            index.subscribe(name, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        time.sleep(0.2)  # the subscriptions reach the publishers (else: replayed, also fine)
        prompts = prompts_sharing_prefixes(rng, 60)
        for i, prompt in enumerate(prompts):
            serve(bms["ab"[int(rng.integers(2))]], i, prompt)
            agrees(index, bms, prompts[:i + 1])
        assert index.lost_batches == 0
        assert sum(index.held_blocks(n) for n in bms) > 0
    for bm, pub in zip(bms.values(), pubs):
        bm.close()
        pub.close()


def test_a_late_subscriber_catches_up_from_the_replay_or_counts_its_loss():
    """Ten requests published before the index subscribes: with the replay socket it asks for
    them at the first batch it sees and then agrees; without one it counts them as lost."""
    rng = np.random.default_rng(12)
    prompts = prompts_sharing_prefixes(rng, 20)
    for replay in (True, False):
        bm, pub = replica(replay)
        for i, prompt in enumerate(prompts[:10]):
            serve(bm, i, prompt)
        deadline = time.monotonic() + 10
        while pub.sent_batches < 10:  # the publisher's thread has sent them
            assert time.monotonic() < deadline, pub.sent_batches
            time.sleep(0.01)
        before = pub.sent_batches
        with PrefixIndex(T) as index:
            index.subscribe("a", pub.endpoint, replay_endpoint=pub.replay_endpoint)
            served = prompts[:10]
            deadline = time.monotonic() + 20
            for i in itertools.count(10):  # until a batch arrives (the subscription takes
                prompt = prompts[10 + i % 10]  # its time, longer on a busy machine)
                serve(bm, i, prompt)
                served = served + [prompt]
                index.poll(0.2)
                if index.held_blocks("a") or index.lost_batches:
                    break
                assert time.monotonic() < deadline, "no batch reached the index in 20 s"
            if replay:
                agrees(index, {"a": bm}, served)
                assert index.lost_batches == 0
            else:  # lost: every batch before the first it received, at least those before
                # it subscribed. The publisher counts a batch once sent, so the index may
                # receive one before it is counted: wait for the count.
                deadline = time.monotonic() + 10
                while pub.sent_batches <= index.lost_batches:
                    assert time.monotonic() < deadline, (index.lost_batches, pub.sent_batches)
                    time.sleep(0.01)
                assert before <= index.lost_batches < pub.sent_batches
        bm.close()
        pub.close()


def test_what_the_replay_no_longer_holds_is_counted_lost_and_the_rest_applied():
    """A replay buffer of 3 batches, 10 published before the index subscribes: at the next
    live batch (the buffer holds it too) it replays the 2 before it (their blocks held), and
    counts the first 8 lost."""
    from jax_kvxfer.cache.block_cache import ROOT_KEY, block_key
    from jax_kvxfer.observe import events as kv_events

    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                           buffer_steps=3)
    prompts = [[i] * T + [0] for i in range(11)]  # one full block each
    keys = [block_key(ROOT_KEY, p[:T]) for p in prompts]
    for key, p in zip(keys[:10], prompts):
        pub.publish([(kv_events.STORED, kv_events.MEDIUM_GPU, key, None, tuple(p[:T]), T)])
    time.sleep(0.3)
    with PrefixIndex(T) as index:
        index.subscribe("a", pub.endpoint, replay_endpoint=pub.replay_endpoint)
        time.sleep(1.0)  # connected before the one live batch (else it is lost, no gap seen)
        pub.publish([(kv_events.STORED, kv_events.MEDIUM_GPU, keys[10], None,
                      tuple(prompts[10][:T]), T)])
        deadline = time.monotonic() + 10
        while index.held_blocks("a") < 3:
            assert time.monotonic() < deadline, index.held_blocks("a")
            index.poll(0.02)
        assert index.lost_batches == 8
        held = [index.matched_blocks(p)["a"] for p in prompts]
        assert held == [0] * 8 + [1] * 3
    pub.close()


def test_a_restarted_replica_is_followed_anew(tmp_path):
    """A replica's publisher closes and a new one binds the same address (a restarted
    replica, a new block manager): the index forgets the old blocks, counts the restart and
    holds the new ones, those published before it reconnected from the new replay socket."""
    endpoint = f"ipc://{tmp_path}/events"  # bound by the publisher, whichever runs
    replay = f"ipc://{tmp_path}/replay"
    rng = np.random.default_rng(13)
    olds, news = prompts_sharing_prefixes(rng, 20), prompts_sharing_prefixes(rng, 20)
    with PrefixIndex(T) as index:
        pub = KVEventPublisher(endpoint, replay_endpoint=replay)
        bm = BlockManager(make_pool(8, 0), events=pub)
        index.subscribe("a", endpoint, replay_endpoint=replay)
        time.sleep(0.3)
        for i, prompt in enumerate(olds):  # batches enough that a new stream numbers below
            serve(bm, i, prompt)
        agrees(index, {"a": bm}, olds)
        assert sum(index.matched_blocks(p)["a"] for p in olds) > 0
        bm.close()
        pub.close()
        pub = KVEventPublisher(endpoint, replay_endpoint=replay)
        bm = BlockManager(make_pool(8, 0), events=pub)
        for i, prompt in enumerate(news):  # until the SUB socket has reconnected and seen it
            serve(bm, i, prompt)
            index.poll(0.2)
            if index.restarts:
                break
        assert index.restarts == 1, "the restart was not seen"
        agrees(index, {"a": bm}, olds + news)  # the old blocks forgotten, the new ones held
        bm.close()
        pub.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="tokens_per_block must be >= 1, got 0"):
        PrefixIndex(0)
    for bad in ("16", 16.0, True):
        with pytest.raises(TypeError, match="tokens_per_block must be an int"):
            PrefixIndex(bad)
    with pytest.raises(TypeError, match="media"):
        PrefixIndex(T, media="GPU")
    with PrefixIndex(T) as index:
        index.subscribe("a", "tcp://127.0.0.1:1")
        with pytest.raises(KeyError, match="'a'"):
            index.subscribe("a", "tcp://127.0.0.1:1")
