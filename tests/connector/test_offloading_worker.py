"""OffloadingWorker with OffloadingManager over an engine's own per-layer arrays and a real disk
store: every page loaded is compared with a NumPy copy of what the engine held when the block
was stored, on random schedules; failed store reads, and bad input that submits nothing."""

from __future__ import annotations

import glob
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HeldFileStore

import jax_kvxfer as kvx
from jax_kvxfer.connector import LoadSpec, OffloadingManager, OffloadingWorker
from jax_kvxfer.stores import FileStore

PAGES, PAGE, HEADS, DIM, LAYERS = 12, 4, 2, 8, 2


def engine_arrays(rng: np.random.Generator) -> list:
    """NHD K and V of each layer, as eSurge keeps them on a GPU."""
    return [jnp.asarray(rng.standard_normal((PAGES, PAGE, HEADS, DIM)), jnp.bfloat16)
            for _ in range(2 * LAYERS)]


def pages_of(arrays, pages) -> list[np.ndarray]:
    return [kvx.to_numpy(a)[list(pages)] for a in arrays]


def content(block_hash: int, array) -> np.ndarray:
    """One page of K/V that depends on the block's hash only (and on the array's shape)."""
    page = np.random.default_rng(block_hash).standard_normal(array.shape[1:])
    return page.astype(array.dtype)


def make(tmp_path, num_host_blocks: int, with_store: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    (tmp_path / "kv").mkdir(exist_ok=True)
    stores = [FileStore(tmp_path / "kv", namespace="test-model")] if with_store else []
    worker = OffloadingWorker(engine_arrays(rng), num_host_blocks=num_host_blocks,
                              token_axis=1, stores=stores)
    manager = OffloadingManager(num_host_blocks, block_size=PAGE, stores=worker.stores)
    return worker, manager, rng


def store(worker, manager, job, hashes, pages) -> list[int]:
    out = manager.prepare_store(hashes)
    assert out is not None
    chosen = [pages[hashes.index(h)] for h in out.block_hashes_to_store]
    worker.submit_store(job, out.store_spec, chosen)
    worker.wait([job])
    assert worker.get_finished() == [(job, True)]
    manager.complete_store(out.block_hashes_to_store)
    return out.block_hashes_to_store


def load(worker, manager, job, hashes, pages) -> tuple[bool, LoadSpec]:
    spec = manager.prepare_load(hashes)
    worker.submit_load(job, spec, pages)
    worker.wait([job])
    ((got_job, success),) = worker.get_finished()
    assert got_job == job
    manager.complete_load(hashes, success)
    return success, spec


def test_a_block_stored_then_loaded_into_other_pages_is_exact(tmp_path):
    worker, manager, _ = make(tmp_path, 4, with_store=False)
    before = pages_of(worker.kv_caches, [3, 5])
    assert store(worker, manager, "s", [101, 202], [3, 5]) == [101, 202]
    untouched = pages_of(worker.kv_caches, range(PAGES))
    worker.kv_caches = [a * 0 for a in worker.kv_caches]  # the engine reuses every page
    assert manager.lookup([101, 202, 303]) == 2
    success, spec = load(worker, manager, "l", [101, 202], [7, 8])
    assert success and spec.store_reads == ()
    for want, got in zip(before, pages_of(worker.kv_caches, [7, 8])):
        np.testing.assert_array_equal(got, want)
    for i, a in enumerate(worker.kv_caches):  # no other page written
        rest = [p for p in range(PAGES) if p not in (7, 8)]
        assert not kvx.to_numpy(a)[rest].any(), i
    assert untouched  # the arrays before the engine zeroed them were read


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules_through_host_and_disk_are_exact(tmp_path, seed):
    """Blocks stored from random pages, the pages overwritten, blocks evicted from a small host
    pool to the disk store, loaded back into random pages: each equals what was stored."""
    worker, manager, rng = make(tmp_path, 3, with_store=True, seed=seed)
    pick = random.Random(seed)
    truth: dict[int, list[np.ndarray]] = {}  # hash -> the pages' content when stored
    from_store = 0
    for step in range(30):
        pages = pick.sample(range(PAGES), 2)
        hashes = [pick.randrange(1000, 1012), pick.randrange(1012, 1024)]
        # the engine computes a block's K/V, the same for the same hash
        worker.kv_caches = [a.at[np.array(pages)].set(np.stack([content(h, a) for h in hashes]))
                            for a in worker.kv_caches]
        snapshot = pages_of(worker.kv_caches, pages)
        stored = store(worker, manager, f"s{step}", hashes, pages)
        for h in stored:
            truth[h] = [layer[hashes.index(h)] for layer in snapshot]
        worker.flush()  # durable on disk before the host may evict it
        worker.kv_caches = [jnp.asarray(rng.standard_normal(a.shape), a.dtype)
                            for a in worker.kv_caches]
        wanted = pick.sample(sorted(truth), min(2, len(truth)))
        n = manager.lookup(wanted)
        assert n is not None
        if n:
            dst = pick.sample(range(PAGES), n)
            success, spec = load(worker, manager, f"l{step}", wanted[:n], dst)
            assert success
            from_store += spec.num_from_store
            got = pages_of(worker.kv_caches, dst)
            for i, h in enumerate(wanted[:n]):
                for layer, want in zip(got, truth[h]):
                    np.testing.assert_array_equal(layer[i], want)
    assert from_store > 0  # the schedule did read from the disk
    worker.close()


def test_a_corrupt_store_block_fails_the_load_and_writes_no_page(tmp_path):
    worker, manager, _ = make(tmp_path, 1, with_store=True)
    store(worker, manager, "s1", [1], [0])
    store(worker, manager, "s2", [2], [1])  # evicts block 1 from the single host row
    worker.flush()
    assert manager.host_slot(1) is None and manager.lookup([1]) == 1
    paths = glob.glob(os.path.join(tmp_path, "kv", "*", "*", "*.kvb"))
    assert len(paths) == 2
    for path in paths:
        with open(path, "r+b") as f:  # a bit of the payload, after the 4 KiB header block
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0x01]))
    before = pages_of(worker.kv_caches, range(PAGES))
    success, spec = load(worker, manager, "l", [1], [5])
    assert not success and spec.num_from_store == 1
    for want, got in zip(before, pages_of(worker.kv_caches, range(PAGES))):
        np.testing.assert_array_equal(got, want)
    assert manager.host_slot(1) is None  # its row given back
    assert manager.lookup([2]) == 1


