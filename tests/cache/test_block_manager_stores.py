"""BlockManager over a disk tier (a real FileStore in a temporary directory): blocks offloaded
to the host are written through, a prefix found only on disk is read into host rows and
onboarded, across restarts of the block manager and of the process; every reused position is
checked against what the model wrote there, a value that depends on the whole prefix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer.cache import BlockManager
from jax_kvxfer.connector.tiers import read_rate
from jax_kvxfer.stores import FileStore

T = 4  # tokens per block
MAX_LEN = 4 * T


def value(tokens, pos: int) -> float:
    """What the model writes at `pos`: a function of every token up to it, so that a block
    read back under another prefix's key would show."""
    return float(zlib.crc32(np.asarray(tokens[:pos + 1], np.int64).tobytes()) % 1_000_003)


def make_pool(num_primary: int, num_secondary: int) -> kvx.KVCacheBlockPool:
    return kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=3,
                                       tokens_per_block=T, dtype=jnp.float32,
                                       num_primary_blocks=num_primary,
                                       num_secondary_blocks=num_secondary, kv_factor=1)


@jax.jit
def _write(primary, blocks, offsets, values):
    return primary.at[blocks, 0, 0, :, offsets, :].set(values[:, None, None], mode="drop")


def serve(bm: BlockManager, pool: kvx.KVCacheBlockPool, sid, tokens) -> int:
    """One request: reuse, check every reused position, compute (write) the rest, release."""
    reused = bm.add_sequence(sid, tokens)
    bm.sync_transfers(block=False)
    table = bm.block_table(sid)
    got = kvx.to_numpy(pool.primary)[:, 0, 0, :, :, :]  # [blocks, heads, T, D]
    for pos in range(reused):
        cell = got[table[pos // T], :, pos % T, :]
        assert (cell == value(tokens, pos)).all(), f"{sid}: position {pos} of {reused} reused"
    blocks = np.full(MAX_LEN, pool.num_primary_blocks, np.int32)
    offsets, values = np.zeros(MAX_LEN, np.int32), np.zeros(MAX_LEN, np.float32)
    for j, pos in enumerate(range(reused, len(tokens))):
        blocks[j], offsets[j], values[j] = table[pos // T], pos % T, value(tokens, pos)
    pool.primary = _write(pool.primary, blocks, offsets, values)
    bm.release_sequence(sid)
    return reused


def workload(rng, prefixes: int = 6):
    """Prompts that share a few long prefixes, so blocks come back after they left the GPU
    and the host pool."""
    roots = [list(rng.integers(0, 50, MAX_LEN)) for _ in range(prefixes)]
    while True:
        root = roots[int(rng.integers(len(roots)))]
        keep = int(rng.integers(T, MAX_LEN - T + 1))
        yield [int(t) for t in root[:keep]] + [int(t) for t in
                                                rng.integers(0, 50, int(rng.integers(1, T)))]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_requests_and_restarts_over_a_disk_tier(tmp_path, seed):
    """1,000 operations: requests, prefetches, flushes and restarts of the block manager
    (fresh pools over the same directory); every reused position holds the right value."""
    rng = np.random.default_rng(seed)
    store = FileStore(tmp_path, namespace="test-model")
    pool = make_pool(6, 3)  # the host pool holds 3 blocks: most reuse comes from the disk
    bm = BlockManager(pool, stores=[store])
    requests = workload(rng)
    disk_hits = restarts = 0
    for op in range(1000):
        r = rng.random()
        if r < 0.02:  # a restart: new pools (zeros), new block manager, same directory
            bm.close()
            store.close()
            store = FileStore(tmp_path, namespace="test-model")
            pool = make_pool(6, 3)
            bm = BlockManager(pool, stores=[store])
            restarts += 1
        elif r < 0.06:
            bm.flush()
        elif r < 0.12:
            bm.prefetch(next(requests))
        else:
            serve(bm, pool, op, next(requests))
            disk_hits += bm.get_and_reset_stats().store_hit_blocks
    bm.close()
    stats = store.stats()
    store.close()
    assert restarts and disk_hits > 20, (restarts, disk_hits)
    assert stats.corrupt == 0 and stats.dropped_writes == 0


@pytest.mark.slow
def test_a_prefix_written_by_one_process_is_reused_by_another(tmp_path):
    """Process A serves prompts and flushes; process B, with new pools over the same
    directory, reuses their prefixes from the disk with exact contents."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        import numpy as np
        from test_block_manager_stores import make_pool, serve, BlockManager, FileStore
        rng = np.random.default_rng(5)
        store = FileStore({str(tmp_path)!r}, namespace="test-model")
        pool = make_pool(4, 2)
        bm = BlockManager(pool, stores=[store])
        prompts = [list(map(int, rng.integers(0, 50, {MAX_LEN}))) for _ in range(6)]
        for i, p in enumerate(prompts):
            serve(bm, pool, i, p)
        for i, p in enumerate(prompts):  # evicts every block from the GPU and the host
            serve(bm, pool, 100 + i, list(map(int, rng.integers(50, 99, {MAX_LEN}))))
        bm.close()
        store.close()
        print("written", bm.stats.offloaded_blocks)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 50, MAX_LEN))) for _ in range(6)]
    store = FileStore(tmp_path, namespace="test-model")
    pool = make_pool(8, 4)
    bm = BlockManager(pool, stores=[store])
    reused = [serve(bm, pool, i, p) for i, p in enumerate(prompts)]
    assert all(r >= T for r in reused), reused  # serve() checked every reused position
    assert bm.stats.store_hit_blocks >= len(prompts)
    assert bm.store_stats()["DISK"].hits >= len(prompts)
    bm.close()
    store.close()


def test_another_namespace_does_not_see_the_blocks(tmp_path):
    rng = np.random.default_rng(3)
    prompt = list(map(int, rng.integers(0, 50, MAX_LEN)))
    for namespace, expect_reuse in (("model-a", False), ("model-b", False), ("model-a", True)):
        store = FileStore(tmp_path, namespace=namespace)
        pool = make_pool(4, 2)
        bm = BlockManager(pool, stores=[store])
        reused = serve(bm, pool, 0, prompt)
        assert (reused > 0) == expect_reuse, namespace
        for i in range(4):  # push the prompt's blocks out to the host and through to disk
            serve(bm, pool, 1 + i, list(map(int, rng.integers(50, 99, MAX_LEN))))
        bm.close()
        store.close()


def serve_then_push_to_disk(bm: BlockManager, pool: kvx.KVCacheBlockPool, rng, prompt) -> None:
    """Serves `prompt`, then three other prompts that push its blocks to the host and out to
    the disk, and makes the disk's writes durable: then only the disk holds them."""
    serve(bm, pool, "first", prompt)
    for i in range(3):
        serve(bm, pool, i, list(map(int, rng.integers(50, 99, MAX_LEN))))
    bm.flush()

def test_stores_need_a_host_pool(tmp_path):
    with pytest.raises(ValueError, match="0 secondary blocks"):
        BlockManager(make_pool(4, 0), stores=[FileStore(tmp_path, namespace="m")])
    with pytest.raises(TypeError, match=r"stores\[0\] must be a jax_kvxfer.stores.Store"):
        BlockManager(make_pool(4, 2), stores=[str(tmp_path)])


def test_a_single_store_is_taken_as_a_one_element_list(tmp_path):
    """stores=FileStore(...), not in a list: the same one tier as stores=[store]. A second
    block manager given it that way reads back from the disk what the first one, given a list,
    wrote there."""
    rng = np.random.default_rng(4)
    prompt = list(map(int, rng.integers(0, 50, MAX_LEN)))
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, 2)
    bm = BlockManager(pool, stores=[store])
    serve_then_push_to_disk(bm, pool, rng, prompt)
    bm.close()
    store.close()
    store = FileStore(tmp_path, namespace="m")
    full = (MAX_LEN - 1) // T  # the last token is always computed
    pool = make_pool(4, full)  # a host row for each block read back
    bm = BlockManager(pool, stores=store)
    assert list(bm.store_stats()) == ["DISK"]
    assert serve(bm, pool, "again", prompt) == full * T  # checks every reused position
    assert bm.stats.store_hit_blocks == full
    bm.close()
    store.close()


def test_a_prefetch_is_finished_even_when_a_block_before_it_was_evicted(tmp_path):
    """Prefetch a prompt whose first block the pools hold and whose next ones only the disk
    does; then evict that first block from the GPU and the host. add_sequence reads the first
    block from the disk, takes the prefetched ones, and leaves no prefetch holding host rows."""
    rng = np.random.default_rng(11)
    store = FileStore(tmp_path, namespace="test-model")
    pool = make_pool(4, 2)
    bm = BlockManager(pool, stores=[store])
    prompt = list(map(int, rng.integers(0, 50, MAX_LEN)))
    serve_then_push_to_disk(bm, pool, rng, prompt)
    serve(bm, pool, "head", prompt[:T + 1])  # block 0 back on the GPU, the rest on disk only
    assert bm.prefetch(prompt) > 0
    for i in range(3):  # evicts block 0 again (the prefetch holds its host rows)
        serve(bm, pool, 10 + i, list(map(int, rng.integers(50, 99, MAX_LEN))))
    reused = serve(bm, pool, "again", prompt)  # checks every reused position
    assert reused == MAX_LEN - T  # block 0 read from the disk, then the prefetched blocks
    assert not bm._prefetching
    # every host row is free or holds a reusable block (the rows are the connector's)
    held = {bm._host.host_slot(key) for key in bm._host.eviction_order()}
    assert len(held) + bm.num_free_secondary_blocks == pool.num_secondary_blocks, \
        "a host row stayed held"
    bm.close()
    store.close()


def test_a_partly_filled_block_comes_back_from_the_disk(tmp_path):
    """A chat's next turn repeats the last turn's tokens, whose last block is partly filled
    (the reply's tail). With every block on the disk only, the next prompt reuses the full
    blocks and that partial one too, so no token computed before is computed again."""
    rng = np.random.default_rng(4)
    store = FileStore(tmp_path, namespace="test-model")
    pool = make_pool(4, 2)
    bm = BlockManager(pool, stores=[store])
    history = list(map(int, rng.integers(0, 50, 2 * T + 3)))  # two full blocks and 3 tokens
    serve(bm, pool, "turn 1", history)
    for i in range(4):  # push all of it out of the GPU and the host pool
        serve(bm, pool, i, list(map(int, rng.integers(50, 99, MAX_LEN))))
    bm.flush()
    assert bm.match_prefix(history + [1, 2]).partial_from_store
    reused = serve(bm, pool, "turn 2", history + list(map(int, rng.integers(0, 50, 5))))
    assert reused == len(history)  # serve() checked every reused position's value
    bm.close()
    store.close()



def test_a_prefetch_is_pending_until_its_read_lands(tmp_path):
    """A prompt's blocks only the disk holds; prefetch starts reading them while the disk's
    reads are held. prefetch_pending says so without waiting, stays True while the read is
    held, turns False once it lands, and add_sequence then reuses every full block exactly."""
    from conftest import HeldFileStore  # here: other processes import this module alone

    rng = np.random.default_rng(12)
    store = HeldFileStore(tmp_path, namespace="test-model")
    pool = make_pool(4, 3)  # host rows for the whole prefix
    bm = BlockManager(pool, stores=[store])
    prompt = list(map(int, rng.integers(0, 50, MAX_LEN)))
    serve_then_push_to_disk(bm, pool, rng, prompt)
    full = (MAX_LEN - 1) // T  # the last token is always computed
    assert bm.match_prefix(prompt).store_blocks == full
    assert not bm.prefetch_pending(prompt)  # nothing started
    assert bm.prefetch(prompt) == full * T
    for _ in range(5):
        assert bm.prefetch_pending(prompt), "pending while its read is held"
        time.sleep(0.05)
    rate = read_rate(store)  # a read started now would wait behind the held one's bytes
    assert (rate.in_flight_bytes, rate.reads) == (full * store.row_nbytes, 0)
    assert not bm.prefetch_pending(prompt[T:])  # another prompt (its blocks' keys differ)
    store.release.set()
    t = time.monotonic()
    while bm.prefetch_pending(prompt):
        assert time.monotonic() - t < 30, "the read never landed"
        time.sleep(0.01)
    assert serve(bm, pool, "again", prompt) == full * T  # checks every reused position
    assert bm.store_stats()["DISK"].hits == full
    assert (rate.in_flight_bytes, rate.reads) == (0, 1)
    with pytest.raises(TypeError, match="token_ids"):
        bm.prefetch_pending("abc")
    bm.close()
    store.close()


def check_reused(pool: kvx.KVCacheBlockPool, bm: BlockManager, sid, tokens, reused) -> None:
    got = kvx.to_numpy(pool.primary)[:, 0, 0, :, :, :]
    table = bm.block_table(sid)
    for pos in range(reused):
        cell = got[table[pos // T], :, pos % T, :]
        assert (cell == value(tokens, pos)).all(), f"{sid}: position {pos} of {reused} reused"


def test_a_store_read_short_of_rows_takes_the_rows_queued_loads_give_back(tmp_path):
    """A prompt's blocks only the disk holds, read while the host pool has one row to give
    and three held by the step's queued loads: the read takes that row, then, once the queue
    is issued, the three it gives back; every block lands where its key says."""
    rng = np.random.default_rng(21)
    store = FileStore(tmp_path, namespace="test-model")
    pool = make_pool(8, 4)
    bm = BlockManager(pool, stores=[store])
    b, x1, filler = (list(map(int, rng.integers(0, 50, MAX_LEN))) for _ in range(3))
    serve(bm, pool, "b", b[:13])
    serve(bm, pool, "x1", x1)
    for fillers in (["f1"], ["f2", "f3"]):  # b's blocks to the host, then x1's (b's out)
        for sid in fillers:
            bm.add_sequence(sid, filler)
            bm.sync_transfers()
        for sid in fillers:
            bm.release_sequence(sid, store_for_reuse=False)
    bm.flush()
    assert bm.match_prefix(b[:13]).store_blocks == 3
    assert bm.match_prefix(x1[:13]).secondary_blocks == 3
    reused_a = bm.add_sequence("a", x1[:13])  # three host hits: their loads queued
    reused_b = bm.add_sequence("b2", b[:13])  # one row, then the three the loads give back
    assert (reused_a, reused_b) == (12, 12)
    bm.sync_transfers()
    check_reused(pool, bm, "a", x1[:13], reused_a)
    check_reused(pool, bm, "b2", b[:13], reused_b)
    for sid in ("a", "b2"):
        bm.release_sequence(sid, store_for_reuse=False)
    assert serve(bm, pool, "b3", b[:13]) == 12  # every block under its own key
    bm.close()
    store.close()
