"""OffloadingManager (the connector's scheduler side) against a shadow model written here from
vLLM's meanings: random schedules of lookups, loads, touches and stores (failed ones too) over
a small host pool, every answer compared, and the rows checked after every call."""

from __future__ import annotations

import dataclasses
import random

import pytest

from jax_kvxfer.connector import OffloadingEvent, OffloadingManager, store_key


@dataclasses.dataclass
class Shadow:
    """The host pool as plain dicts: state, priority, protection and the last use of a block."""

    capacity: int
    min_priority: int = 30
    state: dict = dataclasses.field(default_factory=dict)  # hash -> "storing"/"ready"
    priority: dict = dataclasses.field(default_factory=dict)
    protected: dict = dataclasses.field(default_factory=dict)
    used: dict = dataclasses.field(default_factory=dict)  # hash -> clock of its last push
    clock: int = 0

    def evictable(self):
        return [h for h, s in self.state.items() if s == "ready" and not self.protected[h]]

    def push(self, h):
        self.clock += 1
        self.used[h] = self.clock

    def victim(self):
        return min(self.evictable(), key=lambda h: (self.priority[h], self.used[h]))

    def lookup(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.state:
                return n
            if self.state[h] != "ready":
                return None
            n += 1
        return n

    def prepare_store(self, hashes, priority):
        new = list(dict.fromkeys(h for h in hashes if h not in self.state))
        lower = [h for h in self.evictable() if self.priority[h] <= priority]
        if len(new) > self.capacity - len(self.state) + len(lower):
            return None
        new = new if priority >= self.min_priority else []
        evicted = []
        for h in new:
            if len(self.state) == self.capacity:
                v = self.victim()
                evicted.append(v)
                for d in (self.state, self.priority, self.protected, self.used):
                    d.pop(v, None)
            self.state[h], self.priority[h], self.protected[h] = "storing", priority, 0
        return new, evicted

    def complete_store(self, hashes, success):
        for h in hashes:  # the last block becomes the most recently used
            if self.state.get(h) != "storing":
                continue
            if success:
                self.state[h] = "ready"
                self.push(h)
            else:
                for d in (self.state, self.priority, self.protected):
                    del d[h]

    def prepare_load(self, hashes):
        for h in hashes:
            if self.protected[h] == 0:
                self.used.pop(h)
            self.protected[h] += 1

    def complete_load(self, hashes):
        for h in hashes:
            self.protected[h] -= 1
            if self.protected[h] == 0:
                self.push(h)

    def remove(self, hashes):
        for h in hashes:
            if h in self.state:
                for d in (self.state, self.priority, self.protected, self.used):
                    del d[h]

    def touch(self, hashes):
        for h in reversed(hashes):
            if self.state.get(h) == "ready" and not self.protected[h]:
                self.push(h)


def check_rows(mgr: OffloadingManager, shadow: Shadow) -> None:
    slots = [mgr.host_slot(h) for h in shadow.state]
    assert None not in slots and len(set(slots)) == len(slots), slots
    assert all(0 <= s < shadow.capacity for s in slots)
    assert mgr.num_free_host_blocks == shadow.capacity - len(shadow.state)
    order = sorted(shadow.evictable(), key=lambda h: (shadow.priority[h], shadow.used[h]))
    assert mgr.eviction_order() == order and mgr.num_evictable_blocks == len(order)
    for priority in (0, 35, 100):
        assert mgr.rows_available(priority) == mgr.num_free_host_blocks + sum(
            shadow.priority[h] <= priority for h in order)
    for h in range(64):
        if h not in shadow.state:
            assert mgr.host_slot(h) is None, h


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_match_the_shadow(seed):
    rng = random.Random(seed)
    capacity = rng.choice([3, 5, 8])
    mgr, shadow = OffloadingManager(capacity, block_size=16), Shadow(capacity)
    loading: list[list[int]] = []  # prepare_load calls not completed
    storing: list[list[int]] = []
    stored_events: dict[int, int] = {}  # hash -> net CPU stored minus removed events
    for _ in range(400):
        op = rng.random()
        chain = rng.sample(range(64), rng.randint(1, 6))
        if op < 0.3:
            priority = rng.choice([10, 35, 35, 60, 90])
            want = shadow.prepare_store(chain, priority)
            got = mgr.prepare_store(chain, priority=priority)
            if want is None:
                assert got is None
                continue
            assert got.block_hashes_to_store == want[0]
            assert got.block_hashes_evicted == want[1]
            assert list(got.store_spec.block_hashes) == want[0]
            assert [mgr.host_slot(h) for h in want[0]] == got.store_spec.host_slots.tolist()
            storing.append(want[0])
        elif op < 0.45 and storing:
            hashes = storing.pop(rng.randrange(len(storing)))
            success = rng.random() < 0.8
            mgr.complete_store(hashes, success)
            shadow.complete_store(hashes, success)
        elif op < 0.6:
            # lookups mostly along chains that are held (the first ready blocks, shuffled)
            ready = [h for h, s in shadow.state.items() if s == "ready"]
            if ready and rng.random() < 0.7:
                chain = list(dict.fromkeys(rng.sample(ready, rng.randint(1, len(ready))) + chain[:1]))
            want = shadow.lookup(chain)
            assert mgr.lookup(chain) == want, (chain, shadow.state)
            if want and len(loading) < 2:
                spec = mgr.prepare_load(chain[:want])
                assert spec.store_reads == ()
                assert spec.host_slots.tolist() == [mgr.host_slot(h) for h in chain[:want]]
                shadow.prepare_load(chain[:want])
                loading.append(chain[:want])
        elif op < 0.9 and loading:
            hashes = loading.pop(rng.randrange(len(loading)))
            mgr.complete_load(hashes)
            shadow.complete_load(hashes)
        elif op < 0.95:
            mgr.touch(chain)
            shadow.touch(chain)
        else:  # a cache keeping each block in one place drops what it loaded back
            evictable = shadow.evictable()
            gone = rng.sample(evictable, min(2, len(evictable))) + chain[:1]
            gone = [h for h in dict.fromkeys(gone) if h not in shadow.state or h in evictable]
            mgr.remove(gone)
            shadow.remove(gone)
        check_rows(mgr, shadow)
        for event in mgr.take_events():
            assert event.medium == "CPU" and event.block_size == 16
            for h in event.block_hashes:
                stored_events[h] = stored_events.get(h, 0) + (-1 if event.removed else 1)
        ready = {h for h, s in shadow.state.items() if s == "ready"}
        assert {h for h, n in stored_events.items() if n} == ready
        assert all(n in (0, 1) for n in stored_events.values())


def test_protected_blocks_are_never_evicted_and_a_full_pool_refuses():
    mgr = OffloadingManager(2, block_size=4)
    out = mgr.prepare_store([1, 2])
    mgr.complete_store([1, 2])
    assert mgr.lookup([1, 2, 3]) == 2
    mgr.prepare_load([1, 2])
    assert mgr.prepare_store([3]) is None  # both protected: no room
    mgr.complete_load([1])
    out = mgr.prepare_store([3])
    assert out.block_hashes_evicted == [1] and out.block_hashes_to_store == [3]
    assert mgr.lookup([3]) is None  # being stored: ask again
    mgr.complete_store([3])
    assert mgr.lookup([3]) == 1 and mgr.lookup([2]) == 1 and mgr.lookup([1]) == 0


def test_priorities_and_admission_decide_what_is_stored():
    mgr = OffloadingManager(4, block_size=4, admission="second-sighting:2")
    assert mgr.prepare_store([1, 2]).block_hashes_to_store == []  # never seen twice
    mgr.touch([1])
    mgr.touch([1])
    assert mgr.prepare_store([1, 2]).block_hashes_to_store == [1]
    always = OffloadingManager(4, block_size=4, offload_min_priority=50)
    assert always.prepare_store([5], priority=40).block_hashes_to_store == []
    assert always.prepare_store([5], priority=50).block_hashes_to_store == [5]
    assert always.get_and_reset_stats().declined == 1


def test_low_priority_blocks_are_evicted_first_and_only_by_no_lower_priority():
    mgr = OffloadingManager(3, block_size=4, offload_min_priority=0)
    for h, priority in ((1, 80), (2, 20), (3, 50)):
        mgr.prepare_store([h], priority=priority)
        mgr.complete_store([h])
    mgr.touch([2])  # recency does not lift a lower priority
    assert mgr.prepare_store([4], priority=50).block_hashes_evicted == [2]
    assert mgr.prepare_store([5], priority=40) is None  # only higher priorities are left
    assert mgr.prepare_store([5], priority=50).block_hashes_evicted == [3]


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_gets_its_rows_in_ascending_order(seed):
    """Whatever order rows were freed and evicted in, a batch's blocks get them in ascending
    order (its blocks then lie in runs of consecutive rows, one copy each): the same rows as
    before, only their order."""
    rnd = random.Random(seed)
    mgr = OffloadingManager(32, block_size=4)
    next_hash = iter(range(1, 10**6))
    held: list[int] = []
    for _ in range(30):  # store, load and remove blocks in random order
        batch = [next(next_hash) for _ in range(rnd.randint(1, 12))]
        out = mgr.prepare_store(batch)
        if out is None:
            continue
        rows = list(out.store_spec.host_slots)
        assert rows == sorted(rows) and len(set(rows)) == len(rows)
        mgr.complete_store(batch)
        held = [h for h in held if h not in out.block_hashes_evicted] + batch
        gone = rnd.sample(held, k=min(len(held), rnd.randint(0, 6)))
        mgr.remove(gone)
        held = [h for h in held if h not in gone]


def test_remove_frees_rows_and_refuses_blocks_in_use():
    mgr = OffloadingManager(3, block_size=4)
    mgr.prepare_store([1, 2, 3])
    mgr.complete_store([1, 2])
    mgr.prepare_load([2])
    for busy in (2, 3):
        with pytest.raises(ValueError, match=r"block_hashes\[1\] is still being"):
            mgr.remove([1, busy])
    assert mgr.num_free_host_blocks == 0
    mgr.remove([1, 99])
    assert mgr.num_free_host_blocks == 1 and mgr.lookup([1]) == 0
    assert mgr.take_events()[-1] == OffloadingEvent([1], 4, "CPU", True)


def test_events_follow_vllm():
    mgr = OffloadingManager(1, block_size=8)
    mgr.prepare_store([b"a" * 32])
    assert mgr.take_events() == []  # stored only once complete
    mgr.complete_store([b"a" * 32])
    mgr.prepare_store([7])
    assert mgr.take_events() == [OffloadingEvent([b"a" * 32], 8, "CPU", False),
                                 OffloadingEvent([b"a" * 32], 8, "CPU", True)]


def test_a_sixteen_byte_hash_is_its_own_store_key():
    """The block manager's chained keys (16-byte digests) key the stores as they always did;
    other hashes are digested, tagged with their type."""
    key = bytes(range(16))
    assert store_key(key) == key
    assert store_key(key + b"!") != key + b"!" and len(store_key(key + b"!")) == 16
    assert len({store_key(1), store_key(b"\x01"), store_key(b"\x01" * 16)}) == 3


def test_a_prefetch_and_a_write_through_leave_the_admission_policy_alone():
    """count_reuse=False: a block read ahead is counted as reused once loaded, not twice;
    admit=False: a write-through is stored whatever the policy says, and not counted."""
    mgr = OffloadingManager(4, block_size=4, admission="reuse")
    gate = mgr.admission
    mgr.prepare_store([1, 2])
    mgr.complete_store([1, 2])
    assert gate.admitted == 2
    mgr.prepare_load([1], count_reuse=False)
    assert gate.reuse_rate == 0.0
    mgr.complete_load([1])
    mgr.prepare_load([1])
    assert gate.reuse_rate == 0.5  # one block loaded of two stored
    frequency = OffloadingManager(4, block_size=4, admission="second-sighting:2")
    assert frequency.prepare_store([7]).block_hashes_to_store == []  # never seen twice
    assert frequency.prepare_store([7], admit=False).block_hashes_to_store == [7]
    assert (frequency.admission.admitted, frequency.admission.declined) == (0, 1)
    low = OffloadingManager(4, block_size=4)  # a priority never stored stays so
    assert low.prepare_store([8], priority=10, admit=False).block_hashes_to_store == []


@pytest.mark.parametrize("call, args, error, match", [
    ("prepare_load", ([9],), ValueError, r"block_hashes\[0\] is held neither"),
    ("prepare_load", ([1, 1],), ValueError, "twice"),
    ("prepare_load", ([2],), ValueError, "still being stored"),
    ("complete_load", ([1],), ValueError, r"block_hashes\[0\] is not being loaded"),
    ("complete_store", ([1, 9],), ValueError, r"block_hashes\[1\] was not prepared"),
    ("lookup", ([1.5],), TypeError, r"block_hashes\[0\] must be an int or bytes"),
    ("touch", ("abc",), TypeError, "sequence of block hashes"),
    ("prepare_store", ([3],), ValueError, "priority must be an integer in 0..100"),
])
def test_bad_input_is_named_and_changes_nothing(call, args, error, match):
    mgr = OffloadingManager(4, block_size=4)
    mgr.prepare_store([1])
    mgr.complete_store([1])
    mgr.prepare_store([2])
    before = ([mgr.host_slot(h) for h in (1, 2, 3, 9)], mgr.num_free_host_blocks)
    kwargs = {"priority": 101} if call == "prepare_store" else {}
    with pytest.raises(error, match=match):
        getattr(mgr, call)(*args, **kwargs)
    assert ([mgr.host_slot(h) for h in (1, 2, 3, 9)], mgr.num_free_host_blocks) == before
    assert mgr.lookup([1]) == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"num_host_blocks": 0}, "num_host_blocks must be an integer >= 1"),
    ({"block_size": True}, "block_size must be an integer >= 1"),
    ({"stores": [object()]}, r"stores\[0\] must be a jax_kvxfer.stores.Store"),
    ({"admission": "sometimes"}, "admission 'sometimes'"),
])
def test_bad_construction_is_named(kwargs, match):
    args = {"num_host_blocks": 4, "block_size": 4, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        OffloadingManager(args.pop("num_host_blocks"), **args)


def test_a_block_loaded_several_times_is_protected_until_every_load_completes():
    mgr = OffloadingManager(1, block_size=4)
    mgr.complete_store(mgr.prepare_store([1]).block_hashes_to_store)
    mgr.prepare_load([1])
    mgr.prepare_load([1])
    with pytest.raises(ValueError, match="completes more loads than were prepared"):
        mgr.complete_load([1, 1, 1])
    mgr.complete_load([1])
    assert mgr.prepare_store([2]) is None  # still protected by the second load
    mgr.complete_load([1])
    assert mgr.prepare_store([2]).block_hashes_evicted == [1]
    mgr.complete_store([2])
    for _ in range(3):
        mgr.prepare_load([2])
    mgr.complete_load([2, 2])  # two at once
    assert mgr.prepare_store([4]) is None
    mgr.complete_load([2])
    assert mgr.prepare_store([4]).block_hashes_evicted == [2]
