"""Prometheus metrics: a real HTTP scrape of the metrics server, parsed with
prometheus_client.parser, against the statistics the block manager, the transfer manager and
the stores return (summed over every get-and-reset call, as the counters are cumulative)."""

from __future__ import annotations

import dataclasses
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

import jax_kvxfer as kvx
from jax_kvxfer.cache import BlockManager
from jax_kvxfer.observe import metrics
from jax_kvxfer.stores import FileStore, StoreStats

T = 4


def scrape(server) -> dict[tuple[str, tuple], float]:
    """sample name and sorted labels -> value, from a real HTTP GET."""
    with urllib.request.urlopen(server.url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, manager: str, **labels) -> float:
    return samples[(name, tuple(sorted({"manager": manager, **labels}.items())))]


def add(total: dict, stats) -> None:
    for f in dataclasses.fields(stats):
        total[f.name] = total.get(f.name, 0) + getattr(stats, f.name)


def test_a_scrape_matches_the_statistics(tmp_path):
    server = metrics.start_metrics_server(0)
    try:
        pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                           tokens_per_block=T, dtype=jnp.float32,
                                           num_primary_blocks=8, num_secondary_blocks=5)
        store = FileStore(tmp_path, namespace="metrics-test")
        bm = BlockManager(pool, stores=[store])  # made after the server: it reports
        tm = bm.transfer_manager
        assert bm.metrics_label is not None and tm.metrics_label is not None
        rng = np.random.default_rng(1)
        systems = [list(map(int, rng.integers(0, 40, 2 * T + 1))) for _ in range(4)]
        block_total, transfer_total, store_total = {}, {}, {}
        for i in range(60):
            prompt = systems[i % 4] + list(map(int, rng.integers(0, 40, rng.integers(1, 9))))
            bm.add_sequence(i, prompt, priority=int(rng.choice([20, 35, 60])))
            bm.sync_transfers()
            bm.release_sequence(i)
            if i % 7 == 3:  # the user resets; the counters keep counting
                add(block_total, bm.get_and_reset_stats())
                add(transfer_total, tm.get_and_reset_transfer_stats())
            if i % 11 == 5:
                scrape(server)  # takes the stores' statistics; store_stats() still has them
            if i % 13 == 7:
                for stats in bm.store_stats().values():
                    add(store_total, stats)
        bm.close()
        add(transfer_total, tm.get_and_reset_transfer_stats())
        add(block_total, bm.stats)  # the live part, not reset
        for stats in bm.store_stats().values():
            add(store_total, stats)
        got = scrape(server)
    finally:
        server.close()
    b, t = bm.metrics_label, tm.metrics_label
    assert block_total["onboarded_blocks"] and block_total["offloaded_blocks"]
    assert block_total["store_hit_blocks"] and block_total["dropped_secondary_blocks"]
    assert store_total["written"] and store_total["hits"]

    def check(name, expected, manager=b, **labels):
        assert value(got, "kvxfer:" + name, manager, **labels) == pytest.approx(expected), name

    check("prefix_cache_queries_total", block_total["prompt_tokens"])
    check("prefix_cache_hits_total", block_total["reused_tokens"])
    check("transfer_issue_seconds_total", block_total["transfer_seconds"])
    check("prefix_cache_hit_blocks_total", block_total["reused_blocks"], tier="GPU")
    check("prefix_cache_hit_blocks_total",
          block_total["onboarded_blocks"] - block_total["store_hit_blocks"], tier="CPU")
    check("prefix_cache_hit_blocks_total", block_total["store_hit_blocks"], tier="STORE")
    check("partial_reuse_blocks_total", block_total["partial_copies"], source="GPU")
    check("partial_reuse_blocks_total", block_total["partial_onboards"], source="CPU")
    check("evicted_blocks_total", block_total["offloaded_blocks"], tier="GPU",
          outcome="offloaded")
    check("evicted_blocks_total", block_total["dropped_primary_blocks"], tier="GPU",
          outcome="dropped")
    check("evicted_blocks_total", block_total["dropped_secondary_blocks"], tier="CPU",
          outcome="dropped")
    for field in (f.name for f in dataclasses.fields(StoreStats)):
        name = {"lookups": "store_lookups", "hits": "store_hits", "misses": "store_misses",
                "corrupt": "store_corrupt_blocks", "written": "store_written_blocks",
                "dropped_writes": "store_dropped_writes", "evicted": "store_evicted_blocks"
                }.get(field, f"store_{field}")
        check(name + "_total", store_total[field], tier="DISK")
    for ttype, kind in (("GPU_to_CPU", "offloaded"), ("CPU_to_GPU", "onboarded"),
                        ("GPU_to_GPU", "copied")):
        check("kv_transfer_blocks_total", transfer_total[f"{kind}_blocks"], t,
              transfer_type=ttype)
        check("kv_transfer_bytes_total", transfer_total[f"{kind}_bytes"], t,
              transfer_type=ttype)
    check("exposed_transfer_seconds_total", transfer_total["exposed_seconds"], t)
    assert transfer_total["offloaded_bytes"] == transfer_total["offloaded_blocks"] * \
        pool.block_nbytes
    free = bm.num_free_primary_blocks
    check("kv_cache_usage_perc", (8 - free) / 8, tier="GPU")
    check("free_blocks", free, tier="GPU")
    check("free_blocks", bm.num_free_secondary_blocks, tier="CPU")
    check("reusable_blocks", len(bm.reusable_blocks(True)), tier="GPU")
    check("reusable_blocks", len(bm.reusable_blocks(False)), tier="CPU")
    check("store_used_bytes", store.used_bytes, tier="DISK")
    store.close()


