"""The lanes' hazard bookkeeping (which lane or stream waits for which) against a brute-force
model that keeps every pending copy's reads and writes as sets of slots."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvxfer.transfer._hazards import (
    NO_LANE,
    OFFLOAD_LANE,
    ONBOARD_LANE,
    LaneHazards,
    LaneOrder,
)


class BruteForce:
    """Every pending copy as (lane, slots it reads on its lane, slots it writes), a slot being
    (index, is_primary). An offload's reads of primary slots happen on XLA's stream, at once
    (the snapshot): they are not pending, but they must come after a pending onboard's write."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, set, set]] = []

    def order(self, src, dst, src_primary, dst_primary) -> LaneOrder:
        lane, reads, writes, stream_reads = self._slots(src, dst, src_primary, dst_primary)
        other = [(r, w) for lane_, r, w in self.pending if lane_ != lane]
        clash = any(reads & w or writes & r or writes & w for r, w in other)
        onboard_writes = set().union(*(w for lane_, _, w in self.pending if lane_ == ONBOARD_LANE))
        return LaneOrder(lane, (1 - lane) if clash else NO_LANE,
                         ONBOARD_LANE if stream_reads & onboard_writes else NO_LANE)

    def record(self, src, dst, src_primary, dst_primary) -> None:
        lane, reads, writes, _ = self._slots(src, dst, src_primary, dst_primary)
        self.pending.append((lane, reads, writes))

    def done(self, lane: int) -> None:
        self.pending = [p for p in self.pending if p[0] != lane]

    @staticmethod
    def _slots(src, dst, src_primary, dst_primary):
        sources = {(int(i), src_primary) for i in src}
        writes = {(int(i), dst_primary) for i in dst}
        if not dst_primary:  # an offload: lane 0 copies the snapshot taken on XLA's stream
            return OFFLOAD_LANE, set(), writes, sources
        return ONBOARD_LANE, sources, writes, set()


@pytest.mark.parametrize("seed", range(8))
def test_orders_match_a_brute_force_model(seed):
    rng = np.random.default_rng(seed)
    num_primary, num_secondary = 6, 5  # few slots: clashes are common
    hazards, model = LaneHazards(num_primary, num_secondary), BruteForce()
    seen = set()
    for _ in range(400):
        r = rng.random()
        if r < 0.08:
            hazards.onboards_done()
            model.done(ONBOARD_LANE)
            continue
        if r < 0.16:
            hazards.offloads_done()
            model.done(OFFLOAD_LANE)
            continue
        direction = [(True, False), (False, True), (True, True)][int(rng.integers(3))]
        n = int(rng.integers(1, 4))
        src = rng.integers(num_primary if direction[0] else num_secondary, size=n)
        dst = rng.integers(num_primary if direction[1] else num_secondary, size=n)
        got = hazards.order(src, dst, *direction)
        assert got == model.order(src, dst, *direction), (direction, src, dst)
        seen.add(got)
        hazards.record(src, dst, *direction)
        model.record(src, dst, *direction)
        assert hazards.onboards_pending == any(p[0] == ONBOARD_LANE for p in model.pending)
        assert hazards.offloads_pending == any(p[0] == OFFLOAD_LANE for p in model.pending)
    # the sequences reach every kind of wait, so the comparison above means something
    assert {o.wait_lane for o in seen} == {NO_LANE, OFFLOAD_LANE, ONBOARD_LANE}
    assert ONBOARD_LANE in {o.stream_wait_lane for o in seen}


def test_the_three_waits():
    h = LaneHazards(4, 4)
    h.record(np.array([0]), np.array([1]), True, False)  # offload P0 -> S1
    assert h.order(np.array([1]), np.array([2]), False, True).wait_lane == OFFLOAD_LANE
    assert h.order(np.array([0]), np.array([2]), False, True).wait_lane == NO_LANE
    h.record(np.array([3]), np.array([2]), False, True)  # onboard S3 -> P2
    assert h.order(np.array([0]), np.array([3]), True, False) == (OFFLOAD_LANE, ONBOARD_LANE,
                                                                   NO_LANE)
    assert h.order(np.array([2]), np.array([0]), True, False) == (OFFLOAD_LANE, NO_LANE,
                                                                   ONBOARD_LANE)
    h.onboards_done()
    assert h.order(np.array([2]), np.array([3]), True, False) == (OFFLOAD_LANE, NO_LANE, NO_LANE)
