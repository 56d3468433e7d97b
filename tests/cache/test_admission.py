"""Admission policies for offloading (jax_kvxfer.cache.admission), alone and in a BlockManager:
the frequency gate's counts against a brute-force count over the whole history of sightings,
the sightings a BlockManager reports against the blocks of the sequences it released, every
eviction's decision against the brute-force count at that moment, and TensorRT-LLM's priority
rule, which no policy overrides."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_block_manager import T, make, serve  # tests/cache, on the path under pytest

from jax_kvxfer.cache import AlwaysAdmit, FrequencyGate, ReuseGate, admission_policy

ROOT = b"\x00" * 16


def brute_counts(sightings: list, window: int) -> dict:
    """What a gate's counts should be after `sightings`: sighting i falls in epoch
    i // window; at the end of each full epoch every count is halved, rounded down."""
    counts: dict = {}
    for key in set(sightings):
        c = 0
        for start in range(0, len(sightings), window):
            c += sightings[start:start + window].count(key)
            if start + window <= len(sightings):  # a full epoch: its boundary passed
                c //= 2
        if c:
            counts[key] = c
    return counts


def chain_keys(tokens: list[int]) -> list[bytes]:
    """The keys of a sequence's blocks (full and last partial), as the index defines them:
    blake2b-128 of the parent's key and the block's tokens as little-endian int64."""
    keys, parent = [], ROOT
    for i in range(0, len(tokens), T):
        data = np.asarray(tokens[i:i + T], dtype="<i8").tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        keys.append(parent)
    return keys


@pytest.mark.parametrize("k, window", [(1, 3), (2, 5), (2, 64), (3, 7)])
def test_gate_counts_and_decisions_match_the_brute_force_count(k, window):
    rng = np.random.default_rng(k * 100 + window)
    gate, history = FrequencyGate(k, window), []
    for _ in range(400):
        key = bytes([int(rng.zipf(1.5)) % 12])
        if rng.random() < 0.7:
            gate.seen(key)
            history.append(key)
        else:
            want = brute_counts(history, window).get(key, 0)
            assert gate.count(key) == want
            assert gate.admit(key) == (want >= k)
    assert gate.tracked_keys == len(brute_counts(history, window)) <= 2 * window + 12
    assert gate.admitted + gate.declined > 0


def test_policy_names_and_bad_specs():
    assert isinstance(admission_policy(None), ReuseGate) and admission_policy(None).rate == 0.05
    assert admission_policy("reuse:0.2").rate == 0.2
    assert isinstance(admission_policy("always"), AlwaysAdmit)
    gate = admission_policy("second-sighting")
    assert isinstance(gate, FrequencyGate) and gate.k == 2
    gate = admission_policy("second-sighting:3,128")
    assert (gate.k, gate.window) == (3, 128)
    for bad in ("sometimes", "second-sighting:0", "second-sighting:x", "always:2", "reuse:0",
                "reuse:1.5", "reuse:x"):
        with pytest.raises(ValueError):
            admission_policy(bad)
    with pytest.raises(TypeError):
        admission_policy(2)


class Recording(FrequencyGate):
    """A gate that records the sightings it is told of and, per eviction it is asked about,
    the victim and how many sightings had been reported by then."""

    def __init__(self, k, window):
        super().__init__(k, window)
        self.seen_keys, self.asked = [], []

    def seen(self, key):
        self.seen_keys.append(key)
        super().seen(key)

    def admit(self, key):
        self.asked.append((key, len(self.seen_keys)))
        return super().admit(key)


@pytest.mark.parametrize("seed", range(3))
def test_block_manager_offloads_exactly_what_the_gate_admits(seed):
    """Documents asked questions, a few low-priority sequences between them, through a GPU pool
    of a few blocks and a host pool that never fills: the sightings reported are the released
    sequences' blocks, each eviction's decision is the brute-force count's, the offloads are
    those decisions, and no low-priority block is ever offered to the gate or offloaded."""
    rng = np.random.default_rng(seed)
    k, window = 2, 40
    gate = Recording(k, window)
    bm, fake = make(6, 400, admission=gate)
    docs = [[int(t) for t in rng.integers(0, 50, 2 * T)] for _ in range(5)]
    expected, low_keys = [], set()
    for i in range(120):
        if rng.random() < 0.15:  # low priority, its own tokens: never offloaded
            tokens = [int(t) for t in rng.integers(100, 150, T + 1)]
            serve(bm, fake, i, tokens, priority=10)
            low_keys.update(chain_keys(tokens))
        else:
            tokens = docs[int(rng.integers(len(docs)))] + [int(rng.integers(50, 100))]
            serve(bm, fake, i, tokens)
        expected += chain_keys(tokens)
    assert gate.seen_keys == expected
    admitted = 0
    for key, n in gate.asked:
        assert key not in low_keys, "a low-priority block was offered to the gate"
        admitted += brute_counts(expected[:n], window).get(key, 0) >= k
    assert gate.admitted == admitted and gate.declined == len(gate.asked) - admitted
    assert 0 < admitted < len(gate.asked), "the workload should exercise both decisions"
    assert bm.stats.offloaded_blocks == admitted
    assert sum(len(pairs) for _, pairs, _ in fake.ops("offload")) == admitted
    host = set(bm.reusable_blocks(primary=False))
    assert not any(min(tokens) >= 100 for tokens in host), "a low-priority block offloaded"