def test_metrics_false_does_not_report_and_true_does():
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=T, dtype=jnp.float32,
                                       num_primary_blocks=4, num_secondary_blocks=0)
    assert BlockManager(pool, metrics=False).metrics_label is None
    bm = BlockManager(pool, metrics=True)
    assert bm.metrics_label is not None and bm.transfer_manager.metrics_label is not None
    text = prometheus_client.generate_latest(metrics.registry()).decode()
    assert f'kvxfer:prefix_cache_queries_total{{manager="{bm.metrics_label}"}} 0.0' in text


def test_named_managers_count_their_own_transfers_once():
    """Two block managers named as the demo names its runs: each one's counters under its name,
    its transfer manager's too, from the block manager's making (a warm-up's transfers before
    it, counted here, are not in them). Each transfer counter is the blocks the block manager
    moved for the events it counts: GPU_to_CPU the evicted blocks it offloaded, CPU_to_GPU the
    blocks onboarded plus the partial blocks copied from the host, GPU_to_GPU the partial
    blocks copied on the GPU."""
    server = metrics.start_metrics_server(0)
    rng = np.random.default_rng(7)
    try:
        runs, warm = {}, {}
        for name, secondary in (("offload", 12), ("drop", 0)):
            pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                               tokens_per_block=T, dtype=jnp.float32,
                                               num_primary_blocks=12,
                                               num_secondary_blocks=secondary)
            tm = kvx.KVCacheTransferManager(pool)
            n = int(rng.integers(1, 4))  # a warm-up: copies on the GPU (and offloads)
            tm.onboard_blocks([(kvx.KVCacheBlock(0, i, True), kvx.KVCacheBlock(0, 4 + i, True))
                               for i in range(n)], 1)
            if secondary:
                tm.offload_blocks([(kvx.KVCacheBlock(0, i, True),
                                    kvx.KVCacheBlock(0, i, False)) for i in range(n)])
            tm.sync_transfers()
            warm[name] = tm.get_and_reset_transfer_stats()
            assert warm[name].copied_blocks == n
            bm = BlockManager(pool, transfer_manager=tm, name=name)
            assert bm.metrics_label == name == tm.metrics_label
            systems = [list(map(int, rng.integers(0, 40, 2 * T + 2))) for _ in range(4)]
            for i in range(50):
                tail = list(map(int, rng.integers(0, 40, rng.integers(0, 9))))
                bm.add_sequence(i, systems[i % 4] + tail, priority=60)
                bm.sync_transfers()
                bm.release_sequence(i)
            bm.sync_transfers()
            runs[name] = (bm, tm.get_and_reset_transfer_stats())
        again = BlockManager(runs["drop"][0].transfer_manager.pools[0], name="drop")
        assert again.metrics_label == "drop#2"
        got = scrape(server)
    finally:
        server.close()
    for name, (bm, moved) in runs.items():
        s = bm.stats
        expected = {"GPU_to_CPU": s.offloaded_blocks,
                    "CPU_to_GPU": s.onboarded_blocks + s.partial_onboards,
                    "GPU_to_GPU": s.partial_copies}
        assert expected == {"GPU_to_CPU": moved.offloaded_blocks,
                            "CPU_to_GPU": moved.onboarded_blocks,
                            "GPU_to_GPU": moved.copied_blocks}, name
        for ttype, blocks in expected.items():
            assert value(got, "kvxfer:kv_transfer_blocks_total", name,
                         transfer_type=ttype) == blocks, (name, ttype)
        assert value(got, "kvxfer:evicted_blocks_total", name, tier="GPU",
                     outcome="offloaded") == s.offloaded_blocks
        assert value(got, "kvxfer:partial_reuse_blocks_total", name,
                     source="GPU") == s.partial_copies
    assert runs["offload"][0].stats.offloaded_blocks > 0
    assert runs["drop"][0].stats.offloaded_blocks == 0
    assert runs["offload"][0].stats.onboarded_blocks > 0
    assert runs["offload"][0].stats.partial_copies + runs["drop"][0].stats.partial_copies > 0
    assert value(got, "kvxfer:kv_transfer_blocks_total", "drop",
                 transfer_type="GPU_to_CPU") == 0


def test_a_name_must_be_a_non_empty_string():
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=2,
                                       tokens_per_block=T, dtype=jnp.float32,
                                       num_primary_blocks=4, num_secondary_blocks=0)
    for bad in ("", "  ", 3, b"offload"):
        with pytest.raises(TypeError, match="name must be None or a non-empty str"):
            BlockManager(pool, metrics=False, name=bad)
