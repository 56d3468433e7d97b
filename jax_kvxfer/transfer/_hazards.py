"""Which slots the transfer lanes' pending copies touch, and who must wait for whom.

Pure NumPy: no JAX, no GPU. The lane engine (_engines.py) asks `order` before it enqueues a copy
and tells `record` after; a join tells `onboards_done` / `offloads_done`.

Lane 0 carries offloads: it writes secondary slots, and reads a snapshot that XLA's stream
takes of the primary sources first (so its reads of primary slots are over at dispatch).
Lane 1 carries onboards and copies within the GPU pool: it reads secondary (or primary) slots
and writes primary ones. Copies on one lane run in order; across the lanes, a copy waits for
the other lane only where the two touch one slot:

- an onboard reading a secondary slot that a pending offload writes waits for lane 0;
- an offload writing a secondary slot that a pending onboard reads waits for lane 1;
- an offload's snapshot of a primary slot that a pending onboard writes makes XLA's stream
  wait for lane 1 first.

No other pair can clash: the lanes write different memories, and lane 0 reads none.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

OFFLOAD_LANE = 0
ONBOARD_LANE = 1
NO_LANE = -1


class LaneOrder(NamedTuple):
    """Where a copy goes and what it waits for."""

    lane: int  # OFFLOAD_LANE or ONBOARD_LANE
    wait_lane: int  # the lane this copy's lane first waits for (NO_LANE: none)
    stream_wait_lane: int  # the lane XLA's stream first waits for (NO_LANE: none)


class LaneHazards:
    """Per slot, whether a pending lane copy reads or writes it."""

    def __init__(self, num_primary: int, num_secondary: int) -> None:
        self.onboard_writes = np.zeros(num_primary, np.bool_)
        self.onboard_reads = np.zeros(num_secondary, np.bool_)
        self.offload_writes = np.zeros(num_secondary, np.bool_)
        self.onboards_pending = self.offloads_pending = False

    def order(self, src: np.ndarray, dst: np.ndarray, src_primary: bool,
              dst_primary: bool) -> LaneOrder:
        """The lane and waits of a copy of slots `src` -> `dst` in one direction: an offload
        (primary -> secondary), an onboard (secondary -> primary) or a copy within the GPU pool
        (primary -> primary)."""
        # A lane with nothing pending has no slot flagged: no lookup needed.
        if not dst_primary:  # an offload
            if not self.onboards_pending:
                return LaneOrder(OFFLOAD_LANE, NO_LANE, NO_LANE)
            return LaneOrder(
                OFFLOAD_LANE,
                ONBOARD_LANE if _any(self.onboard_reads, dst) else NO_LANE,
                ONBOARD_LANE if _any(self.onboard_writes, src) else NO_LANE)
        reads_offloaded = (not src_primary and self.offloads_pending
                           and _any(self.offload_writes, src))
        return LaneOrder(ONBOARD_LANE, OFFLOAD_LANE if reads_offloaded else NO_LANE, NO_LANE)

    def record(self, src: np.ndarray, dst: np.ndarray, src_primary: bool,
               dst_primary: bool) -> None:
        """The copy is enqueued: its slots are pending until its lane is done."""
        if dst_primary:
            self.onboard_writes[dst] = True
            if not src_primary:
                self.onboard_reads[src] = True
            self.onboards_pending = True
        else:
            self.offload_writes[dst] = True
            self.offloads_pending = True

    def onboards_done(self) -> None:
        """Lane 1 has nothing pending (XLA's stream joined it, or the host waited)."""
        self.onboard_writes[:] = False
        self.onboard_reads[:] = False
        self.onboards_pending = False

    def offloads_done(self) -> None:
        """Lane 0 has nothing pending."""
        self.offload_writes[:] = False
        self.offloads_pending = False


def _any(flags: np.ndarray, slots: np.ndarray) -> bool:
    """Whether any of `slots` is flagged (count_nonzero: `.any()`'s Python wrapper costs a few
    microseconds a call, on every transfer's path)."""
    return bool(np.count_nonzero(flags[slots]))
