"""The stores section's reads and writes beside a serving thread: RedisStore's get and put, alone
and while another thread of the same process runs pure-Python work, as a serving thread's
scheduling does.

Why: a reader thread that needs the GIL between its socket reads waits for it. A thread that
holds it (pure Python does, a jitted step's wait does not) keeps it up to the interpreter's
switch interval (5 ms) each time a reader asks for it back, so the reads slow down while the
work does not. RedisStore's loops therefore run a whole batch without the GIL
(ffi/store_io.cc); this case shows what remains. On a machine with few cores, the work
also takes a core from the readers and the server (docs/stores.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .config import MiB
from .helpers import median


def _busy_python(stop: threading.Event, chunks: list[float]) -> None:
    """Pure-Python work in chunks of about 0.2 ms until `stop`; each chunk's seconds appended
    to `chunks`."""
    while not stop.is_set():
        t = time.perf_counter()
        counts: dict[int, int] = {}
        for i in range(3000):
            counts[i % 97] = counts.get(i % 97, 0) + i
        chunks.append(time.perf_counter() - t)


def figure_runs(c: dict[str, Any], key: str) -> str:
    """A figure's median with its runs' min-max (the stores section's too)."""
    xs = c.get(f"{key}_runs") or [c[f"{key}_gbps"]]
    return f"{c[f'{key}_gbps']:.2f} ({min(xs):.2f}-{max(xs):.2f})"


def beside_busy_line(c: dict[str, Any]) -> str:
    """The case's figures: medians (min-max) over its runs."""
    slow = c["work_slowdown_runs"]
    return "; ".join(
        f"{op} {figure_runs(c, f'{op}_beside')} GB/s beside the work, "
        f"{figure_runs(c, f'{op}_alone')} alone ({c[f'{op}_beside_ratio']:.2f}x)"
        for op in ("get", "put")) + (
        f"; the work {c['work_slowdown']:.2f}x slower beside the get ({min(slow):.2f}-"
        f"{max(slow):.2f}); verified={c['verified']}")


def beside_busy_case(rng: np.random.Generator, nbytes: int, new_raw: Callable[[], Any],
                     new_store: Callable[[int], Any], threads: int, reps: int
                     ) -> dict[str, Any]:
    """RedisStore's (`new_store(threads)`) get, and put then flush, of `nbytes` of 2 MiB rows,
    each alone and beside the work on a thread of its own, interleaved, `reps` times after a
    warm-up; and the work's mean chunk time beside the get over alone for as long
    (`work_slowdown`). `new_raw`: the bench's raw client, to remove the keys after."""
    row = 2 * MiB
    count = max(1, nbytes // row)
    src = np.frombuffer(rng.bytes(count * row), np.uint8).reshape(count, row)
    dst = np.zeros_like(src)
    keys = [rng.bytes(16) for _ in range(count)]
    runs: dict[str, list[float]] = {f"{op}_{where}": [] for op in ("get", "put")
                                    for where in ("alone", "beside")}
    runs["slowdown"] = []
    verified = True

    def busy(seconds: float) -> list[float]:
        """The work's chunks' times over `seconds`, with nothing beside it."""
        return timed(lambda: time.sleep(seconds), True)[1]

    def timed(op: Callable[[], Any], work: bool) -> tuple[float, list[float], Any]:
        """op() beside the work or not: its seconds, the work's chunks' times, its result."""
        stop, chunks = threading.Event(), []
        worker = threading.Thread(target=_busy_python, args=(stop, chunks))
        if work:
            worker.start()
        t = time.perf_counter()
        result = op()
        took = time.perf_counter() - t
        stop.set()
        if work:
            worker.join()
        return took, chunks, result

    def put() -> None:
        store.put(keys, list(src)).result()
        store.flush()

    with contextlib.closing(new_raw()) as raw, new_store(threads) as store:
        store.bind(("bench", "RedisStore", row), row)
        try:
            for rep in range(reps + 1):  # the first: a warm-up
                got = {}
                for op in ("put", "get"):  # a get reads what the put before it wrote
                    for where in ("alone", "beside"):
                        dst[:] = 0
                        took, chunks, found = timed(
                            put if op == "put" else lambda: store.get(keys, list(dst)).result(),
                            where == "beside")
                        if op == "get":
                            verified = verified and all(found) and bool(np.array_equal(dst, src))
                        got[f"{op}_{where}"] = count * row / took / 1e9
                        if op == "get" and where == "beside":
                            got["slowdown"] = float(np.mean(chunks) / np.mean(busy(took)))
                if rep:
                    for key, x in got.items():
                        runs[key].append(x)
        finally:
            raw.remove([store.key_prefix + k.hex() for k in keys])
    out: dict[str, Any] = {"blocks": count, "bytes": count * row, "verified": verified,
                           "work_slowdown": median(runs["slowdown"]),
                           "work_slowdown_runs": runs["slowdown"]}
    for op in ("get", "put"):
        for where in ("alone", "beside"):
            xs = runs[f"{op}_{where}"]
            out[f"{op}_{where}_gbps"], out[f"{op}_{where}_runs"] = median(xs), xs
        out[f"{op}_beside_ratio"] = median(
            [b / a for a, b in zip(runs[f"{op}_alone"], runs[f"{op}_beside"])])
    return out
