"""Prometheus metrics of the block managers and transfer managers of this process.

`start_metrics_server(port)` serves them over HTTP (`/metrics`). The registry is process-wide
(`registry()`): every `BlockManager` and `KVCacheTransferManager` made after it exists (a
server started, or `registry()` called), or made with `metrics=True`, reports to it with a
`manager` label: the block manager's `name` (`BlockManager(..., name="offload")`), else a
number in creation order ("0", "1", ...). A transfer manager reports under the label of the
block manager made over it, counting from that block manager's making (what it moved before,
a warm-up say, is not that block manager's); one made alone has a number of its own.

The figures are the managers' own statistics, cumulative (Prometheus counters never reset):
a counter is what every `get_and_reset_*` call returned so far plus what the live statistics
hold now, read at the scrape, so the hot path pays nothing. Stores count in their own objects
and reset what they return: a scrape takes their statistics and keeps them for the block
manager's next `store_stats()`, which returns what scrapes took plus the rest, as without
metrics. The table of names is in docs/events-metrics.md.

prometheus-client is imported when metrics are asked for, never before
(`pip install "jax_kvxfer[metrics]"`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["MetricsServer", "check_metrics_choice", "enabled", "registry",
           "start_metrics_server"]

PREFIX = "kvxfer:"

_lock = threading.RLock()
_registry: Any = None  # prometheus_client.CollectorRegistry, once asked for
_reports: list[weakref.ref] = []  # the reporting managers' reports
_numbers = itertools.count()  # the labels of managers without a name


def enabled() -> bool:
    """Whether the process-wide registry exists (a manager made now reports by default)."""
    return _registry is not None


def check_metrics_choice(metrics: Any) -> bool:
    """A manager's `metrics` argument -> whether it reports. None: when the registry exists."""
    if metrics is not None and not isinstance(metrics, bool):
        raise TypeError(f"metrics must be True, False or None (report once a metrics server "
                        f"runs), got {metrics!r}")
    return enabled() if metrics is None else metrics


def registry():
    """The process-wide `prometheus_client.CollectorRegistry` the managers report to (made on
    the first call; imports prometheus_client). Serve it yourself with
    `prometheus_client.generate_latest(registry())`, or use `start_metrics_server`."""
    global _registry
    with _lock:
        if _registry is None:
            try:
                import prometheus_client
            except ImportError as e:
                raise ImportError(f"metrics need prometheus-client ({e}); "
                                  'pip install "jax_kvxfer[metrics]"') from e
            reg = prometheus_client.CollectorRegistry(auto_describe=True)
            reg.register(_Collector())
            _registry = reg
        return _registry


@dataclasses.dataclass
class MetricsServer:
    """A running metrics server: its address and port (the one taken where port 0 was asked)."""

    addr: str
    port: int
    _server: Any = dataclasses.field(repr=False, default=None)
    _thread: Any = dataclasses.field(repr=False, default=None)

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serves the process-wide registry over HTTP on `addr:port` (port 0: a free one) from a
    daemon thread; every manager made from now on reports to it.

    Raises:
      TypeError, ValueError: a bad port or addr, named. ImportError: prometheus-client missing.
      OSError: the port cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an integer, got {port!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0: a free port), got {port}")
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"addr must be a non-empty str (an address to bind), got {addr!r}")
    reg = registry()
    import prometheus_client

    try:
        server, thread = prometheus_client.start_http_server(port, addr=addr, registry=reg)
    except OSError as e:  # "Address already in use" alone does not say which
        raise OSError(e.errno, f"cannot serve metrics on {addr}:{port}: {e.strerror}") from e
    return MetricsServer(addr, server.server_address[1], server, thread)


