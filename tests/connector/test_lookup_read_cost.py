"""The connector's manager counts a store's blocks only where reading them is expected to beat
recomputing them, once the engine says what a token costs (`set_recompute_cost`): over a real
disk store, blocks written through the host pool and then dropped from it, so that only the
store holds them; read estimates of a known speed, and then of reads measured on a store made
slow by a known delay."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SlowFileStore
from test_offloading_worker import PAGE, engine_arrays, load, make, store

from jax_kvxfer.connector import OffloadingManager, OffloadingWorker
from jax_kvxfer.connector.tiers import MIN_READS, READ_PROBE_EVERY, read_rate


def only_in_store(worker, manager, rng, n: int) -> list[int]:
    """`n` random hashes whose blocks the store holds and the host pool does not."""
    hashes = [int(h) for h in rng.choice(1 << 40, n, replace=False)]
    store(worker, manager, "s", hashes, list(rng.choice(12, n, replace=False)))
    worker.flush()  # the write-through to the store is durable
    manager.remove(hashes)
    assert manager.lookup(hashes) == n  # the store holds them all
    return hashes


def measured(worker, seconds_per_block: float) -> None:
    """The store's reads as if measured: `seconds_per_block` a block, no latency."""
    (store_,) = worker.stores
    for blocks in (1, 2, 4):
        read_rate(store_).add(blocks * store_.row_nbytes, blocks * seconds_per_block)


def test_blocks_only_a_store_holds_are_counted_where_their_read_wins(tmp_path):
    worker, manager, rng = make(tmp_path, 8, with_store=True)
    held = [int(h) for h in rng.choice(1 << 40, 2, replace=False)]  # in the host pool
    store(worker, manager, "h", held, [0, 1])
    stored = only_in_store(worker, manager, rng, 3)
    chain = held + stored
    measured(worker, 1e-3)  # a block reads in 1 ms
    even = 1e-3 / PAGE  # a token's recompute that a read breaks even with
    for cost, counted in ((None, 5), (1.1 * even, 5), (0.9 * even, 2), (even / 10, 2)):
        manager.set_recompute_cost(cost)
        manager.get_and_reset_stats()
        assert manager.lookup(chain) == counted, cost
        stats = manager.get_and_reset_stats()
        assert (stats.found, stats.store_skipped) == (counted, 5 - counted), cost
    # the host pool's blocks are counted whatever the cost
    assert manager.lookup(held) == 2
    worker.close()


def test_one_lookup_in_read_probe_every_reads_all_the_same(tmp_path):
    worker, manager, rng = make(tmp_path, 8, with_store=True)
    stored = only_in_store(worker, manager, rng, 2)
    measured(worker, 1.0)
    manager.set_recompute_cost(1e-9)
    answers = [manager.lookup(stored) for _ in range(2 * READ_PROBE_EVERY)]
    probes = [i for i, n in enumerate(answers) if n]
    assert probes == [READ_PROBE_EVERY - 1, 2 * READ_PROBE_EVERY - 1]
    assert all(answers[i] == 2 for i in probes)
    # a probe's read is measured: it is loaded like any store block
    success, spec = load(worker, manager, "probe", stored, [4, 5])
    assert success and [(r.start, r.stop) for r in spec.store_reads] == [(0, 2)]
    worker.close()


DELAY = 0.05  # seconds each read of the slow store takes more


def test_reads_measured_slow_are_skipped_and_measured_fast_are_made(tmp_path):
    rng = np.random.default_rng()
    store_ = SlowFileStore(tmp_path, namespace="test-model", latency=DELAY)
    worker = OffloadingWorker(engine_arrays(rng), num_host_blocks=8, token_axis=1,
                              stores=[store_])
    manager = OffloadingManager(8, block_size=PAGE, stores=worker.stores)
    stored = only_in_store(worker, manager, rng, 4)
    for i in range(MIN_READS):  # reads of 1, 2 and 3 blocks, each at least DELAY long
        keys = stored[:i + 1]
        assert load(worker, manager, f"l{i}", keys, list(range(4, 5 + i)))[0]
        manager.remove(keys)
    assert read_rate(store_).seconds(store_.row_nbytes) >= DELAY
    manager.set_recompute_cost(1e-6)  # recomputing 4 blocks: 64 µs, against > 50 ms
    assert manager.lookup(stored) == 0
    manager.set_recompute_cost(10.0)  # 40 s a block
    assert manager.lookup(stored) == 4
    worker.close()


@pytest.mark.parametrize("bad, error", [("1", TypeError), (True, TypeError), (0, ValueError),
                                        (-1.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError)])
def test_a_bad_recompute_cost_is_named_and_changes_nothing(tmp_path, bad, error):
    worker, manager, _ = make(tmp_path, 4, with_store=True)
    manager.set_recompute_cost(2.0)
    with pytest.raises(error, match="recompute_s_per_token"):
        manager.set_recompute_cost(bad)
    assert manager.recompute_s_per_token == 2.0
    with pytest.raises(error, match="recompute_s_per_token"):
        OffloadingManager(4, block_size=PAGE, stores=worker.stores, recompute_s_per_token=bad)
    worker.close()
