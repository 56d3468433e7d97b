"""FileStore across processes and faults: a writer killed with SIGKILL at random points, a
reader in another process, a full file system, a file size limit, a read-only directory.
Real failures (a subprocess killed, a tmpfs that fills up, RLIMIT_FSIZE, a read-only bind
mount), not mocks; the mounts need root and are skipped with the reason elsewhere."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_kvxfer.stores import FileStore

# end to end: plain `pytest` leaves it out, `make test` runs it
pytestmark = pytest.mark.slow

LAYOUT = ("faults", 1)


def run_python(code: str, *args: str, timeout: float = 120) -> dict:
    """Runs `code` in a new interpreter; its last stdout line, parsed as JSON."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Rows derived from their key, so that a reader checks any block without being told its data.
ROW_OF_KEY = """
import hashlib
import numpy as np

def key_of(*parts):
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()

def row_of(key, row_nbytes):
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, row_nbytes, dtype=np.uint8)
"""


def test_sigkill_at_random_points_never_leaves_a_torn_block(tmp_path):
    """50 trials: a forked writer puts and flushes batches (rows aligned and not, so both
    O_DIRECT paths run) until SIGKILL lands at a random instant; then a new store (a restart)
    must find every batch the writer reported flushed, every block it finds must be bit-exact,
    none refused as torn, and the dead writer's temporary files must be gone."""
    code = ROW_OF_KEY + """
import glob, json, os, random, signal, sys, time
from jax_kvxfer.stores import FileStore, aligned_rows

path, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
R = 3 * 4096 + 1000  # a tail past the last page
progress = os.path.join(path, "flushed.txt")
random.seed(seed)
report = {"trials": 0, "found": 0, "flushed": 0, "tmp_before_restart": 0, "corrupt": 0,
          "bad": [], "missing": [], "tmp_after_restart": 0}

def writer(trial):
    store = FileStore(path, namespace="crash", threads=4)
    store.bind(("faults", 1), R)
    aligned = aligned_rows(4, R)
    for b in range(10**6):
        keys = [key_of(seed, trial, b, j) for j in range(4)]
        rows = aligned if b % 2 else np.empty((4, R), np.uint8)
        for j, k in enumerate(keys):
            rows[j] = row_of(k, R)
        store.put(keys, list(rows)).result()
        store.flush()
        with open(progress, "a") as f:  # after the flush: these keys are durable
            f.write(" ".join(k.hex() for k in keys) + "\\n")

for trial in range(trials):
    pid = os.fork()
    if pid == 0:
        try:
            writer(trial)
        finally:
            os._exit(1)
    time.sleep(random.uniform(0.01, 0.1))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    report["trials"] += 1
    report["tmp_before_restart"] += len(glob.glob(os.path.join(path, "*", "*", ".*.tmp")))
    store = FileStore(path, namespace="crash", threads=2)
    store.bind(("faults", 1), R)
    on_disk = [bytes.fromhex(os.path.basename(p)[:32])
               for p in glob.glob(os.path.join(path, "*", "*", "*.kvb"))]
    lines = open(progress).read().splitlines() if os.path.exists(progress) else []
    flushed = [bytes.fromhex(h) for line in lines for h in line.split()
               if len(line.split()) == 4 and len(line) == 4 * 33 - 1]
    out = np.zeros((len(on_disk), R), np.uint8)
    found = store.get(on_disk, list(out)).result()
    for k, row, hit in zip(on_disk, out, found):
        if not hit or not np.array_equal(row, row_of(k, R)):
            report["bad"].append(k.hex())
    have = set(k for k, hit in zip(on_disk, found) if hit)
    report["missing"] += [k.hex() for k in flushed if k not in have]
    report["found"] += len(have)
    report["flushed"] += len(flushed)
    report["corrupt"] += store.stats().corrupt
    report["tmp_after_restart"] += len(glob.glob(os.path.join(path, "*", "*", ".*.tmp")))
    store.close()
    if trial % 10 == 9:  # a fresh directory now and then: the checks above stay quick
        for p in glob.glob(os.path.join(path, "*", "*", "*.kvb")) + glob.glob(progress):
            os.unlink(p)
print(json.dumps(report))
"""
    r = run_python(code, str(tmp_path), "50", "1234", timeout=240)
    assert r["trials"] == 50
    assert r["bad"] == [] and r["corrupt"] == 0, r
    assert r["missing"] == [], r
    assert r["tmp_after_restart"] == 0, r
    assert r["found"] >= r["flushed"] > 0
    # the kills landed inside writes (else the test would prove little)
    assert r["tmp_before_restart"] > 0, r