def check_name(name: Any) -> str | None:
    """A block manager's `name` argument, checked: None or a non-empty str (its label)."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"name must be None or a non-empty str (the manager label of its "
                        f"metrics), got {name!r}")
    return name


def _label(name: str | None = None) -> str:
    """`name`, made unique among the live reports ("offload", then "offload#2", ...: Prometheus
    takes one series per label set), or the next number."""
    with _lock:
        if name is None:
            return str(next(_numbers))
        taken = {r().label for r in _reports if r() is not None}
        label, k = name, 1
        while label in taken:
            k += 1
            label = f"{name}#{k}"
        return label


def _add(total: dict, stats: Any) -> None:
    for f in dataclasses.fields(stats):
        total[f.name] = total.get(f.name, 0) + getattr(stats, f.name)


class BlockManagerReport:
    """What one block manager reports: its statistics (reset ones kept), its pools' use, its
    stores' statistics (see the module's docstring)."""

    def __init__(self, live: Callable[[], Any], gauges: Callable[[], dict],
                 store_stats: Callable[[], dict] | None, name: str | None = None,
                 transfers: TransferManagerReport | None = None) -> None:
        """transfers: the report of the block manager's transfer manager, which reports under
        this label from now on (`TransferManagerReport.adopt`)."""
        registry()
        self.label = _label(check_name(name))
        self.lock = threading.Lock()
        self._live, self._gauges, self._fetch_stores = live, gauges, store_stats
        self._base: dict[str, float] = {}
        self._store_totals: dict[str, dict[str, float]] = {}
        self._store_pending: dict[str, Any] = {}  # taken by scrapes, for store_stats()
        with _lock:
            _reports.append(weakref.ref(self))
        if transfers is not None:
            transfers.adopt(self.label)

    def reset(self, swap: Callable[[], Any]) -> Any:
        """`swap()` takes the statistics and starts new ones; they are kept in the totals."""
        with self.lock:
            stats = swap()
            _add(self._base, stats)
        return stats

    def take_store_stats(self) -> dict:
        """The stores' statistics since the last call, the part scrapes took included."""
        with self.lock:
            fresh = self._take_stores()
            out, self._store_pending = self._store_pending, {}
        for tier, stats in fresh.items():
            if tier in out:
                out[tier].add(stats)
            else:
                out[tier] = stats
        return out

    def _take_stores(self) -> dict:
        fresh = self._fetch_stores() if self._fetch_stores is not None else {}
        for tier, stats in fresh.items():
            _add(self._store_totals.setdefault(tier, {}), stats)
        return fresh

    def samples(self) -> tuple[dict, dict, dict]:
        """(block statistics' totals, gauges, per-tier store totals), for a scrape."""
        with self.lock:
            totals = dict(self._base)
            live = self._live()
            fresh = self._take_stores()
            for tier, stats in fresh.items():
                if tier in self._store_pending:
                    self._store_pending[tier].add(stats)
                else:
                    self._store_pending[tier] = dataclasses.replace(stats)
            stores = {tier: dict(t) for tier, t in self._store_totals.items()}
        _add(totals, live)
        return totals, self._gauges(), stores


class TransferManagerReport:
    """What one transfer manager reports: its statistics, reset ones kept."""

    def __init__(self, live: Callable[[], Any], lock: Any) -> None:
        """live: the manager's live statistics, read under `lock` (the manager's)."""
        registry()
        self.label = _label()
        self._live, self._lock = live, lock
        self._base: dict[str, float] = {}
        self._start: dict[str, float] = {}  # the totals when a block manager adopted it
        with _lock:
            _reports.append(weakref.ref(self))

    def reset(self, stats: Any) -> None:
        """Called under the manager's lock with the statistics it returns."""
        _add(self._base, stats)

    def adopt(self, label: str) -> None:
        """Reports under `label` (a block manager's) from now on, counting from now: a new
        series, so no counter goes back."""
        with self._lock:
            self._start = self._totals()
            self.label = label

    def _totals(self) -> dict:
        """Everything counted since the manager was made (under the manager's lock)."""
        totals = dict(self._base)
        _add(totals, self._live())
        return totals

    def samples(self) -> dict:
        with self._lock:
            totals = self._totals()
        for key, start in self._start.items():
            totals[key] -= start
        return totals