def test_a_block_seen_once_is_dropped_then_offloaded_after_its_second_sighting():
    """always offloads a document read once; second-sighting drops it, and offloads it once it
    has been read twice."""
    doc = list(range(1, 3 * T + 1))
    other = [[100 + 20 * j + i for i in range(3 * T)] for j in range(2)]
    for policy, offloaded_first in (("always", True), ("second-sighting", False)):
        bm, fake = make(4, 16, admission=policy)
        serve(bm, fake, "a", doc)
        serve(bm, fake, "b", other[0])  # evicts the document's blocks
        assert (bm.stats.offloaded_blocks > 0) == offloaded_first, policy
        before = bm.stats.offloaded_blocks
        serve(bm, fake, "c", doc)  # the document again: a second sighting
        serve(bm, fake, "d", other[1])
        assert bm.stats.offloaded_blocks - before >= 2, policy  # the document's full blocks
        assert serve(bm, fake, "e", doc) == 3 * T - 1, policy  # onboarded, not recomputed


def brute_reuse_gate(events, rate, window, warmup, explore):
    """ReuseGate's decisions, recomputed from the whole history at each eviction. After n
    offloads, n // window halvings have happened, one right after every window-th offload;
    an offload numbered m (from 1) has been halved (n // window) - (m - 1) // window times,
    an onboard that came after d offloads (n // window) - d // window times."""
    decisions, onboards_after, n, passed = [], [], 0, 0
    for kind in events:
        if kind == "reuse":
            onboards_after.append(n)
            continue
        halvings = n // window
        off = sum(0.5 ** (halvings - (m - 1) // window) for m in range(1, n + 1))
        on = sum(0.5 ** (halvings - d // window) for d in onboards_after)
        ok = n < warmup or (off > 0 and on / off >= rate)
        if not ok:
            passed += 1
            ok = passed % explore == 0
        decisions.append(ok)
        n += ok
    return decisions


@pytest.mark.parametrize("seed", range(4))
def test_reuse_gate_against_a_brute_force_model(seed):
    """Random evictions and onboards of phases of high and low reuse: every decision of the
    gate equals the brute-force model's, which recomputes the decayed rate from the history."""
    rng = np.random.default_rng(seed)
    rate, window, warmup, explore = 0.1, 32, 40, 5
    events = []
    for phase in range(6):
        p_reuse = (0.5, 0.005, 0.3)[phase % 3]
        events += ["reuse" if rng.random() < p_reuse else "evict"
                   for _ in range(int(rng.integers(200, 400)))]
    gate = ReuseGate(rate, window=window, warmup=warmup, explore=explore)
    got = []
    for kind in events:
        if kind == "evict":
            got.append(gate.admit(b"k"))
        else:
            gate.reused(b"k")
    assert got == brute_reuse_gate(events, rate, window, warmup, explore)
    assert gate.admitted == sum(got) and gate.declined == len(got) - sum(got)
    closed = got.index(False)  # it closed, and opened again (explore admits in a row)
    assert any(all(got[i:i + explore]) for i in range(closed, len(got) - explore))


def test_reuse_gate_stays_open_while_offloads_come_back_and_closes_when_not():
    gate = ReuseGate(0.05, window=1000, warmup=100, explore=10)
    for i in range(2000):  # one onboard per 10 offloads: 10 % >= 5 %
        assert gate.admit(b"k")
        if i % 10 == 0:
            gate.reused(b"k")
    assert gate.is_open and gate.declined == 0
    decided = [gate.admit(b"k") for _ in range(20000)]  # no reuse: the rate decays below 5 %
    assert not gate.is_open and gate.reuse_rate < 0.05
    closed = decided[decided.index(False):]
    assert abs(sum(closed) - len(closed) / 10) <= 1  # one in `explore` while closed
    for _ in range(200):  # reuse comes back: it opens again
        gate.reused(b"k")
    assert gate.is_open and gate.admit(b"k")
