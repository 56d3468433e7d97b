"""Probe (issue 57, item 4): the fastest way to a zero-filled `pinned_host` jax.Array of N bytes.

    python3 scripts/pin_probe.py 8 32            # sizes in GiB (floats allowed)
    python3 scripts/pin_probe.py 8 --only register,register_par --timeout 60 --budget 230

Each candidate runs in a fresh subprocess (`--child NAME NBYTES`) under a timeout and inside a
total budget; a failing candidate prints its error and the next one runs. Per candidate: seconds
from "JAX initialised" to "array ready", GB/s, growth of VmRSS / VmHWM and the drop of the
system's MemAvailable (pinned pages the driver allocates itself are not in RSS), then checks done
outside the timed part: memory kind, zero bytes (sampled), H2D GB/s of a 1 GiB view straddling
the middle of the buffer (pinned ~50 GB/s, pageable far less), and the library's FFI copy
(`copy_blocks`, kernel and copy engines, donated: is it in place?) into and out of a 64 MiB view
straddling the middle. The first four candidates run at every size, first; the slow references
(known ~1.4 GB/s) only at sizes <= 8 GiB unless --all-sizes or --only names them.

Candidates (pin_notes.md gives the evidence):
  xla_device_put  today's path: jax.device_put(np.zeros) -> XLA's host BFC -> cuMemHostAlloc
  cuda_host_alloc one cuMemHostAlloc(PORTABLE) of N (what XLA's allocator does), then imported
  register        mmap + MADV_HUGEPAGE + 16-thread MADV_POPULATE_WRITE + one cuMemHostRegister,
                  imported zero-copy with jax.dlpack.from_dlpack (kDLCUDAHost -> pinned_host)
  register_par    as register, but 16 registrations of N/16 made by 16 threads
  register_4k     as register with MADV_NOHUGEPAGE (the cost of 4 KiB pages)
  host_alloc_par  16 threads x cuMemHostAlloc(N/16): a pool of 16 arrays
  xla_parallel    8 threads x jax.device_put(np.zeros(N/8)): does XLA allocate in parallel?
  torch_register  torch pin_memory with pinned_use_cuda_host_register (16 threads) + zero_,
                  then jax.dlpack.from_dlpack (PyTorch's own fast path, as a reference)
  xla_preallocate XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true (the cost moves into client start)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

GiB = 1 << 30
BLOCK = 2 << 20  # pool rows: 2 MiB blocks [32 layers, 2, 8 heads, 16 tokens, 128] bf16
BLOCK_SHAPE = (32, 2, 8, 16, 128)
THREADS = min(16, os.cpu_count() or 1)

# name -> (largest size in GiB it runs at by default, what it is)
CANDIDATES = {
    "register": (1e9, "mmap+THP+16-thread populate, one cuMemHostRegister, dlpack"),
    "register_par": (1e9, "as register, 16 registrations from 16 threads"),
    "torch_register": (1e9, "torch pin_memory via cudaHostRegister, 16 threads"),
    "xla_device_put": (8, "device_put(np.zeros) (today's pool path)"),
    "cuda_host_alloc": (8, "one cuMemHostAlloc, dlpack"),
    "register_4k": (1e9, "as register without THP"),
    "host_alloc_par": (8, "16 threads x cuMemHostAlloc(N/16): 16 arrays"),
    "xla_parallel": (8, "8 threads x device_put(np.zeros(N/8)): 8 arrays"),
    "xla_preallocate": (8, "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true"),
}


# ---------------------------------------------------------------------------------------------
# memory facts


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError as e:
        return f"unknown ({e})"


# ---------------------------------------------------------------------------------------------
# CUDA driver through ctypes (ctypes drops the GIL during each call, so threads run in parallel)


class Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        L = self.lib
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
            "cuMemHostUnregister": [ctypes.c_void_p],
            "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
            "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                             ctypes.c_uint],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }.items():
            getattr(L, name).argtypes = args
            getattr(L, name).restype = ctypes.c_int
        self.check(L.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(L.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.check(L.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "ctx retain")
        self.bind()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: CUresult {rc} {name.value!r}")

    def bind(self) -> None:
        """Makes JAX's (the primary) context current on this thread."""
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def register(self, ptr: int, nbytes: int) -> None:
        # PORTABLE (all contexts) | DEVICEMAP (kernels may read it at the same address)
        self.check(self.lib.cuMemHostRegister_v2(ptr, nbytes, 0x1 | 0x2), "cuMemHostRegister")

    def host_alloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self.check(self.lib.cuMemHostAlloc(ctypes.byref(p), nbytes, 0x1 | 0x2),
                   "cuMemHostAlloc")
        return p.value

    def device_pointer(self, ptr: int) -> int:
        d = ctypes.c_uint64()
        self.check(self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ptr, 0),
                   "cuMemHostGetDevicePointer")
        return d.value