def test_another_process_reads_what_one_flushed(tmp_path, rng):
    n, row = 40, 70000
    keys = [rng.bytes(16) for _ in range(n)]
    rows = rng.integers(0, 256, (n, row), dtype=np.uint8)
    store = FileStore(tmp_path, namespace="model-a", threads=3)
    store.bind(LAYOUT, row)
    store.put(keys, list(rows)).result(timeout=60)
    store.flush()  # not closed: the other process reads while this one still runs
    np.save(tmp_path / "rows.npy", rows)
    (tmp_path / "keys.txt").write_text(" ".join(k.hex() for k in keys))
    code = """
import json, sys
import numpy as np
from jax_kvxfer.stores import FileStore
path = sys.argv[1]
rows = np.load(path + "/rows.npy")
keys = [bytes.fromhex(h) for h in open(path + "/keys.txt").read().split()]
absent = [bytes(16), b"\\xff" * 16]
report = {}
for ns in ("model-a", "model-b"):
    s = FileStore(path, namespace=ns)
    s.bind(("faults", 1), rows.shape[1])
    out = np.zeros((len(keys) + 2, rows.shape[1]), np.uint8)
    found = s.get(keys + absent, list(out)).result()
    report[ns] = {"lookup": s.lookup(keys), "found": found,
                  "equal": bool(np.array_equal(out[:len(keys)], rows)),
                  "absent_untouched": bool(not out[len(keys):].any())}
    s.close()
print(json.dumps(report))
"""
    r = run_python(code, str(tmp_path))
    assert r["model-a"] == {"lookup": n, "found": [True] * n + [False, False], "equal": True,
                            "absent_untouched": True}
    assert r["model-b"]["lookup"] == 0 and r["model-b"]["found"] == [False] * (n + 2)
    store.close()


def test_file_size_limit_drops_writes_and_serving_goes_on(tmp_path):
    """RLIMIT_FSIZE in a subprocess (SIGXFSZ ignored): writing a file past it fails with
    EFBIG, a real failing write. Blocks of 16 KiB fit the limit, blocks of 64 KiB do not."""
    code = ROW_OF_KEY + """
import glob, json, os, resource, signal, sys
from jax_kvxfer.stores import FileStore
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40 * 1024, 40 * 1024))
report = {}
for ns, row in (("small", 16384), ("big", 65536)):
    for direct in (None, False):
        s = FileStore(path, namespace=f"{ns}-{direct}", direct_io=direct, threads=2)
        s.bind(("faults", 1), row)
        keys = [key_of(ns, direct, i) for i in range(12)]
        s.put(keys, [row_of(k, row) for k in keys]).result()
        s.flush()
        stats = s.stats()
        out = np.zeros((12, row), np.uint8)
        found = s.get(keys, list(out)).result()
        ok = all(np.array_equal(o, row_of(k, row)) for k, o, h in zip(keys, out, found) if h)
        report[f"{ns}-{direct}"] = {
            "written": stats.written, "dropped": stats.dropped_writes, "found": sum(found),
            "lookup": s.lookup(keys), "bit_exact": ok,
            "files": len(glob.glob(os.path.join(s.dir, "*", "*"))),
            "tmp": len(glob.glob(os.path.join(s.dir, "*", ".*")))}
        s.close()
print(json.dumps(report))
"""
    r = run_python(code, str(tmp_path))
    for direct in ("None", "False"):
        assert r[f"small-{direct}"] == {"written": 12, "dropped": 0, "found": 12, "lookup": 12,
                                        "bit_exact": True, "files": 12, "tmp": 0}, r
        assert r[f"big-{direct}"] == {"written": 0, "dropped": 12, "found": 0, "lookup": 0,
                                      "bit_exact": True, "files": 0, "tmp": 0}, r


