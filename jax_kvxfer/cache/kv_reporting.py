"""The block manager's KV events (vLLM's format) and its metrics' gauges."""

from __future__ import annotations

from ..observe import events as kv_events
from ..observe.metrics import BlockManagerReport
from .block_cache import ROOT_KEY, CachedBlock


class EventsAndMetrics:
    """`BlockManager`'s KV events, collected per step and published at the boundary, and
    what a metrics scrape reads; the state is the block manager's, set in its `__init__`."""

    def _publish_host_events(self) -> None:
        """The connector's events since its last call (blocks stored on or removed from the
        host pool, stored in the stores), published as the block manager's, with each
        block's parent and tokens."""
        events = self._host.take_events()
        if self._events is None:
            return
        for event in events:
            for key in event.block_hashes:
                block = self._index.by_key[key]
                if event.removed:
                    self._event_removed(block, event.medium)
                else:
                    self._event_stored(block, event.medium)

    def _event_stored(self, block: CachedBlock, medium: str) -> None:
        """A full block is now held on `medium` (partly filled blocks are not published: a
        router matches whole blocks, and Dynamo's rejects shorter ones)."""
        if len(block.tokens) == self.tokens_per_block:
            parent = None if block.parent_key == ROOT_KEY else block.parent_key
            self._events.append((kv_events.STORED, medium, block.key, parent, block.tokens,
                                 self.tokens_per_block))

    def _event_removed(self, block: CachedBlock, medium: str) -> None:
        if len(block.tokens) == self.tokens_per_block:
            self._events.append((kv_events.REMOVED, medium, block.key))

    def _publish_events(self) -> None:
        events, self._events = self._events, []
        self._publisher.publish(events)

    def _metrics_report(self) -> BlockManagerReport:
        """Reports to the metrics under `name`, with its transfer manager's counters."""
        return BlockManagerReport(lambda: self._stats, self._metric_gauges,
                                  self._worker.store_stats if self._has_stores else None,
                                  name=self.name, transfers=self.transfer_manager.metrics_report)

    def _metric_gauges(self) -> dict:
        """The pools' use (and the stores' where they tell), read by a metrics scrape."""
        host = self._host
        out = {}
        for tier, total, free, reusable in (
                ("GPU", self.num_primary_blocks, len(self._free), len(self._reusable)),
                ("CPU", self.num_secondary_blocks, host.num_free_host_blocks if host else 0,
                 host.num_evictable_blocks if host else 0)):
            out[tier] = {"usage": (total - free) / total if total else 0.0, "free": free,
                         "reusable": reusable}
        if self._has_stores:
            used = ((s.tier, getattr(s, "used_bytes", None)) for s in self._worker.stores)
            out["stores"] = {tier: n for tier, n in used if isinstance(n, int)}
        return out