def parallel(fn, items, threads: int = THREADS) -> None:
    """fn(item) for each item on `threads` threads; re-raises the first error."""
    errors: list[BaseException] = []
    items = list(items)

    def work(chunk):
        try:
            for it in chunk:
                fn(it)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    ts = [threading.Thread(target=work, args=(items[i::threads],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# anonymous memory, first touched by many threads


libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23


def mmap_touched(nbytes: int, huge: bool, facts: dict) -> int:
    """A 2 MiB-aligned anonymous mapping of nbytes, every page faulted in (zeroed by the kernel)
    by THREADS threads. Returns its address."""
    raw = libc.mmap(None, nbytes + BLOCK, 3, 0x22 | 0x4000, -1, 0)  # RW, PRIVATE|ANON|NORESERVE
    if raw in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    ptr = (raw + BLOCK - 1) // BLOCK * BLOCK
    if libc.madvise(ptr, nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE) != 0:
        facts["madvise_huge_errno"] = ctypes.get_errno()
    chunk = max(BLOCK, (nbytes // (THREADS * 8)) // BLOCK * BLOCK)  # 8 pieces a thread
    pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
    populate = [True]

    def touch(piece):
        off, n = piece
        if populate[0] and libc.madvise(ptr + off, n, MADV_POPULATE_WRITE) == 0:
            return
        populate[0] = False  # kernel < 5.14: write one byte a page instead
        import numpy as np
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr + off))
        view[::4096] = 0  # NumPy drops the GIL for this loop

    t = time.perf_counter()
    parallel(touch, pieces)
    facts["t_touch"] = time.perf_counter() - t
    facts["populate"] = "MADV_POPULATE_WRITE" if populate[0] else "numpy stride writes"
    return ptr


# ---------------------------------------------------------------------------------------------
# zero-copy import: a DLPack capsule over memory we own, advertised as kDLCUDAHost


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
KEEP_ALIVE: list = []  # the structs jax read; the memory itself lives until the process ends
# JAX calls the deleter when its buffer dies (an empty one aborts: std::bad_function_call), maybe
# from one of its own threads: ctypes takes the GIL there. Nothing to free: we own the memory.
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
kDLCPU, kDLCUDAHost = 1, 3
kDLBfloat, kDLUInt = 4, 1


class HostBuffer:
    """`__dlpack__` over raw memory; a no-op deleter: the owner keeps the memory alive."""

    def __init__(self, ptr: int, shape: tuple[int, ...], device_type: int) -> None:
        self.device_type = device_type
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        t = DLManagedTensor()
        t.dl_tensor.data = ptr
        t.dl_tensor.device = DLDevice(device_type, 0)
        t.dl_tensor.ndim = len(shape)
        t.dl_tensor.dtype = DLDataType(kDLBfloat, 16, 1)
        t.dl_tensor.shape = self.shape
        t.dl_tensor.strides = None
        t.dl_tensor.byte_offset = 0
        t.manager_ctx = None
        t.deleter = ctypes.cast(DELETER, ctypes.c_void_p)
        self.tensor = t
        KEEP_ALIVE.append(self)

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return ctypes.pythonapi.PyCapsule_New(ctypes.addressof(self.tensor), b"dltensor", None)


def import_pinned(ptr: int, nbytes: int, on_gpu: bool):
    """A jax.Array over [ptr, ptr+nbytes) without a copy: memory kind pinned_host on a GPU
    (jax >= 0.10.2 maps kDLCUDAHost to the pinned_host memory space, jaxlib/dlpack.cc)."""
    import jax
    shape = (nbytes // BLOCK, *BLOCK_SHAPE) if nbytes % BLOCK == 0 else (nbytes // 2,)
    # copy=False: fail loudly rather than fall back to a copy through XLA's allocator
    return jax.dlpack.from_dlpack(HostBuffer(ptr, shape, kDLCUDAHost if on_gpu else kDLCPU),
                                  copy=False)


# ---------------------------------------------------------------------------------------------
# candidates (child side): each returns (list of arrays, facts); its time is what run() measures


def pool_shape(nbytes: int) -> tuple[int, ...]:
    return (nbytes // BLOCK, *BLOCK_SHAPE)


def pinned_sharding(jax):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def c_register(nbytes, on_gpu, facts, *, huge=True, pieces=1):
    ptr = mmap_touched(nbytes, huge, facts)
    t = time.perf_counter()
    if on_gpu:
        drv = Driver()
        step = nbytes // pieces // BLOCK * BLOCK
        spans = [(i * step, step if i < pieces - 1 else nbytes - i * step) for i in range(pieces)]

        def reg(span):
            drv.bind()
            drv.register(ptr + span[0], span[1])
        parallel(reg, spans, threads=min(pieces, THREADS))
        facts["registrations"] = pieces
        facts["same_address_on_gpu"] = drv.device_pointer(ptr) == ptr
    else:
        facts["register"] = "skipped (no CUDA)"
    facts["t_register"] = time.perf_counter() - t
    t = time.perf_counter()
    arr = import_pinned(ptr, nbytes, on_gpu)
    facts["t_import"] = time.perf_counter() - t
    facts["ptr"] = ptr
    return [arr]


def c_cuda_host_alloc(nbytes, on_gpu, facts):
    drv = Driver()
    ptr = drv.host_alloc(nbytes)
    facts["ptr"] = ptr
    return [import_pinned(ptr, nbytes, on_gpu)]


def c_host_alloc_par(nbytes, on_gpu, facts, k=16):
    drv = Driver()
    part = nbytes // k // BLOCK * BLOCK
    ptrs = [0] * k

    def alloc(i):
        drv.bind()
        ptrs[i] = drv.host_alloc(part)
    parallel(alloc, range(k), threads=k)
    facts["arrays"] = k
    facts["ptr"] = ptrs[0]
    return [import_pinned(p, part, on_gpu) for p in ptrs]


def c_xla_device_put(nbytes, on_gpu, facts):
    import jax
    import ml_dtypes
    import numpy as np
    return [jax.device_put(np.zeros(pool_shape(nbytes), ml_dtypes.bfloat16), pinned_sharding(jax))]


def c_xla_parallel(nbytes, on_gpu, facts, k=8):
    import jax
    import ml_dtypes
    import numpy as np
    out = [None] * k
    sh = pinned_sharding(jax)

    def put(i):
        out[i] = jax.device_put(np.zeros(pool_shape(nbytes // k), ml_dtypes.bfloat16), sh)
        out[i].block_until_ready()
    parallel(put, range(k), threads=k)
    facts["arrays"] = k
    return out


def c_torch_register(nbytes, on_gpu, facts):
    import jax
    import torch
    t = time.perf_counter()
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    facts["t_pin"] = time.perf_counter() - t
    t = time.perf_counter()
    x.zero_()
    facts["t_zero"] = time.perf_counter() - t
    facts["torch_threads"] = torch.get_num_threads()
    x = x.view(pool_shape(nbytes))
    KEEP_ALIVE.append(x)
    facts["ptr"] = x.data_ptr()
    return [jax.dlpack.from_dlpack(x, copy=False)]


CHILD = {
    "register": lambda n, g, f: c_register(n, g, f),
    "register_par": lambda n, g, f: c_register(n, g, f, pieces=16),
    "register_4k": lambda n, g, f: c_register(n, g, f, huge=False),
    "cuda_host_alloc": c_cuda_host_alloc,
    "host_alloc_par": c_host_alloc_par,
    "xla_device_put": c_xla_device_put,
    "xla_preallocate": c_xla_device_put,
    "xla_parallel": c_xla_parallel,
    "torch_register": c_torch_register,
}
NEEDS_CUDA = {"register_par", "cuda_host_alloc", "host_alloc_par", "xla_device_put",
              "xla_preallocate", "xla_parallel", "torch_register"}


# ---------------------------------------------------------------------------------------------
# checks after the timed part


def check_zero(arr, facts) -> None:
    import numpy as np
    n = arr.nbytes
    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(arr.unsafe_buffer_pointer()))
    sample = view[::65521]  # a prime stride: every page region, cheap
    facts["zero_sampled"] = bool(not sample.any()) and not view[-4096:].any()


def check_h2d(arr, on_gpu, facts) -> None:
    """GB/s of device_put of a 1 GiB view around the middle (across the register_par split)."""
    import jax
    n = min(GiB, arr.nbytes // 2) // BLOCK * BLOCK
    if not on_gpu or n == 0:
        return
    start = (arr.nbytes // 2 - n // 2) // BLOCK * BLOCK
    best = 0.0
    for _ in range(3):
        view = import_pinned(arr.unsafe_buffer_pointer() + start, n, on_gpu)
        t = time.perf_counter()
        d = jax.device_put(view, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        d.block_until_ready()
        best = max(best, n / (time.perf_counter() - t) / 1e9)
        del d
    facts["h2d_mid_GBps"] = round(best, 1)


def check_ffi(arr, on_gpu, facts) -> None:
    """The library's copies (kernel, then copy engines), donated, into and back out of blocks of
    a 64 MiB view straddling the middle of the buffer (across register_par's split). A view,
    not the whole buffer: where JAX does not alias a donated foreign buffer it copies the pool,
    which at 32 GiB would go through XLA's slow allocator."""
    if not on_gpu:
        return
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        import jax_kvxfer as kvx
    except Exception as e:  # noqa: BLE001
        facts["ffi"] = f"skipped: {type(e).__name__}: {e}"[:200]
        return
    nb = 32
    start = (arr.nbytes // 2 - nb * BLOCK // 2) // BLOCK * BLOCK
    ptr = arr.unsafe_buffer_pointer() + start
    host = import_pinned(ptr, nb * BLOCK, on_gpu)
    dst_idx = np.array([0, 1, 15, 16, 17, 30, 31])
    k = len(dst_idx)
    src = jax.device_put(jax.random.normal(jax.random.key(0), (k, *BLOCK_SHAPE), jnp.bfloat16),
                         jax.devices()[0])
    result = []
    for dma in (False, True):
        try:
            host = kvx.copy_blocks(host, src, np.arange(k), dst_idx, donate=True, dma=dma)
            back = kvx.copy_blocks(jnp.zeros_like(src), host, dst_idx, np.arange(k), dma=dma)
            ok = bool(jnp.array_equal(back, src))
            same = host.unsafe_buffer_pointer() == ptr
            result.append(f"dma={dma}: {'exact' if ok else 'WRONG'}, "
                          f"{'in place' if same else 'NOT in place (donation copied)'}")
            src = src * 2
        except Exception as e:  # noqa: BLE001
            result.append(f"dma={dma}: {type(e).__name__}: {str(e)[:160]}")
            break
    facts["ffi"] = "; ".join(result)


def child(name: str, nbytes: int) -> None:
    facts: dict = {"candidate": name, "nbytes": nbytes}
    if name == "torch_register":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
            f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{THREADS}")
    if name == "xla_preallocate":
        os.environ["XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"] = "true"
        os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(-(-nbytes // GiB) + 1)
    t = time.perf_counter()
    import jax
    import jax.numpy as jnp
    on_gpu = jax.devices()[0].platform == "gpu"
    jnp.zeros(8).block_until_ready()  # CUDA context, XLA client up
    facts["t_init"] = time.perf_counter() - t
    facts["platform"] = jax.devices()[0].platform
    if name in NEEDS_CUDA and not on_gpu:
        facts["status"] = "skipped: needs CUDA"
        print("RESULT " + json.dumps(facts), flush=True)
        return
    before, avail0 = proc_status(), mem_available()
    t = time.perf_counter()
    arrays = CHILD[name](nbytes, on_gpu, facts)
    for a in arrays:
        a.block_until_ready()
    dt = time.perf_counter() - t
    after, avail1 = proc_status(), mem_available()
    a = arrays[0]
    facts.update(
        status="ok", seconds=round(dt, 3), GBps=round(nbytes / dt / 1e9, 2),
        rss_x=round((after["VmRSS"] - before["VmRSS"]) / nbytes, 3),
        hwm_x=round((after["VmHWM"] - before["VmHWM"]) / nbytes, 3),
        sys_x=round((avail0 - avail1) / nbytes, 3),
        memory_kind=str(a.sharding.memory_kind), total_bytes=sum(x.nbytes for x in arrays),
        zero_copy=(a.unsafe_buffer_pointer() == facts["ptr"]) if "ptr" in facts else None,
    )
    print("TIMED " + json.dumps(facts), flush=True)  # survives a crash in the checks
    for check in (lambda: check_zero(a, facts), lambda: check_h2d(a, on_gpu, facts),
                  lambda: check_ffi(a, on_gpu, facts)):
        try:
            check()
        except Exception as e:  # noqa: BLE001
            facts.setdefault("check_errors", []).append(f"{type(e).__name__}: {str(e)[:160]}")
    facts.pop("ptr", None)
    print("RESULT " + json.dumps(facts), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown of JAX's buffers over memory this process is about to drop


# ---------------------------------------------------------------------------------------------
# parent


def last_json(text: str, tag: str):
    for line in reversed(text.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return None


def row(size_gib: float, name: str, r: dict) -> str:
    keys = ("t_init", "t_touch", "t_register", "t_import", "t_pin", "t_zero", "populate",
            "registrations", "arrays", "same_address_on_gpu", "zero_sampled", "zero_copy",
            "h2d_mid_GBps", "memory_kind", "ffi", "check_errors")
    head = (f"{size_gib:>6g} GiB  {name:<16} {r.get('status', '?'):<8}")
    if r.get("status") == "ok":
        head += (f" {r['seconds']:8.2f} s {r['GBps']:7.2f} GB/s  RSS x{r['rss_x']:.3f}"
                 f"  HWM x{r['hwm_x']:.3f}  MemAvail x{r['sys_x']:.3f}")
    rest = ", ".join(f"{k}={round(r[k], 3) if isinstance(r[k], float) else r[k]}"
                     for k in keys if k in r)
    return head + ("\n" + " " * 12 + rest if rest else "")


def run_child(name: str, nbytes: int, limit: float, env: dict) -> dict:
    """One candidate in a fresh process; its result, or what went wrong, never an exception."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, str(nbytes)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env,
                           check=False)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {limit:.0f} s", None
    except OSError as e:
        out, err, rc = "", f"could not start: {e}", -1
    r = last_json(out, "RESULT") or last_json(out, "TIMED")
    if r is None:
        tail = " | ".join((err or "").strip().splitlines()[-3:])[-400:]
        r = {"status": "failed" if rc is not None else "timeout", "rc": rc,
             "check_errors": [tail]}
    elif rc not in (0, None) or last_json(out, "RESULT") is None:
        r.setdefault("check_errors", []).append(
            f"child ended rc={rc} after the timed part: "
            + " | ".join((err or "").strip().splitlines()[-2:])[-300:])
    r["wall"] = round(time.perf_counter() - t, 1)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=float, default=[8.0, 32.0], help="GiB")
    ap.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    ap.add_argument("--all-sizes", action="store_true",
                    help="run the slow candidates at every size too")
    ap.add_argument("--timeout", type=float, default=75.0, help="seconds per candidate")
    ap.add_argument("--budget", type=float, default=225.0, help="seconds in all")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "NBYTES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))

    names = [n for n in (args.only.split(",") if args.only else CANDIDATES) if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        sys.exit(f"--only: unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    start = time.perf_counter()
    print(f"pin_fast: sizes {args.sizes} GiB, THP {thp_mode()!r}, {os.cpu_count()} cores, "
          f"MemAvailable {mem_available() / GiB:.1f} GiB, kernel {os.uname().release}, "
          f"budget {args.budget:.0f} s", flush=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="2")
    results = []
    # the candidates that may reach the target first, at every size; then the slow references
    plan = [(CANDIDATES[n][0] < 1e9, size, n) for n in names for size in args.sizes
            if size <= CANDIDATES[n][0] or args.all_sizes or args.only]
    for slow, size, name in sorted(plan, key=lambda p: (p[0], p[1])):
        nbytes = int(size * GiB) // BLOCK * BLOCK
        left = args.budget - (time.perf_counter() - start)
        if left < 15:
            print(f"{size:>6g} GiB  {name:<16} skipped: {left:.0f} s of the budget left",
                  flush=True)
            continue
        if nbytes > mem_available() * 0.9:
            print(f"{size:>6g} GiB  {name:<16} skipped: not enough MemAvailable", flush=True)
            continue
        limit = min(args.timeout, left, 45.0 if slow else left)
        r = run_child(name, nbytes, limit, env)
        r.update(size_gib=size, candidate=name)
        results.append(r)
        print(row(size, name, r), flush=True)
    print(f"pin_fast: done in {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