@contextlib.contextmanager
def mounted(args: list[str], target: str):
    """`mount ARGS target` for the block, or a skip with the reason."""
    os.makedirs(target, exist_ok=True)
    proc = subprocess.run(["mount", *args, target], check=False, capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount here (needs root and CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


def test_a_full_file_system_drops_writes_and_serving_goes_on(tmp_path, rng):
    """A 1 MiB tmpfs: the first blocks fit, the rest find the disk full (ENOSPC); put and flush
    never raise, the blocks written read back bit-exact, the dropped ones are misses, and
    once space is freed (a capacity bound of a new store evicting) writes succeed again."""
    with mounted(["-t", "tmpfs", "-o", "size=1m", "tmpfs"], str(tmp_path / "tiny")) as path:
        row = 65536  # 68 KiB per file: about 14 fit
        keys = [rng.bytes(16) for _ in range(40)]
        rows = rng.integers(0, 256, (40, row), dtype=np.uint8)
        store = FileStore(path, namespace="m", threads=2)
        store.bind(LAYOUT, row)
        for i in range(0, 40, 8):  # in batches, as a server would
            store.put(keys[i:i + 8], list(rows[i:i + 8])).result(timeout=60)
        store.flush()
        s = store.stats()
        assert s.written + s.dropped_writes == 40
        assert 5 <= s.written <= 16 and s.dropped_writes >= 24, s
        out = np.zeros_like(rows)
        found = store.get(keys, list(out)).result(timeout=60)
        assert sum(found) == s.written
        for k, o, r, hit in zip(keys, out, rows, found):
            if hit:
                np.testing.assert_array_equal(o, r)
        assert store.lookup([k for k, h in zip(keys, found) if h]) == s.written
        assert not glob.glob(os.path.join(store.dir, "*", ".*.tmp"))
        store.close()
        # a store bounded below the free space: evictions make room, writes go through
        bounded = FileStore(path, namespace="m", capacity_bytes=4 * 69632)
        bounded.bind(LAYOUT, row)
        for i in range(0, 8, 2):  # a batch no larger than the capacity (writes in flight stay)
            bounded.put(keys[i:i + 2], list(rows[i:i + 2])).result(timeout=60)
            bounded.flush()
        s = bounded.stats()
        assert s.dropped_writes == 0 and s.evicted > 0
        found = bounded.get(keys[:8], list(out[:8])).result(timeout=60)
        assert found == [False] * 4 + [True] * 4
        np.testing.assert_array_equal(out[4:8], rows[4:8])
        bounded.close()


def test_a_read_only_directory_drops_writes_and_reads_go_on(tmp_path, rng):
    """The directory remounted read-only (a bind mount) under a running store: puts are
    dropped (EROFS), flush does not raise, blocks written before still read back."""
    row = 8192
    keys = [rng.bytes(16) for _ in range(12)]
    rows = rng.integers(0, 256, (12, row), dtype=np.uint8)
    path = str(tmp_path / "dir")
    os.makedirs(path)
    store = FileStore(path, namespace="m", threads=2)
    store.bind(LAYOUT, row)
    store.put(keys[:6], list(rows[:6])).result(timeout=60)
    store.flush()
    with mounted(["--bind", path], path):
        proc = subprocess.run(["mount", "-o", "remount,ro,bind", path], check=False,
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot remount read-only: {proc.stderr.strip()}")
        store.stats()
        store.put(keys[6:], list(rows[6:])).result(timeout=60)
        store.flush()
        s = store.stats()
        assert (s.written, s.dropped_writes) == (0, 6)
        out = np.zeros_like(rows)
        found = store.get(keys, list(out)).result(timeout=60)
        assert found == [True] * 6 + [False] * 6
        np.testing.assert_array_equal(out[:6], rows[:6])
        assert store.lookup(keys) == 6
        with pytest.raises(ValueError, match="path must be a writable directory"):
            FileStore(path, namespace="m")
        store.close()
