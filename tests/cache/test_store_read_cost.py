"""The block manager reads a store only where the read is expected to land before recomputing
its blocks would (docs/stores.md, "When a store is read"): over real FileStores (one whose
reads take a known extra time), every reused position checked against what the model wrote
there; the read-time estimate against reads of a known speed."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import SlowFileStore  # tests/, on the path under pytest
from test_block_manager_stores import (  # tests/cache, on the path under pytest
    MAX_LEN,
    T,
    make_pool,
    serve,
    serve_then_push_to_disk,
    workload,
)

from jax_kvxfer.cache import BlockManager
from jax_kvxfer.connector.tiers import MIN_READS, READ_PROBE_EVERY, ReadRate, read_rate
from jax_kvxfer.observe import metrics
from jax_kvxfer.stores import FileStore

FULL = (MAX_LEN - 1) // T  # full blocks a MAX_LEN prompt reuses at most


def on_disk_only(path, rng, prompts) -> None:
    """Serves each prompt, then pushes its blocks out of the GPU and the host pool to the
    disk: afterwards only the disk holds them."""
    store = FileStore(path, namespace="m")
    pool = make_pool(4, 2)
    bm = BlockManager(pool, stores=[store])
    for prompt in prompts:
        serve_then_push_to_disk(bm, pool, rng, prompt)
    bm.close()
    store.close()


def random_prompt(rng, n: int = MAX_LEN) -> list[int]:
    return list(map(int, rng.integers(0, 50, n)))


def scraped(name: str, manager: str) -> float:
    import prometheus_client

    text = prometheus_client.generate_latest(metrics.registry()).decode()
    line = rf'^kvxfer:{name}{{manager="{re.escape(manager)}"}} (\S+)$'
    found = re.search(line, text, re.MULTILINE)
    assert found, f"{name} for {manager} not in the scrape"
    return float(found.group(1))


def test_reads_that_would_take_longer_are_not_made_and_reads_that_win_are(tmp_path):
    """Prompts only the disk holds, a prior of one block a second and 1 ms a token: nothing
    is read, every token is computed (a prefix the GPU holds still reused); at 10 s a token
    the same blocks are read as without a cost."""
    rng = np.random.default_rng(1)
    a, b = random_prompt(rng), random_prompt(rng)
    on_disk_only(tmp_path, rng, [a, b])
    store = FileStore(tmp_path, namespace="m")  # no read of it measured yet
    pool = make_pool(4, FULL)
    row = pool.block_nbytes  # one pool: a host row is one block of it
    bm = BlockManager(pool, stores=[store], recompute_s_per_token=1e-3,
                      store_read_prior=(row, 0.0), metrics=True, name="read-cost")
    assert bm.match_prefix(b).store_skipped_blocks == FULL
    match = bm.match_prefix(a)
    assert (match.num_tokens, match.store_blocks, match.store_skipped_blocks) == (0, 0, FULL)
    assert bm.prefetch(a) == 0 and not bm.prefetch_pending(a)
    assert serve(bm, pool, "head", a[:T + 1]) == 0  # block 0 computed, now on the GPU
    assert serve(bm, pool, "a", a) == T  # block 0 reused; blocks 1.. recomputed, not read
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.read_bytes) == (0, 0, 0)
    assert read_rate(store).reads == 0
    got = bm.stats
    assert (got.store_hit_blocks, got.store_skipped_blocks) == (0, 1 + 2)  # head, then a
    assert scraped("store_skipped_blocks_total", bm.metrics_label) == FULL

    bm.set_recompute_cost(10.0)  # 40 s a block to recompute against 1 s to read: read
    match = bm.match_prefix(b)
    assert (match.num_tokens, match.store_blocks, match.store_skipped_blocks) == (
        FULL * T, FULL, 0)
    assert serve(bm, pool, "b", b) == FULL * T  # serve() checks every reused position
    assert bm.stats.store_hit_blocks == FULL and store.stats().hits == FULL
    assert read_rate(store).reads == 1  # the one read, timed
    bm.close()
    store.close()


def test_without_a_cost_every_store_block_is_read(tmp_path):
    """recompute_s_per_token=None (the default), a prior that says reads are slow: read."""
    rng = np.random.default_rng(2)
    a = random_prompt(rng)
    on_disk_only(tmp_path, rng, [a])
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, FULL)
    bm = BlockManager(pool, stores=[store], store_read_prior=(1.0, 100.0))
    assert bm.match_prefix(a).store_skipped_blocks == 0
    assert serve(bm, pool, "a", a) == FULL * T
    assert bm.stats.store_hit_blocks == FULL and bm.stats.store_skipped_blocks == 0
    bm.close()
    store.close()


def test_a_read_that_loses_is_made_where_the_blocks_after_it_pay(tmp_path):
    """Block 0 only on the disk, blocks 1-2 on the GPU and the last 3 tokens in the host pool:
    a read of block 0 that takes 1.5x its recompute is made (the 11 tokens after it are
    reused); one that takes 20x is not, and the whole prompt is computed."""
    rng = np.random.default_rng(7)
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(6, 1)
    # a prior of one block a second: a read of block 0 takes 1 s
    bm = BlockManager(pool, stores=[store], store_read_prior=(pool.block_nbytes, 0.0))
    prompt = random_prompt(rng)
    serve(bm, pool, "p", prompt)  # priority 35
    bm.add_sequence("head", prompt[:T + 1], priority=31)  # block 0 evicted first
    bm.sync_transfers()
    bm.release_sequence("head")
    for i in range(2):
        bm.add_sequence(i, random_prompt(rng, 2 * T), priority=90)
        bm.sync_transfers()
        bm.release_sequence(i)
    bm.flush()
    match = bm.match_prefix(prompt)
    assert (match.store_blocks, match.primary_blocks, match.num_tokens) == (1, 2, MAX_LEN - 1)
    bm.set_recompute_cost(1 / (1.5 * T))  # 1 s = 1.5x block 0's recompute: 11 tokens pay
    match = bm.match_prefix(prompt)
    assert (match.store_blocks, match.num_tokens, match.store_skipped_blocks) == (
        1, MAX_LEN - 1, 0)
    bm.set_recompute_cost(1 / (20 * T))  # 1 s = 20x block 0's recompute: 11 tokens do not pay
    match = bm.match_prefix(prompt)
    assert (match.store_blocks, match.num_tokens, match.store_skipped_blocks) == (0, 0, 1)
    assert serve(bm, pool, "again", prompt) == 0
    assert store.stats().hits == 0 and bm.stats.store_skipped_blocks == 1
    bm.close()
    store.close()


def test_a_partly_filled_block_from_a_store_is_read_only_where_it_pays(tmp_path):
    """Two full blocks and 3 tokens of a reply's tail, all only on the disk; a read of a
    block takes 1 s, a token 0.3 s to compute: the two full blocks (2.4 s) are read, the
    partial one (0.9 s) is not."""
    rng = np.random.default_rng(4)
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, 2)
    bm = BlockManager(pool, stores=[store], store_read_prior=(pool.block_nbytes, 0.0))
    history = random_prompt(rng, 2 * T + 3)
    serve(bm, pool, "turn 1", history)
    for i in range(4):
        serve(bm, pool, i, list(map(int, rng.integers(50, 99, MAX_LEN))))
    bm.flush()
    turn2 = history + random_prompt(rng, 5)
    assert bm.match_prefix(turn2).partial_from_store
    bm.set_recompute_cost(0.3)
    match = bm.match_prefix(turn2)
    assert (match.num_tokens, match.store_blocks, match.partial_from_store,
            match.store_skipped_blocks) == (2 * T, 2, False, 1)
    assert serve(bm, pool, "turn 2", turn2) == 2 * T
    assert bm.stats.store_hit_blocks == 2
    bm.close()
    store.close()


def test_the_read_time_follows_measured_reads_and_the_rule_follows_it(tmp_path):
    """Reads 30 ms + 20 ms a block slower than the disk: the first MIN_READS reads are made
    at a recompute cost that makes them lose (nothing measured, no prior), then no more; the
    estimate gives back the latency and the rate; the rule reads at a cost where they win,
    whatever the prior says."""
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng) for _ in range(3)]
    on_disk_only(tmp_path, rng, prompts)
    latency, per_block = 0.03, 0.02
    store = SlowFileStore(tmp_path, namespace="m", latency=latency, per_block=per_block)
    rate = read_rate(store)

    def serve_fresh(prompt, cost, prior=None):
        """Serves `prompt` on fresh pools over the store (nothing cached but the disk)."""
        pool = make_pool(4, FULL)
        bm = BlockManager(pool, stores=[store], recompute_s_per_token=cost,
                          store_read_prior=prior)
        reused = serve(bm, pool, "p", prompt)
        stats = bm.stats
        bm.close()
        return reused, stats, pool.block_nbytes

    slow = 0.002  # 8 ms a block to recompute: reads of 50-90 ms lose
    for k, prompt in zip((1, 2, 3), prompts):
        reused, stats, row = serve_fresh(prompt[:k * T + 1], slow)
        assert (reused, stats.store_hit_blocks) == (k * T, k), "read while not measured"
    assert rate.reads == MIN_READS == 3
    reused, stats, _ = serve_fresh(prompts[0], slow)
    assert (reused, stats.store_hit_blocks, stats.store_skipped_blocks) == (0, 0, FULL)
    for k, prompt in zip((3, 1, 2, 3, 1, 2), prompts * 2):  # more reads of each size
        assert serve_fresh(prompt[:k * T + 1], None)[0] == k * T
    for k in (1, 3):  # the sleeps are lower bounds; the disk and a loaded machine add to them
        want = latency + k * per_block
        assert 0.9 * want <= rate.seconds(k * row) <= 2 * want, (k, rate.estimate())
    fast = 0.02  # 80 ms a block to recompute: a read of 1-3 blocks takes 50-90 ms
    reused, stats, _ = serve_fresh(prompts[1], fast, prior=(1.0, 1e3))  # measured: no prior
    assert (reused, stats.store_hit_blocks) == (FULL * T, FULL)
    reused, stats, _ = serve_fresh(prompts[2], slow, prior=(1e15, 0.0))
    assert (reused, stats.store_skipped_blocks) == (0, FULL)
    store.close()


def test_read_rate_fits_latency_and_throughput():
    """Against reads of known parameters: an exact fit of reads of several sizes; reads of
    one size answer for another size with the shorter extreme; a fit that noise bends keeps
    the mean read's time; the fit follows a store that becomes slower."""
    rate = ReadRate()
    for _ in range(MIN_READS - 1):
        rate.add(1 << 20, 0.01)
    assert rate.estimate() is None and rate.seconds(1 << 20) is None  # not measured enough
    rate = ReadRate()
    for nbytes in (1 << 20, 4 << 20, 2 << 20, 8 << 20, 3 << 20):
        rate.add(nbytes, 2e-4 + nbytes / 1e9)
    throughput, latency = rate.estimate()
    assert throughput == pytest.approx(1e9, rel=1e-6)
    assert latency == pytest.approx(2e-4, rel=1e-6)
    assert rate.seconds(16 << 20) == pytest.approx(2e-4 + (16 << 20) / 1e9, rel=1e-6)
    rate = ReadRate()
    for _ in range(5):
        rate.add(2 << 20, 4e-3)
    assert rate.estimate() is None  # latency and rate not told apart
    assert rate.seconds(2 << 20) == pytest.approx(4e-3)
    assert rate.seconds(4 << 20) == pytest.approx(4e-3)  # all latency, at most
    assert rate.seconds(1 << 20) == pytest.approx(2e-3)  # no latency, at least
    for _ in range(200):  # 4x slower from now on, reads of two sizes: the old reads fade
        for nbytes in (1 << 20, 3 << 20):
            rate.add(nbytes, 2e-4 + nbytes / 0.25e9)
    throughput, latency = rate.estimate()
    assert throughput == pytest.approx(0.25e9, rel=1e-3)
    assert latency == pytest.approx(2e-4, rel=1e-2)
    for times, line in (((5e-3, 4e-3, 3e-3), (math.inf, 4e-3)),  # bigger reads faster
                        ((1e-3, 3e-3, 6e-3), ((6 << 20) / 10e-3, 0.0))):  # latency < 0
        rate = ReadRate(decay=1.0)
        for nbytes, seconds in zip((1 << 20, 2 << 20, 3 << 20), times):
            rate.add(nbytes, seconds)
        assert rate.estimate() == pytest.approx(line)  # through the mean read