# name (after the prefix), help, the statistic it is; labels besides `manager`
_BLOCK_COUNTERS = [
    ("prefix_cache_queries", ("Prompt tokens looked up in the prefix cache (vllm:prefix_cache_"
     "queries; BlockManagerStats.prompt_tokens)"), "prompt_tokens"),
    ("prefix_cache_hits", ("Prompt tokens found in the cache, any tier (vllm:prefix_cache_hits; "
     "BlockManagerStats.reused_tokens)"), "reused_tokens"),
    ("transfer_issue_seconds", ("Wall seconds issuing transfers and in sync_transfers "
     "(BlockManagerStats.transfer_seconds)"), "transfer_seconds"),
    ("store_skipped_blocks", ("Blocks a store held that prompts recomputed, their read "
     "expected to take longer (BlockManagerStats.store_skipped_blocks)"),
     "store_skipped_blocks"),
    ("store_declined_blocks", ("Blocks store_on_release did not write, no store's reads "
     "expected to beat recomputing them (BlockManagerStats.store_declined_blocks)"),
     "store_declined_blocks"),
]
_STORE_COUNTERS = [
    ("store_lookups", "Keys asked of a store (StoreStats.lookups)", "lookups"),
    ("store_hits", "Blocks read from a store intact (StoreStats.hits)", "hits"),
    ("store_misses", "Blocks a store did not find (StoreStats.misses)", "misses"),
    ("store_corrupt_blocks", "Values refused: torn, bad checksum, foreign (StoreStats.corrupt)",
     "corrupt"),
    ("store_written_blocks", "Blocks written (StoreStats.written)", "written"),
    ("store_dropped_writes", ("Writes given up: full, I/O error, server down "
     "(StoreStats.dropped_writes)"), "dropped_writes"),
    ("store_read_bytes", ("Payload bytes read (vllm:kv_offload_tiering_read_bytes; "
     "StoreStats.read_bytes)"), "read_bytes"),
    ("store_written_bytes", ("Payload bytes written (vllm:kv_offload_tiering_write_bytes; "
     "StoreStats.written_bytes)"), "written_bytes"),
    ("store_read_seconds", ("Wall seconds of reads, summed over threads "
     "(vllm:kv_offload_tiering_read_time; StoreStats.read_seconds)"), "read_seconds"),
    ("store_write_seconds", ("Wall seconds of writes, summed over threads "
     "(vllm:kv_offload_tiering_write_time; StoreStats.write_seconds)"), "write_seconds"),
    ("store_evicted_blocks", ("Blocks a store removed to stay within capacity "
     "(StoreStats.evicted)"), "evicted"),
]
_TRANSFER_TYPES = (("GPU_to_CPU", "offloaded"), ("CPU_to_GPU", "onboarded"),
                   ("GPU_to_GPU", "copied"))


class _Collector:
    """Reads every live report at each scrape."""

    def describe(self) -> list:
        return []  # the families vary with the managers alive; none is described up front

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with _lock:
            _reports[:] = [r for r in _reports if r() is not None]
            reports = [r() for r in _reports]
        blocks = [r for r in reports if isinstance(r, BlockManagerReport)]
        transfers = [r for r in reports if isinstance(r, TransferManagerReport)]
        b_samples = [(r.label, *r.samples()) for r in blocks if r is not None]
        t_samples = [(r.label, r.samples()) for r in transfers if r is not None]

        def counter(name, doc, labels=()):
            return CounterMetricFamily(PREFIX + name, doc, labels=["manager", *labels])

        def gauge(name, doc, labels=()):
            return GaugeMetricFamily(PREFIX + name, doc, labels=["manager", *labels])

        yield from _block_families(b_samples, counter, gauge)
        yield from _transfer_families(t_samples, counter)


