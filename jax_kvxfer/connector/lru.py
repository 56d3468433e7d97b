"""Least-recently-used eviction by priority, for the GPU pool's and the host pool's blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

MIN_PRIORITY, MAX_PRIORITY = 0, 100
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY = 30  # TensorRT-LLM's secondary_offload_min_priority


def check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or not (
            MIN_PRIORITY <= priority <= MAX_PRIORITY):
        raise ValueError(f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, "
                         f"got {priority!r}")
    return int(priority)


class EvictionQueue:
    """Reusable blocks of one memory: lowest priority first, least recently used first.

    TensorRT-LLM: the priority-bucketed LRU free-block queues of its eviction policy. A block
    is any object with a unique `block_id` and a `priority` that does not change while queued.
    """

    def __init__(self) -> None:
        self._by_priority: dict[int, OrderedDict[int, Any]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block: Any) -> bool:
        bucket = self._by_priority.get(block.priority)
        return bucket is not None and block.block_id in bucket

    def push(self, block: Any) -> None:
        """Adds `block` as the most recently used of its priority."""
        bucket = self._by_priority.get(block.priority)
        if bucket is None:
            bucket = self._by_priority[block.priority] = OrderedDict()
        bucket[block.block_id] = block
        self._count += 1

    def remove(self, block: Any) -> None:
        bucket = self._by_priority[block.priority]
        del bucket[block.block_id]
        if not bucket:
            del self._by_priority[block.priority]
        self._count -= 1

    def pop(self) -> Any:
        """Takes the next victim out (the queue is not empty)."""
        priority = min(self._by_priority)
        bucket = self._by_priority[priority]
        _, block = bucket.popitem(last=False)
        if not bucket:
            del self._by_priority[priority]
        self._count -= 1
        return block

    def __iter__(self) -> Iterator[Any]:
        """Blocks in eviction order."""
        for priority in sorted(self._by_priority):
            yield from self._by_priority[priority].values()
