"""Handing a step's queued transfers over to the connector's worker and the transfer manager."""

from __future__ import annotations

import time

from ..connector import LoadSpec, StoreSpec
from .block_cache import StepTransfers


class TransferIssuing:
    """`BlockManager`'s issuing of its `StepTransfers` queue (stores, loads, copies within the
    GPU pool); the state is the block manager's, set in its `__init__`."""

    def _issue(self) -> None:
        """Hands the queued transfers over: stores and loads to the worker, then copies within
        the GPU pool to the transfer manager. The worker runs them before any job handed over
        later, so the connector counts them done at once: loaded blocks leave the host pool,
        store_on_release's copies too."""
        self._offer_evicted()
        queue = self._queue
        if not queue:
            return
        self._queue = StepTransfers()
        staged = self._submit_stores(queue)
        if queue.load_keys:
            self._worker.submit_load(next(self._jobs), LoadSpec(tuple(queue.load_keys),
                                                                queue.load_rows),
                                     queue.load_pages,
                                     queue.load_tokens if queue.host_pins else None)
            self._host.complete_load(queue.load_keys)
            self._host_pushes += len(queue.host_pins)
            for block in queue.host_pins:
                block.ref_count -= 1
            if queue.moved:
                self._host.remove(queue.moved)
            self._publish_host_events()
        if queue.copies:
            self.transfer_manager.onboard_blocks(queue.copies, queue.copy_tokens)
            for block in queue.gpu_pins:
                self._unref(block)
        self._release_staged(staged)

    def _issue_stores(self) -> None:
        """Hands the queued stores over alone, loads and copies left queued: exact at any time,
        as no queued store reads a GPU page that a queued load or copy writes (an eviction
        from such a page issues the queue first). Blocks evicted from the GPU but not offered
        to the host pool yet keep their pages until their stores are queued: the loads that
        write those pages must wait for them."""
        self._release_staged(self._submit_stores(self._queue))

    def _submit_stores(self, queue: StepTransfers) -> list[bytes]:
        """Submits a queue's stores (taking them out of it); returns store_on_release's."""
        keys, pages, rows, staged = queue.take_stores()
        self._host_pushes = 0
        if keys:
            self._worker.submit_store(next(self._jobs), StoreSpec(tuple(keys), rows), pages)
        return staged

    def _release_staged(self, staged: list[bytes]) -> None:
        """store_on_release's copies, handed over: their rows are free again (the worker makes
        the rows' next users wait for the writes to the stores)."""
        if staged:  # kept on the GPU: not announced on the host (nor the stores)
            self._host.complete_store(staged)
            self._host.remove(staged)
            self._host.take_events()

    def _timed_issue(self) -> None:
        t0 = time.perf_counter()
        self._issue()
        self._stats.transfer_seconds += time.perf_counter() - t0