@pytest.mark.parametrize("change, error, match", [
    (lambda s, p: (s, p[:1]), ValueError, "holds 1 pages for a spec of 2 blocks"),
    (lambda s, p: (s, [0, PAGES]), IndexError, rf"gpu_pages\[1\] = {PAGES} is out of range"),
    (lambda s, p: (s, [-1, 0]), IndexError, r"gpu_pages\[0\] = -1"),
    (lambda s, p: (s, [[0, 1]]), ValueError, "gpu_pages must be 1-D"),
    (lambda s, p: (s, [0.0, 1.0]), TypeError, "gpu_pages must hold integers"),
    (lambda s, p: (object(), p), TypeError, "store_spec must be a StoreSpec"),
])
def test_bad_store_submissions_are_named_and_submit_nothing(tmp_path, change, error, match):
    worker, manager, _ = make(tmp_path, 4, with_store=False)
    spec = manager.prepare_store([1, 2]).store_spec
    before = pages_of(worker.kv_caches, range(PAGES))
    bad_spec, bad_pages = change(spec, [0, 1])
    with pytest.raises(error, match=match):
        worker.submit_store("job", bad_spec, bad_pages)
    assert worker.get_finished() == []
    worker.submit_store("job", spec, [0, 1])  # the id is still free
    worker.wait(["job"])
    assert worker.get_finished() == [("job", True)]
    for want, got in zip(before, pages_of(worker.kv_caches, range(PAGES))):
        np.testing.assert_array_equal(got, want)


