"""The bench's core: the same-run ceilings, timing, pools, logging and the JSON document.

Ceilings: with cupy (GPUs), one contiguous cudaMemcpyAsync of the same bytes, GPU time between
CUDA events, queued behind a spin kernel so that Python's enqueue is not counted; without it,
one contiguous `jax.device_put` (a jitted copy device to device), wall time. Every figure is the
median of `--repeats` samples after the compiling call and `--warmup` more, each sample waiting
for the device (`jax.block_until_ready`, the manager's `sync_transfers`)."""

from __future__ import annotations

import cProfile
import datetime
import functools
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import DTYPE, Config, MiB

# Holds the stream for `ns` nanoseconds, so that the copies queued behind it run at the GPU's pace.
_SPIN = r"""extern "C" __global__ void kvx_bench_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""

COMPILES = [0]  # XLA compilations while the bench runs (counted through jax.monitoring)


def count_compiles(event: str, *args: Any, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def by_own_time(prof: cProfile.Profile, top: int) -> list[tuple[str, int, float]]:
    """The `top` functions of a profile by their own time: ("file:line(name)", calls, own
    seconds)."""
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{fn.rsplit(os.sep, 1)[-1]}:{line}({name})", nc, tt)
            for (fn, line, name), (_, nc, tt, _, _) in rows]


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1500]


def block_on(tree: Any) -> None:
    jax.block_until_ready([x for x in jax.tree.leaves(tree)
                           if isinstance(x, jax.Array) and not x.is_deleted()])


def device_name(dev: Any) -> str:
    if dev.platform != "cpu":
        return str(getattr(dev, "device_kind", dev.platform))
    try:
        with open("/proc/cpuinfo") as f:
            return "cpu: " + next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu: " + (platform.processor() or platform.machine())


@functools.cache
def _random_bits(shape: tuple[int, ...], sharding: Any) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda key: jax.lax.bitcast_convert_type(
        jax.random.bits(key, shape, jnp.uint16) & 0xBFFF, DTYPE), out_shardings=sharding)


class Cupy:
    """cupy's cudaMemcpyAsync between buffers reused by every ceiling (a, b on the device; a, b
    pinned on the host), timed with CUDA events behind the spin kernel."""

    def __init__(self, cp: Any, device_id: int) -> None:
        self.cp, self.rt, self.version = cp, cp.cuda.runtime, cp.__version__
        if self.rt.getDeviceCount() < 1:
            raise RuntimeError("cupy sees no CUDA device")
        self.device = cp.cuda.Device(device_id)  # JAX may leave another GPU current
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
        self.nbytes, self.bufs, self.spin_kernel, self.spin_error = 0, {}, None, None

    def ptrs(self, nbytes: int) -> dict[str, int]:
        """(dst, src) buffer addresses by direction, at least `nbytes` each."""
        if nbytes > self.nbytes:
            cp, n = self.cp, -(-nbytes // MiB) * MiB
            self.bufs = {}
            gc.collect()
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
            with self.device:
                self.bufs = {"dev_a": cp.empty(n, cp.uint8).data, "dev_b": cp.empty(n, cp.uint8).data,
                             "host_a": cp.cuda.alloc_pinned_memory(n),
                             "host_b": cp.cuda.alloc_pinned_memory(n)}
            self.nbytes = n
        p = {k: v.ptr for k, v in self.bufs.items()}
        return {"d2h": (p["host_b"], p["dev_a"]), "h2d": (p["dev_b"], p["host_a"]),
                "d2d": (p["dev_b"], p["dev_a"])}

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, self.rt.memcpyDefault, stream.ptr)

    def spin(self, ns: int) -> None:
        if ns and self.spin_error is None:
            try:
                self.spin_kernel = self.spin_kernel or self.cp.RawKernel(_SPIN, "kvx_bench_spin")
                self.spin_kernel((1,), (1,), (np.uint64(ns),), stream=self.stream)
            except Exception as e:  # noqa: BLE001 - no NVRTC: the events then count the enqueue
                self.spin_error = err_text(e)

    def time_ops(self, enqueue: Callable[[Any], None], reps: int, cfg: Config) -> list[float]:
        """Seconds per enqueue(stream), GPU time between events around `reps` calls behind the
        spin kernel (lengthened when Python's enqueue outlasts it)."""
        cp, s = self.cp, self.stream
        with self.device:
            start, end = cp.cuda.Event(), cp.cuda.Event()

            def one(spin_ns: int) -> tuple[float, float]:
                self.spin(spin_ns)
                t0 = time.perf_counter()
                start.record(s)
                for _ in range(reps):
                    enqueue(s)
                end.record(s)
                t_enqueue = time.perf_counter() - t0
                end.synchronize()
                return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps, t_enqueue

            spin_ns = int(min(max(3e9 * one(0)[1], 1e6), 5e8))  # warm-up; times the enqueue
            for _ in range(cfg.warmup):
                one(spin_ns)
            times = []
            for _ in range(cfg.repeats):
                t, t_enqueue = one(spin_ns)
                if t_enqueue * 1e9 > 0.7 * spin_ns:  # it may have outlasted the spin: again
                    spin_ns = min(2 * spin_ns, 2_000_000_000)
                    t, _ = one(spin_ns)
                times.append(t)
            return times

    def concurrent(self, device_ids: list[int], nbytes: int, to_host: bool, cfg: Config
                   ) -> float:
        """Seconds of one contiguous memcpy of `nbytes` on every listed GPU at once (each on its
        own stream, to its own pinned buffer): wall time from the first enqueue to the last sync."""
        cp, per = self.cp, []
        for i in device_ids:
            with cp.cuda.Device(i):
                per.append((cp.empty(nbytes, cp.uint8).data, cp.cuda.alloc_pinned_memory(nbytes),
                            cp.cuda.Stream(non_blocking=True)))

        def once() -> float:
            t0 = time.perf_counter()
            for dev, host, stream in per:
                dst, src = (host.ptr, dev.ptr) if to_host else (dev.ptr, host.ptr)
                self.memcpy(dst, src, nbytes, stream)
            for *_, stream in per:
                stream.synchronize()
            return time.perf_counter() - t0

        once()
        return median([once() for _ in range(cfg.repeats)])


class BenchCore:
    """State and helpers of every section; each section is a mixin of `Bench` that writes its
    figures into `self.sections[name]`."""

    def __init__(self, cfg: Config, cupy_module: Any = None) -> None:
        """cupy_module: a stand-in for cupy (tests); by default cupy is imported on GPUs only."""
        self.cfg, self.t0 = cfg, time.perf_counter()
        self.dev, self.backend = jax.devices()[0], jax.default_backend()
        kinds = {m.kind for m in self.dev.addressable_memories()}
        self.dsh = jax.sharding.SingleDeviceSharding(self.dev, memory_kind="device")
        self.hsh = (jax.sharding.SingleDeviceSharding(self.dev, memory_kind="pinned_host")
                    if "pinned_host" in kinds else None)
        self.rng = np.random.default_rng(cfg.seed)
        self.sections: dict[str, Any] = {}
        self.notes: list[str] = []
        self.cupy: Cupy | None = None
        if self.backend == "gpu" or cupy_module is not None:
            try:
                cp = cupy_module or __import__("cupy")
                self.cupy = Cupy(cp, getattr(self.dev, "local_hardware_id", None) or 0)
            except Exception as e:  # noqa: BLE001
                self.notes.append(f"cupy unavailable ({err_text(e)}): the ceilings are "
                                  "jax.device_put of one array, the TensorRT-LLM loop skipped")
        else:
            self.notes.append("CPU backend: the ceilings are jax.device_put of one array; CPU "
                              "figures say nothing of a GPU's")
        if cupy_module is not None:
            self.notes.append("a cupy stand-in (tests): its figures are no measurements")
        tag = "cpu" if self.backend == "cpu" else "".join(
            c if c.isalnum() else "-" for c in device_name(self.dev).lower()).strip("-")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        os.makedirs(cfg.out, exist_ok=True)
        self.json_path = os.path.join(
            cfg.out, f"bench-{stamp}-{tag}{'-quick' if cfg.quick else ''}.json")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def past_deadline(self) -> bool:
        return self.cfg.deadline_s > 0 and self.elapsed() > self.cfg.deadline_s

    def section(self, name: str, run: Callable[[dict[str, Any]], None]) -> None:
        """run(record) of one section; an error is recorded and the bench goes on."""
        sec = self.sections[name] = {}
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory kind on this backend"
        else:
            try:
                run(sec)
            except Exception as e:  # noqa: BLE001
                sec["error"] = err_text(e)
                self.log(f"{name}: ERROR {traceback.format_exc()}")
        gc.collect()
        self.save()

    def save(self) -> None:
        """The JSON document, rewritten after every case: a run cut short keeps its figures."""
        import jaxlib

        from .. import HAS_CUDA_HANDLERS, __version__
        meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "device": device_name(self.dev), "backend": self.backend,
                "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "cupy": self.cupy.version if self.cupy else None, "jax_kvxfer": __version__,
                "cuda_handlers": HAS_CUDA_HANDLERS, "host": platform.node(),
                "cpu": device_name(jax.devices("cpu")[0]), "cpu_count": os.cpu_count(),
                "python": platform.python_version(), "argv": sys.argv, "notes": self.notes,
                "config": {k: sorted(v) if isinstance(v, set) else v
                           for k, v in vars(self.cfg).items()}}
        doc = {"meta": meta, "elapsed_s": round(self.elapsed(), 2), **self.sections}
        with open(self.json_path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist")
                      else str(x))
        os.replace(self.json_path + ".tmp", self.json_path)

    # --- timing and ceilings ------------------------------------------------------------------

    def timed(self, run: Callable[[], Any]) -> float:
        """Median seconds of run(), which waits for its own work, after 1 + --warmup runs."""
        for _ in range(1 + self.cfg.warmup):
            run()
        times = []
        for _ in range(self.cfg.repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return median(times)

    def per_call(self, call: Callable[[], Any], pipe: int) -> float:
        """Seconds per call(): `pipe` calls dispatched back to back, then one wait."""
        return self.timed(lambda: block_on([call() for _ in range(pipe)])) / pipe

    def pipe_for(self, call_bytes: int, d2d: bool) -> int:
        """Calls per sample, so that a sample moves about the sample target."""
        target = self.cfg.sample_target["d2d" if d2d else "host"]
        return int(min(max(-(-target // max(call_bytes, 1)), 2), self.cfg.max_pipe))

    def ceiling(self, nbytes: int, directions: tuple[str, ...] = ("d2h", "h2d")
                ) -> dict[str, Any]:
        """GB/s of one contiguous copy of `nbytes` per direction, and how it was timed."""
        out: dict[str, Any] = {d: nbytes / self._contiguous_s(nbytes, d) / 1e9 for d in directions}
        out["ceiling"] = ("cudaMemcpyAsync, GPU time" if self.cupy is not None
                          else "jax.device_put of one array, wall time")
        return out

    def _contiguous_s(self, nbytes: int, d: str) -> float:
        if self.cupy is not None:
            cu, (dst, src) = self.cupy, self.cupy.ptrs(nbytes)[d]
            reps = int(min(max(-(-self.cfg.sample_target["d2d" if d == "d2d" else "host"]
                                 // nbytes), 1), 32))
            return median(cu.time_ops(lambda st: cu.memcpy(dst, src, nbytes, st), reps, self.cfg))
        x = jax.device_put(np.zeros(nbytes // 2, np.uint16).view(DTYPE),
                           self.hsh if d == "h2d" else self.dsh)
        copy = jax.jit(jnp.copy) if d == "d2d" else (
            lambda a: jax.device_put(a, self.dsh if d == "h2d" else self.hsh))
        return self.per_call(lambda: copy(x), self.pipe_for(nbytes, d == "d2d"))

    # --- pools ----------------------------------------------------------------------------

    def random_pool(self, shape: tuple[int, ...], sharding: Any) -> jax.Array:
        """Random bf16 bits made on the device, the top exponent bit clear (no NaN or inf)."""
        bits = _random_bits(shape, self.dsh)(jax.random.key(int(self.rng.integers(1 << 31))))
        return bits if sharding == self.dsh else jax.device_put(bits, sharding)

    def perms(self, k: int, b: int, num_blocks: int | None = None) -> np.ndarray:
        return np.stack([self.rng.permutation(num_blocks or b)[:b]
                         for _ in range(k)]).astype(np.int32)

    def fetch(self, pool: jax.Array, idx: Any) -> np.ndarray:
        """Blocks `idx` of a pool as uint16 bits (a host pool goes through the device)."""
        if pool.sharding.memory_kind not in (None, "device"):
            pool = jax.device_put(pool, self.dsh)
        return np.asarray(pool[np.asarray(idx, np.int32)]).view(np.uint16)
