"""What every shared store must do, written once: the helpers and the checks that
test_redis_store.py and test_mooncake_store.py run against their real servers (a Valkey
server, a mooncake_master). Each check takes the store, or a way to make one, and the
server's own kill and restart, so that only what differs between the servers stays in
their test files."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvxfer.stores import StoreStats


def new_keys(rng: np.random.Generator, n: int) -> list[bytes]:
    return [rng.bytes(16) for _ in range(n)]


def random_rows(rng: np.random.Generator, n: int, row_nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, (n, row_nbytes), dtype=np.uint8)


def get_rows(store: Any, keys: list[bytes], fill: int = 7,
             timeout: float = 60) -> tuple[list[bool], np.ndarray]:
    """`store.get` of `keys` into rows filled with `fill` first: (found, rows)."""
    out = np.full((len(keys), store.row_nbytes), fill, np.uint8)
    return store.get(keys, list(out)).result(timeout=timeout), out


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def check_namespaces_are_isolated(make: Callable[..., Any], rng: np.random.Generator) -> None:
    """The same keys under two namespaces (and two layouts) hold different rows; each store
    sees only its own, and a third sees nothing. `make(row_nbytes, namespace=, layout=)`
    gives a bound store on the server under test."""
    keys = new_keys(rng, 8)
    a = make(1000, namespace="iso-a")
    b = make(1000, namespace="iso-b")
    a2 = make(1000, namespace="iso-a", layout=("other-layout", 2))
    rows = {s: random_rows(rng, 8, 1000) for s in ("a", "b")}
    a.put(keys, list(rows["a"])).result(timeout=60)
    b.put(keys[:5], list(rows["b"][:5])).result(timeout=60)
    a.flush()
    b.flush()
    assert (a.lookup(keys), b.lookup(keys), a2.lookup(keys)) == (8, 5, 0)
    # per key, in any order (not a chain): one question for many keys
    order = list(rng.permutation(8))
    assert b.lookup_each([keys[i] for i in order]) == [i < 5 for i in order]
    assert a.lookup_each(keys[::-1]) == [True] * 8 and a2.lookup_each(keys) == [False] * 8
    for store, name, n in ((a, "a", 8), (b, "b", 5)):
        found, out = get_rows(store, keys)
        assert found == [True] * n + [False] * (8 - n)
        assert np.array_equal(out[:n], rows[name][:n])
    found, _ = get_rows(a2, keys)
    assert not any(found)
    c = make(1000, namespace="iso-c")
    assert c.lookup(keys) == 0
    assert a2.stats().corrupt == 0  # not found at all: other keys, not refused values
    for s in (a, b, a2, c):
        s.close()


def check_killed_mid_run_then_restarted(store: Any, kill: Callable[[], None],
                                        restart: Callable[[], None],
                                        rng: np.random.Generator, recover_s: float = 10.0,
                                        while_down: Callable[[], None] | None = None) -> None:
    """SIGKILL of the server (`kill`) while a thread keeps putting and getting: no call
    raises, a hit is always the row that was put, misses and dropped writes are counted,
    `available` goes False and calls go on, answered at once. After `restart` (the same
    address, empty) blocks written after it are hits within `recover_s`, and the old ones,
    which died with the server, are misses. `while_down` checks more before the restart."""
    keys = new_keys(rng, 16)
    rows = random_rows(rng, 16, store.row_nbytes)
    errors: list[BaseException] = []
    stop = threading.Event()
    totals = StoreStats()
    lookups: list[int] = []

    def loop() -> None:
        out = np.zeros_like(rows)
        while not stop.is_set():
            try:
                store.put(keys, list(rows)).result(timeout=60)
                store.flush()
                lookups.append(store.lookup(keys))
                found = store.get(keys, list(out)).result(timeout=60)
                for i, f in enumerate(found):
                    assert not f or np.array_equal(out[i], rows[i])
            except BaseException as e:  # noqa: BLE001 - the test thread reports, never dies
                errors.append(e)
                return

    t = threading.Thread(target=loop)
    t.start()
    assert wait_for(lambda: len(lookups) >= 3)
    kill()
    assert wait_for(lambda: store.available is False)
    n_before = len(lookups)
    assert wait_for(lambda: len(lookups) >= n_before + 5)  # calls go on, bounded
    stop.set()
    t.join(60)
    assert not errors, errors
    totals.add(store.stats())
    assert totals.dropped_writes > 0 and totals.misses > 0 and totals.hits > 0, totals
    assert lookups[-1] == 0
    found, _ = get_rows(store, keys)
    assert not any(found)
    if while_down is not None:
        while_down()

    restart()
    new = new_keys(rng, 4)
    new_rows = random_rows(rng, 4, store.row_nbytes)

    def written_and_found() -> bool:
        store.put(new, list(new_rows)).result(timeout=60)
        store.flush()
        return store.lookup(new) == 4

    assert wait_for(written_and_found, recover_s)
    assert store.available is True
    found, out = get_rows(store, new)
    assert all(found) and np.array_equal(out, new_rows)
    found, _ = get_rows(store, keys)
    assert not any(found)  # the old blocks died with the server
    store.close()
