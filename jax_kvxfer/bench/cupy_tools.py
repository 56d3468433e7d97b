"""cupy side of the benchmark: memcpy buffers, the TensorRT-LLM-style kernel, spin-kernel timing."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .config import MiB
from .helpers import clamp, err_text

# A scalar partial-copy kernel in the style TensorRT-LLM uses (written here, not copied): one
# element per thread, 32-bit flat index, launched once per block.
_TRT_STYLE_KERNEL = r"""
extern "C" __global__ void trt_style_partial_copy(const unsigned short* __restrict__ src,
                                                  unsigned short* __restrict__ dst,
                                                  int outer, int tokens, int n, int d) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int per_outer = n * d;
  if (i >= outer * per_outer) return;
  int o = i / per_outer;
  int r = i - o * per_outer;          // t * d + e, within the first n rows of run o
  int off = o * tokens * d + r;
  dst[off] = src[off];
}
"""

# Holds the stream for `ns` nanoseconds so that the work queued behind it is timed on the GPU
# alone, not at the pace Python enqueues it.
_SPIN_KERNEL = r"""
extern "C" __global__ void kvx_bench_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class CupyTools:
    """cupy buffers (an arena reused by every size), streams, kernels and event timing."""

    def __init__(self, cp: Any = None, device_id: int = 0) -> None:
        if cp is None:
            import cupy as cp

        self.cp = cp
        self.rt = cp.cuda.runtime
        if self.rt.getDeviceCount() < 1:
            raise RuntimeError("cupy sees no CUDA device")
        self.version = cp.__version__
        # JAX can leave another GPU current on this thread (after running on a multi-device
        # mesh); cupy's streams, events and kernels belong to the device current when they are
        # made or used, so everything here runs inside `with self.device`.
        self.device = cp.cuda.Device(device_id)
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.stream2 = cp.cuda.Stream(non_blocking=True)
        self.arena_bytes = 0
        self.arena_hint = 0  # allocate once, for the largest user of the run
        self.buffers: dict[str, tuple[str, Any, int]] = {}
        self._kernels: dict[str, Any] = {}
        self.spin_error: str | None = None

    # buffers: dev_a/dev_b device, host_a/host_b pinned; dev_a holds a pattern, host_a a copy.
    def ensure_arena(self, nbytes: int) -> None:
        nbytes = max(nbytes, self.arena_hint)
        if nbytes <= self.arena_bytes:
            return
        with self.device:
            self._allocate_arena(nbytes)

    def _allocate_arena(self, nbytes: int) -> None:
        cp = self.cp
        self.buffers.clear()
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        nbytes = -(-nbytes // MiB) * MiB
        dev_a = cp.empty(nbytes, dtype=cp.uint8)
        dev_b = cp.empty(nbytes, dtype=cp.uint8)
        host_a = cp.cuda.alloc_pinned_memory(nbytes)
        host_b = cp.cuda.alloc_pinned_memory(nbytes)
        # A pattern written by numpy into host_a, then copied to dev_a: no cupy kernel (NVRTC)
        # needed for the memcpy paths. Every MiB differs (a per-MiB offset), so a block copied
        # from the wrong place does not compare equal.
        view = np.frombuffer(host_a, np.uint16, nbytes // 2).reshape(-1, MiB // 2)
        pattern = np.random.default_rng(1).integers(0, 1 << 16, MiB // 2, dtype=np.uint16)
        np.add(pattern[None, :], np.arange(view.shape[0], dtype=np.uint16)[:, None], out=view)
        self.memcpy(dev_a.data.ptr, host_a.ptr, nbytes, self.stream)
        dev_b.data.memset_async(0, nbytes, self.stream)
        self.stream.synchronize()
        self.buffers = {"dev_a": ("device", dev_a, dev_a.data.ptr),
                        "dev_b": ("device", dev_b, dev_b.data.ptr),
                        "host_a": ("pinned", host_a, host_a.ptr),
                        "host_b": ("pinned", host_b, host_b.ptr)}
        self.arena_bytes = nbytes

    def ptr(self, name: str) -> int:
        return self.buffers[name][2]

    def read(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        kind, obj, _ = self.buffers[name]
        if kind == "device":
            with self.device:
                return self.cp.asnumpy(obj[offset:offset + nbytes])
        return np.frombuffer(obj, np.uint8, self.arena_bytes)[offset:offset + nbytes].copy()

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, self.rt.memcpyDefault, stream.ptr)

    def kernel(self, name: str) -> Any:
        if name not in self._kernels:
            src = {"trt_style_partial_copy": _TRT_STYLE_KERNEL, "kvx_bench_spin": _SPIN_KERNEL}[name]
            self._kernels[name] = self.cp.RawKernel(src, name)
        return self._kernels[name]

    def spin(self, stream: Any, ns: int) -> bool:
        if self.spin_error is not None:
            return False
        try:
            with self.device:
                self.kernel("kvx_bench_spin")((1,), (1,), (np.uint64(ns),), stream=stream)
            return True
        except Exception as e:  # noqa: BLE001 - no NVRTC etc.: fall back to plain events
            self.spin_error = err_text(e)
            return False

    def time_ops(self, enqueue: Callable[[Any], None], *, reps: int, samples: int, warmup: int,
                 gpu_only: bool) -> tuple[list[float], dict[str, Any]]:
        """Seconds per enqueue() call, from events around `reps` calls on self.stream.

        gpu_only: the calls are queued behind a spin kernel so the events time the GPU alone
        (the spin is lengthened when Python's enqueue outlasts it)."""
        with self.device:
            return self._time_ops(enqueue, reps=reps, samples=samples, warmup=warmup,
                                  gpu_only=gpu_only)

    def _time_ops(self, enqueue: Callable[[Any], None], *, reps: int, samples: int, warmup: int,
                  gpu_only: bool) -> tuple[list[float], dict[str, Any]]:
        cp, s = self.cp, self.stream
        start, end = cp.cuda.Event(), cp.cuda.Event()
        info: dict[str, Any] = {"reps": reps, "gpu_only": False}

        def one(spin_ns: int) -> tuple[float, float, bool]:
            spun = gpu_only and self.spin(s, spin_ns)
            t0 = time.perf_counter()
            start.record(s)
            for _ in range(reps):
                enqueue(s)
            end.record(s)
            t_enq = time.perf_counter() - t0
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps, t_enq, spun

        one(0)  # warm-up (the first call of a kernel compiles it)
        _, t_enq, _ = one(0)  # measures the enqueue time
        spin_ns = clamp(3 * t_enq * 1e9, 1_000_000, 500_000_000)
        for _ in range(warmup):
            one(spin_ns)
        times, suspect = [], 0
        for _ in range(samples):
            t, t_enq, spun = one(spin_ns)
            if spun and t_enq * 1e9 > 0.7 * spin_ns:  # enqueue may have overrun the spin
                suspect += 1
                spin_ns = min(2 * spin_ns, 2_000_000_000)
                t, t_enq, spun = one(spin_ns)
            times.append(t)
            info["gpu_only"] = spun
        if gpu_only:
            info["spin_ns"] = spin_ns
            info["spin_overrun_retries"] = suspect
            if self.spin_error:
                info["note"] = "spin kernel unavailable, events include enqueue: " + self.spin_error
        return times, info

    def concurrent_memcpy(self, device_ids: list[int], nbytes: int, to_host: bool,
                          samples: int) -> list[float]:
        """Seconds for one contiguous memcpy of `nbytes` on every listed GPU at once (each GPU
        between its own buffers and its own pinned host buffer, on its own stream): the
        multi-GPU ceiling for the sharded section. Wall time from the first enqueue to the
        last synchronize (enqueueing a few copies costs microseconds against milliseconds)."""
        cp, per_device = self.cp, []
        for i in device_ids:
            with cp.cuda.Device(i):
                per_device.append((cp.empty(nbytes, dtype=cp.uint8),
                                   cp.cuda.alloc_pinned_memory(nbytes),
                                   cp.cuda.Stream(non_blocking=True)))

        def once() -> float:
            t0 = time.perf_counter()
            for dev, host, stream in per_device:
                dst, src = (host.ptr, dev.data.ptr) if to_host else (dev.data.ptr, host.ptr)
                self.memcpy(dst, src, nbytes, stream)
            for _, _, stream in per_device:
                stream.synchronize()
            return time.perf_counter() - t0

        once()
        times = [once() for _ in range(samples)]
        per_device.clear()
        gc.collect()
        return times