def _block_families(b_samples, counter, gauge):
    """The block managers' metric families, from their (label, totals, gauges, stores)."""
    for name, doc, field in _BLOCK_COUNTERS:
        m = counter(name, doc)
        for label, totals, _, _ in b_samples:
            m.add_metric([label], totals[field])
        yield m
    m = counter("prefix_cache_hit_blocks", "Full blocks of prompts found in the cache, by "
                "tier: GPU in place (BlockManagerStats.reused_blocks), CPU onboarded from "
                "the host pool (onboarded_blocks - store_hit_blocks), STORE read from a "
                "store then onboarded (store_hit_blocks)", ["tier"])
    for label, t, _, _ in b_samples:
        m.add_metric([label, "GPU"], t["reused_blocks"])
        m.add_metric([label, "CPU"], t["onboarded_blocks"] - t["store_hit_blocks"])
        m.add_metric([label, "STORE"], t["store_hit_blocks"])
    yield m
    m = counter("partial_reuse_blocks", "Partially matched blocks copied into a fresh block, "
                "by source (BlockManagerStats.partial_copies: GPU, partial_onboards: CPU)",
                ["source"])
    for label, t, _, _ in b_samples:
        m.add_metric([label, "GPU"], t["partial_copies"])
        m.add_metric([label, "CPU"], t["partial_onboards"])
    yield m
    m = counter("evicted_blocks", "Cached blocks evicted, by tier and outcome: GPU "
                "offloaded (BlockManagerStats.offloaded_blocks) or dropped "
                "(dropped_primary_blocks), CPU dropped (dropped_secondary_blocks)",
                ["tier", "outcome"])
    for label, t, _, _ in b_samples:
        m.add_metric([label, "GPU", "offloaded"], t["offloaded_blocks"])
        m.add_metric([label, "GPU", "dropped"], t["dropped_primary_blocks"])
        m.add_metric([label, "CPU", "dropped"], t["dropped_secondary_blocks"])
    yield m
    for name, doc, key in (
            ("kv_cache_usage_perc", ("Fraction of the pool's blocks holding a block, cached or "
             "in use (vllm:kv_cache_usage_perc; tier CPU: vllm:kv_offload_cpu_cache_usage_"
             "perc)"), "usage"),
            ("free_blocks", ("Blocks holding nothing (num_free_primary_blocks / "
             "num_free_secondary_blocks)"), "free"),
            ("reusable_blocks", ("Cached blocks no sequence uses: evictable "
             "(len(reusable_blocks(primary)))"), "reusable")):
        m = gauge(name, doc, ["tier"])
        for label, _, g, _ in b_samples:
            for tier in ("GPU", "CPU"):
                m.add_metric([label, tier], g[tier][key])
        yield m
    m = gauge("store_used_bytes", "Bytes a store's blocks take, where it tells "
              "(FileStore.used_bytes)", ["tier"])
    for label, _, g, _ in b_samples:
        for tier, used in g.get("stores", {}).items():
            m.add_metric([label, tier], used)
    yield m
    for name, doc, field in _STORE_COUNTERS:
        m = counter(name, doc, ["tier"])
        for label, _, _, stores in b_samples:
            for tier, t in stores.items():
                m.add_metric([label, tier], t[field])
        yield m


def _transfer_families(t_samples, counter):
    """The transfer managers' metric families, from their (label, totals)."""
    for what, doc in (("blocks", ("Blocks moved by the transfer manager, by direction "
                       "(TransferStats.offloaded_/onboarded_/copied_blocks)")),
                      ("bytes", ("Bytes moved by the transfer manager, all pools, by "
                       "direction (vllm:kv_offload_total_bytes; TransferStats.*_bytes)"))):
        m = counter(f"kv_transfer_{what}", doc, ["transfer_type"])
        for label, t in t_samples:
            for ttype, kind in _TRANSFER_TYPES:
                m.add_metric([label, ttype], t[f"{kind}_{what}"])
        yield m
    m = counter("exposed_transfer_seconds", "GPU seconds compute waited for transfers or "
                "took offload snapshots (TransferStats.exposed_seconds; counted when "
                "get_and_reset_transfer_stats returns them)")
    for label, t in t_samples:
        m.add_metric([label], t["exposed_seconds"])
    yield m