def test_job_ids_and_load_pages_are_checked(tmp_path):
    worker, manager, _ = make(tmp_path, 4, with_store=False)
    store(worker, manager, "s", [1, 2], [0, 1])
    spec = manager.prepare_load([1, 2])
    with pytest.raises(ValueError, match="gpu_pages holds a page twice"):
        worker.submit_load("l", spec, [4, 4])
    with pytest.raises(TypeError, match="load_spec must be a LoadSpec"):
        worker.submit_load("l", manager.prepare_store([3]).store_spec, [4])
    worker.submit_load("l", spec, [4, 5])
    with pytest.raises(ValueError, match="job_id 'l' is in use"):
        worker.submit_load("l", spec, [6, 7])
    with pytest.raises(KeyError, match="are not running"):
        worker.wait(["nope"])
    worker.wait(["l"])
    assert worker.get_finished() == [("l", True)]


def test_the_manager_needs_the_workers_bound_stores(tmp_path):
    unbound = FileStore(tmp_path, namespace="m")
    with pytest.raises(ValueError, match="stores=worker.stores"):
        OffloadingManager(4, block_size=4, stores=[unbound])


def test_a_prefetch_reads_the_store_into_host_rows_only(tmp_path):
    worker, manager, _ = make(tmp_path, 1, with_store=True)
    want = pages_of(worker.kv_caches, [2])
    store(worker, manager, "s1", [1], [2])
    store(worker, manager, "s2", [2], [3])  # evicts block 1 to the disk only
    worker.flush()
    before = pages_of(worker.kv_caches, range(PAGES))
    spec = manager.prepare_load([1])
    assert spec.num_from_store == 1
    worker.submit_load("p", spec, None)
    worker.wait(["p"])
    assert worker.get_finished() == [("p", True)]
    manager.complete_load([1])
    for a, b in zip(before, pages_of(worker.kv_caches, range(PAGES))):  # no page written
        np.testing.assert_array_equal(a, b)
    success, spec = load(worker, manager, "l", [1], [9])  # now a host hit
    assert success and spec.num_from_store == 0
    for a, b in zip(want, pages_of(worker.kv_caches, [9])):
        np.testing.assert_array_equal(a, b)


def test_a_worker_over_pools_made_by_create():
    pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=2, size_per_head=4,
                                       tokens_per_block=PAGE, dtype=jnp.float32,
                                       num_primary_blocks=6, num_secondary_blocks=3)
    rng = np.random.default_rng(5)
    pool.primary = jnp.asarray(rng.standard_normal(pool.primary.shape), jnp.float32)
    worker = OffloadingWorker.over_pools([pool])
    manager = OffloadingManager(3, block_size=PAGE)
    want = kvx.to_numpy(pool.primary)[[1, 4]]
    store(worker, manager, "s", [7, 8], [1, 4])
    success, _ = load(worker, manager, "l", [8, 7], [0, 5])
    assert success
    got = kvx.to_numpy(pool.primary)
    np.testing.assert_array_equal(got[0], want[1])
    np.testing.assert_array_equal(got[5], want[0])
    with pytest.raises(ValueError, match="transfer_manager must move exactly these pools"):
        OffloadingWorker.over_pools([pool], transfer_manager=kvx.KVCacheTransferManager(
            [kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=4,
                                         tokens_per_block=PAGE, dtype=jnp.float32,
                                         num_primary_blocks=6, num_secondary_blocks=3)]))


def test_a_partial_load_copies_the_first_tokens_only(tmp_path):
    """num_tokens: a request reusing the first tokens of a block gets those, and the rest of
    its page stays as it was."""
    worker, manager, _ = make(tmp_path, 4, with_store=False)
    want = pages_of(worker.kv_caches, [3])
    store(worker, manager, "s", [1], [3])
    worker.kv_caches = [a * 0 for a in worker.kv_caches]
    spec = manager.prepare_load([1])
    for bad, error, match in (([2, 2], ValueError, "one count per page"),
                              ([1.5], TypeError, "num_tokens must hold integers"),
                              ([PAGE + 1], ValueError, r"num_tokens\[0\] = 5 is out of range")):
        with pytest.raises(error, match=match):
            worker.submit_load("l", spec, [7], bad)
    worker.submit_load("l", spec, [7], [2])
    worker.wait(["l"])
    assert worker.get_finished() == [("l", True)]
    for layer, got in zip(want, pages_of(worker.kv_caches, [7])):
        np.testing.assert_array_equal(got[0, :2], layer[0, :2])
        assert not got[0, 2:].any()