def test_read_rate_counts_the_bytes_a_read_waited_behind():
    """A store that serves one read at a time, at `service` seconds a block and no latency,
    given a burst of reads at once (each waits for those before it): the estimate for a read
    started alone afterwards is one block's service, not the burst's mean wait (16.5 of them
    for 32 reads); a read started behind reads in flight waits for them too; a read that did
    not run measures nothing."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    row, service = int(rng.integers(1, 64)) << 16, float(rng.uniform(1e-4, 1e-2))
    rate = ReadRate(decay=1.0)
    for burst in (32, 7):
        aheads = [rate.begin(row) for _ in range(burst)]
        assert rate.in_flight_bytes == burst * row
        for i, ahead in enumerate(aheads):  # served in order: read i ends at (i + 1) services
            rate.end(row, (i + 1) * service, ahead)
    assert rate.in_flight_bytes == 0 and rate.reads == 39
    assert rate.seconds(row) == pytest.approx(service, rel=1e-6)
    assert rate.seconds(3 * row) == pytest.approx(3 * service, rel=1e-6)
    in_flight = [rate.begin(row) for _ in range(4)]
    assert rate.seconds(row) == pytest.approx(5 * service, rel=1e-6)  # behind 4 reads
    for ahead in in_flight:
        rate.end(row, None, ahead)  # did not run
    assert (rate.in_flight_bytes, rate.reads) == (0, 39)
    assert rate.seconds(row) == pytest.approx(service, rel=1e-6)
    without = ReadRate(decay=1.0)  # the same reads, their waits not counted
    for i in range(32):
        without.add(row, (i + 1) * service)
    assert without.seconds(row) == pytest.approx(16.5 * service, rel=1e-6)


@pytest.mark.slow
def test_random_requests_with_a_cost_that_reads_some_runs_and_not_others(tmp_path):
    """300 operations over a disk 30 ms + 10 ms a block slower, at 7.5 ms a token (30 ms a
    block): a read of one block loses (40 ms against 30), of two or more wins (50 against 60,
    60 against 90), by margins a busy machine's timing does not cross; and each block adds
    enough (10 ms) that the fitted rate stays finite (at 2 ms a block, a loaded machine's
    timing once made bigger reads look no slower). Every reused position holds the right
    value, and both reads and skips happen."""
    rng = np.random.default_rng(6)
    store = SlowFileStore(tmp_path, namespace="m", latency=0.03, per_block=0.01)
    pool = make_pool(6, 3)
    bm = BlockManager(pool, stores=[store], recompute_s_per_token=0.0075)
    requests = workload(rng)
    hits = skipped = 0
    for op in range(300):
        r = rng.random()
        if r < 0.05:
            bm.flush()
        elif r < 0.12:
            bm.prefetch(next(requests))
        else:
            serve(bm, pool, op, next(requests))  # checks every reused position
            stats = bm.get_and_reset_stats()
            hits += stats.store_hit_blocks
            skipped += stats.store_skipped_blocks
    bm.close()
    stats = store.stats()
    store.close()
    assert hits > 5 and skipped > 5, (hits, skipped)
    assert stats.corrupt == 0
    assert math.isfinite(read_rate(store).estimate()[0])


def test_a_store_whose_reads_lose_is_still_read_now_and_then(tmp_path):
    """A prior that says reads lose: of `READ_PROBE_EVERY` prompts that only the store
    holds, the last is read in full (so the store's estimate is measured, not stuck);
    asking (`match_prefix`) neither counts nor probes."""
    rng = np.random.default_rng(8)
    prompts = [random_prompt(rng) for _ in range(READ_PROBE_EVERY)]
    on_disk_only(tmp_path, rng, prompts)
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, FULL)
    bm = BlockManager(pool, stores=[store], recompute_s_per_token=1e-3,
                      store_read_prior=(pool.block_nbytes, 0.0))  # 1 s a block against 4 ms
    for _ in range(2 * READ_PROBE_EVERY):
        assert bm.match_prefix(prompts[-1]).store_skipped_blocks == FULL
    reused = [serve(bm, pool, i, p) for i, p in enumerate(prompts)]  # checks each position
    assert reused == [0] * (READ_PROBE_EVERY - 1) + [FULL * T]
    assert store.stats().hits == FULL and read_rate(store).reads == 1
    assert bm.stats.store_skipped_blocks == (READ_PROBE_EVERY - 1) * FULL
    bm.close()
    store.close()


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-1e-3, ValueError), (math.nan, ValueError), (math.inf, ValueError),
    ("1e-4", TypeError), (True, TypeError)])
def test_a_bad_recompute_cost_is_refused(tmp_path, value, error):
    with pytest.raises(error, match="recompute_s_per_token"):
        BlockManager(make_pool(4, 2), recompute_s_per_token=value)
    bm = BlockManager(make_pool(4, 2), recompute_s_per_token=1e-4)
    with pytest.raises(error, match="recompute_s_per_token"):
        bm.set_recompute_cost(value)
    assert bm.recompute_s_per_token == 1e-4  # unchanged
    bm.set_recompute_cost(None)
    assert bm.recompute_s_per_token is None


@pytest.mark.parametrize("prior, error", [
    ((0, 0), ValueError), ((-1e9, 0), ValueError), ((1e9, -1e-4), ValueError),
    ((1e9, math.inf), ValueError), ((1e9, math.nan), ValueError), ((1e9,), TypeError),
    ("fast", TypeError), ((1e9, None), TypeError), (1e9, TypeError)])
def test_a_bad_read_prior_is_refused(prior, error):
    with pytest.raises(error, match="store_read_prior"):
        BlockManager(make_pool(4, 2), store_read_prior=prior)


def test_the_stores_are_asked_once_a_step(tmp_path):
    """match_prefix then add_sequence in one step: the stores are asked once (their lookups
    counted by the store), and the reused positions are right (serve); after the step
    boundary they are asked again."""
    rng = np.random.default_rng(1)
    a, b = random_prompt(rng), random_prompt(rng)
    on_disk_only(tmp_path, rng, [a, b])
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, FULL)
    bm = BlockManager(pool, stores=[store])
    store.stats()
    assert bm.match_prefix(a).store_blocks == FULL
    asked = store.stats().lookups
    assert asked > 0
    assert bm.match_prefix(a).store_blocks == FULL and store.stats().lookups == 0
    assert serve(bm, pool, "a", a) == FULL * T  # add_sequence: no new question
    # (serve's sync_transfers is the step boundary: its release asks nothing either)
    assert bm.match_prefix(b).store_blocks == FULL and store.stats().lookups > 0
    bm.close()
    store.close()


def test_a_prompt_the_gpu_pool_only_just_holds_is_served_not_refused(tmp_path):
    """A prompt of the GPU pool's 4 blocks whose match holds a GPU block past its first run
    (found with this seed): those blocks would keep slots a short store read could not give
    back, so the first run alone is reused and the rest computed, where add_sequence used to
    raise PoolExhaustedError. Every reused position is checked (serve), and a new block
    manager then finds both prompts' blocks on the disk."""
    rng = np.random.default_rng(9)
    a, b = random_prompt(rng), random_prompt(rng)
    on_disk_only(tmp_path, rng, [a, b])
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(4, FULL)
    bm = BlockManager(pool, stores=[store])
    assert [bm.match_prefix(p).store_blocks for p in (a, b)] == [FULL, FULL]
    assert serve(bm, pool, "b", b) == FULL * T
    bm.close()
    store.close()


def test_a_key_that_names_other_tokens_is_a_miss_not_an_error(tmp_path, monkeypatch):
    """Block keys forced to collide (a key of the parent and the length only): a prompt
    whose first block's key the index holds for other tokens matches nothing, with a store
    asked, and is served computing every token."""
    import hashlib

    from jax_kvxfer.cache import block_cache, block_manager, prefix_match

    def colliding(parent: bytes, tokens) -> bytes:
        return hashlib.blake2b(parent + bytes([len(tokens)]), digest_size=16).digest()

    for module in (block_cache, block_manager, prefix_match):
        monkeypatch.setattr(module, "block_key", colliding)
    rng = np.random.default_rng(10)
    a = random_prompt(rng)
    b = [t + 50 for t in a]  # other tokens, the same keys
    store = FileStore(tmp_path, namespace="m")
    pool = make_pool(8, FULL)
    bm = BlockManager(pool, stores=[store])
    serve(bm, pool, "a", a)
    assert bm.match_prefix(b).num_tokens == 0
    assert serve(bm, pool, "b", b) == 0  # serve checks every reused position: none
    bm.close()
    store.close()


def released_then_written(path, rng, prompts, s_per_token: float, marginal_s: float | None):
    """Serves `prompts` (store_on_release) with a FileStore whose reads were measured at
    `marginal_s` a block (None: not measured); (blocks written, blocks declined)."""
    path.mkdir()
    store = FileStore(path, namespace="m")
    pool = make_pool(len(prompts) * MAX_LEN // T, 8)  # no eviction: only those writes
    row = pool.block_nbytes
    if marginal_s is not None:  # reads of three sizes: `marginal_s` a block, 5 ms latency
        for blocks in (1, 2, 4):
            read_rate(store).add(blocks * row, 0.005 + blocks * marginal_s)
        assert read_rate(store).marginal_seconds(row) == pytest.approx(marginal_s)
    bm = BlockManager(pool, stores=[store], store_on_release=True, metrics=True,
                      recompute_s_per_token=s_per_token)
    for i, prompt in enumerate(prompts):
        serve(bm, pool, i, prompt)
        bm.sync_transfers()
    bm.flush()
    declined = bm.stats.store_declined_blocks
    assert scraped("store_declined_blocks_total", bm.metrics_label) == declined
    written = bm.store_stats()[store.tier].written  # what the scrape took of it too
    bm.close()
    store.close()
    return written, declined


def test_store_on_release_writes_only_blocks_whose_reads_could_pay(tmp_path):
    """The same 60 distinct prompts released four times over fresh stores: without a cost
    and with reads that beat recompute (1 ms a block against 10 ms), every new block is
    written; with reads that lose (1 ms against 0.4 ms), only every READ_PROBE_EVERY-th, the
    rest counted as declined; with reads not yet measured, all again."""
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng) for _ in range(60)]
    every, _ = released_then_written(tmp_path / "a", rng, prompts, None, None)
    assert every >= 2 * READ_PROBE_EVERY  # the reference: every full block of every prompt
    assert released_then_written(tmp_path / "b", rng, prompts, 0.01 / T, 0.001) == (every, 0)
    written, declined = released_then_written(tmp_path / "c", rng, prompts, 0.0004 / T, 0.001)
    assert (written, declined) == (every // READ_PROBE_EVERY, every - every // READ_PROBE_EVERY)
    assert released_then_written(tmp_path / "d", rng, prompts, 0.0004 / T, None) == (every, 0)
