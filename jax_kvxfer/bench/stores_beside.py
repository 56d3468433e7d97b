"""The stores section's read beside a serving thread: RedisStore's get, alone and while another
thread of the same process runs pure-Python work, as a serving thread's scheduling does.

Why: a reader thread that needs the GIL between its socket reads waits for it. A thread that
holds it (pure Python does, a jitted step's wait does not) keeps it up to the interpreter's
switch interval (5 ms) each time a reader asks for it back, so the reads slow down while the
work does not. RedisStore's receive loop therefore runs a whole batch without the GIL
(ffi/resp_receive.cc); this case shows what remains. On a machine with few cores, the work
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
    return (f"get {figure_runs(c, 'beside')} GB/s beside the work, {figure_runs(c, 'alone')} alone "
            f"({c['beside_ratio']:.2f}x); the work {c['work_slowdown']:.2f}x slower "
            f"({min(slow):.2f}-{max(slow):.2f}); verified={c['verified']}")


def beside_busy_case(rng: np.random.Generator, nbytes: int, new_raw: Callable[[], Any],
                     new_store: Callable[[int], Any], threads: int, reps: int
                     ) -> dict[str, Any]:
    """RedisStore's get (`new_store(threads)`) of `nbytes` of 2 MiB rows, alone and beside the
    work on a thread of its own, interleaved, `reps` times after a warm-up; and the work's
    mean chunk time beside the get over alone for as long (`work_slowdown`). `new_raw`: the
    bench's raw client, to remove the keys after."""
    row = 2 * MiB
    count = max(1, nbytes // row)
    src = np.frombuffer(rng.bytes(count * row), np.uint8).reshape(count, row)
    dst = np.zeros_like(src)
    keys = [rng.bytes(16) for _ in range(count)]
    runs: dict[str, list[float]] = {"alone": [], "beside": [], "slowdown": []}
    verified = True

    def get(work: bool) -> tuple[float, list[float]]:
        """A get of every block, beside the work or not: its seconds and the work's chunks'
        times (the rows cleared before and checked after, with the work stopped)."""
        nonlocal verified
        dst[:] = 0
        stop, chunks = threading.Event(), []
        worker = threading.Thread(target=_busy_python, args=(stop, chunks))
        if work:
            worker.start()
        t = time.perf_counter()
        found = store.get(keys, list(dst)).result()
        took = time.perf_counter() - t
        stop.set()
        if work:
            worker.join()
        verified = verified and all(found) and bool(np.array_equal(dst, src))
        return took, chunks

    def work_alone(seconds: float) -> list[float]:
        """The work's chunks' times over `seconds` without reads."""
        stop, chunks = threading.Event(), []
        worker = threading.Thread(target=_busy_python, args=(stop, chunks))
        worker.start()
        time.sleep(seconds)
        stop.set()
        worker.join()
        return chunks

    with contextlib.closing(new_raw()) as raw, new_store(threads) as store:
        store.bind(("bench", "RedisStore", row), row)
        store.put(keys, list(src)).result()
        store.flush()
        try:
            for rep in range(reps + 1):  # the first: a warm-up
                alone, _ = get(False)
                beside, with_reads = get(True)
                without = work_alone(beside)
                if rep:
                    runs["alone"].append(count * row / alone / 1e9)
                    runs["beside"].append(count * row / beside / 1e9)
                    runs["slowdown"].append(float(np.mean(with_reads) / np.mean(without)))
        finally:
            raw.remove([store.key_prefix + k.hex() for k in keys])
    return {"blocks": count, "bytes": count * row, "verified": verified,
            "alone_gbps": median(runs["alone"]), "alone_runs": runs["alone"],
            "beside_gbps": median(runs["beside"]), "beside_runs": runs["beside"],
            "beside_ratio": median([b / a for a, b in zip(runs["alone"], runs["beside"])]),
            "work_slowdown": median(runs["slowdown"]), "work_slowdown_runs": runs["slowdown"]}