def test_a_prefetch_holds_up_no_later_job_and_the_stores_answer_beyond_the_rows(tmp_path):
    """A prefetch still reading does not hold up a store submitted after it (its rows are its
    own); lookup_stores counts what the store holds where lookup counts only what has a row."""
    store_ = HeldFileStore(tmp_path, namespace="test-model")
    worker = OffloadingWorker(engine_arrays(np.random.default_rng(0)), num_host_blocks=2,
                              token_axis=1, stores=[store_])
    manager = OffloadingManager(2, block_size=PAGE, stores=worker.stores)
    for job, h in (("s1", 1), ("s2", 2), ("s3", 3)):  # 1 leaves the host for the disk only
        store(worker, manager, job, [h], [h])
    worker.flush()
    assert worker.store_stats()["DISK"].written == 3
    manager.prepare_load([2])  # protects one row; the other one is block 3's
    assert manager.lookup([1], priority=0) == 0 and manager.lookup_stores([1, 2, 9]) == 2
    manager.complete_load([2])
    worker.submit_load("p", manager.prepare_load([1], count_reuse=False), None)  # evicts 2
    out = manager.prepare_store([4])  # evicts 3
    worker.submit_store("s4", out.store_spec, [4])
    worker.wait(["s4"])
    assert worker.get_finished() == [("s4", True)], "the store waited for the prefetch"
    store_.release.set()
    worker.wait(["p"])
    assert worker.get_finished() == [("p", True)]
    manager.complete_load([1])
    manager.complete_store([4])
    assert manager.lookup([1, 4]) == 2
    worker.close()
    store_.close()


@pytest.mark.parametrize("layer_groups", [2, 2 * LAYERS])
def test_a_step_waiting_layer_by_layer_reads_the_loaded_pages(tmp_path, layer_groups):
    """A worker whose loads land in groups of arrays, and an engine step that waits for each
    array before reading it (`kv_caches_by_layer`, `wait_for_layers`): the step reads every
    loaded page (whole, and a partial one's first tokens) as it was stored, and the pages no
    load wrote as the engine left them."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    worker = OffloadingWorker(engine_arrays(rng), num_host_blocks=6, token_axis=1,
                              layer_groups=layer_groups)
    manager = OffloadingManager(6, block_size=PAGE)
    want = pages_of(worker.kv_caches, [2, 4, 9])
    store(worker, manager, "s", [11, 22, 33], [2, 4, 9])
    worker.kv_caches = [jnp.asarray(rng.standard_normal(a.shape), a.dtype)
                        for a in worker.kv_caches]
    left = [kvx.to_numpy(a) for a in worker.kv_caches]
    spec = manager.prepare_load([11, 22, 33])
    worker.submit_load("l", spec, [5, 0, 6], [0, 0, 3])

    @jax.jit
    def step(arrays):
        return [kvx.wait_for_layers(a, i + 1) * 1 for i, a in enumerate(arrays)]

    read = [np.asarray(a) for a in step(worker.kv_caches_by_layer())]
    for layer, (got, stored, before) in enumerate(zip(read, want, left)):
        np.testing.assert_array_equal(got[[5, 0]], stored[:2], err_msg=str(layer))
        np.testing.assert_array_equal(got[6, :3], stored[2, :3], err_msg=str(layer))
        np.testing.assert_array_equal(got[6, 3:], before[6, 3:], err_msg=str(layer))
        rest = [p for p in range(PAGES) if p not in (0, 5, 6)]
        np.testing.assert_array_equal(got[rest], before[rest], err_msg=str(layer))
