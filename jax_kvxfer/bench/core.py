"""The benchmark's core state: devices and shardings, pools, timing helpers, case bookkeeping."""

from __future__ import annotations

import datetime as _dt
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import DTYPE, Config, Geometry, fmt_size
from .cupy_tools import CupyTools
from .helpers import (
    CompileCounter,
    block_on,
    clamp,
    err_text,
    gpu_name,
    median,
    pattern_fn,
    zeros_fn,
)


def gpu_stream_events(profile: Any) -> list[tuple[int, int, str]]:
    """(start_ns, end_ns, name) of the events of a jax.profiler.ProfileData's GPU planes,
    stream lines only (other lines repeat the same work per XLA op), by start."""
    return sorted((e.start_ns, e.start_ns + e.duration_ns, e.name)
                  for plane in profile.planes if plane.name.startswith("/device:GPU")
                  for line in plane.lines if line.name.startswith("Stream")
                  for e in line.events)


def timeline_ns(profile: Any) -> tuple[int, int, dict[str, int]]:
    """(kernel_ns, span_ns, others) of jax_kvxfer's work in a profile: its kernels' time
    (namespace kvxfer, on the GPU streams), the span from the first of them starting to the last
    ending (the gaps between them and XLA's own work in between included), and the nanoseconds
    of each other GPU event in that span, by name."""
    events = gpu_stream_events(profile)
    ours = [(start, end) for start, end, name in events if "kvxfer" in name]
    if not ours:
        return 0, 0, {}
    first, last = min(s for s, _ in ours), max(e for _, e in ours)
    others: dict[str, int] = {}
    for start, end, name in events:
        if "kvxfer" not in name and start < last and end > first:
            others[name] = others.get(name, 0) + min(end, last) - max(start, first)
    return sum(e - s for s, e in ours), last - first, others


def traced_profile(run: Callable[[], Any]) -> Any:
    """run() under the JAX profiler (it must block until its work is done); the trace as a
    jax.profiler.ProfileData, or None when no trace was written."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return ProfileData.from_file(files[0]) if files else None


class BenchCore:
    """State and helpers every section uses. `Bench` (in the package) adds one mixin per section
    and `ReportMixin`, which supplies `save()` (called after every case)."""

    def __init__(self, cfg: Config, cupy_module: Any = None) -> None:
        """cupy_module: a stand-in for cupy (tests); by default cupy is imported on GPUs only."""
        self.cfg = cfg
        self.t_start = time.perf_counter()
        self.dev = jax.devices()[0]
        self.backend = jax.default_backend()
        self.on_gpu = self.backend not in ("cpu",)
        S = jax.sharding.SingleDeviceSharding
        kinds = {m.kind for m in self.dev.addressable_memories()}
        self.dsh = S(self.dev, memory_kind="device")
        self.hsh = S(self.dev, memory_kind="pinned_host") if "pinned_host" in kinds else None
        self.rng = np.random.default_rng(cfg.seed)
        self.seed_counter = 0
        self.compiles = CompileCounter()
        self.results: list[dict[str, Any]] = []
        self.sections: dict[str, Any] = {}
        self.notes: list[str] = []
        self.ceilings: dict[tuple[str, int], dict[str, float]] = {}
        # (direction, block bytes, n_label) -> GB/s of a memcpy of the bytes that case moves
        self.same_bytes: dict[tuple[str, int, str], float] = {}
        self.cupy: CupyTools | None = None
        self.cupy_note: str | None = None
        if self.hsh is None:
            self.notes.append("no pinned_host memory kind on this backend: host directions skipped")
        if self.on_gpu or cupy_module is not None:
            try:
                self.cupy = CupyTools(cupy_module, getattr(self.dev, "local_hardware_id", None) or 0)
            except Exception as e:  # noqa: BLE001
                self.cupy_note = f"cupy unavailable ({err_text(e)}): memcpy ceilings fall back " \
                                 "to jax_contig, TensorRT-LLM-style paths skipped"
        else:
            self.cupy_note = ("CPU backend: cupy/GPU-only paths (memcpy ceilings, TensorRT-LLM-style "
                              "loop, side-stream overlap) skipped; jax_contig is the ceiling; "
                              "CPU figures mean nothing for the GPU targets")
        if cupy_module is not None:
            self.notes.append(f"cupy stand-in {getattr(cupy_module, '__name__', '?')} used "
                              "(tests): its figures are not measurements")
        if self.cupy_note:
            self.notes.append(self.cupy_note)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        tag = "cpu" if not self.on_gpu else "".join(
            c if c.isalnum() else "-" for c in gpu_name(self.dev).lower()).strip("-")
        base = f"bench-{stamp}-{tag}{'-quick' if cfg.quick else ''}"
        os.makedirs(cfg.out, exist_ok=True)
        self.json_path = os.path.join(cfg.out, base + ".json")
        self.png_path = os.path.join(cfg.out, base + ".png")

    # --- logging, deadline --------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def past_deadline(self) -> bool:
        return self.cfg.deadline_s > 0 and self.elapsed() > self.cfg.deadline_s

    # --- pools and indices --------------------------------------------------------------------

    def _next_seed(self) -> int:
        self.seed_counter += 1
        return (self.cfg.seed * 1_000_003 + self.seed_counter) & 0x7FFFFFFF

    def random_pool(self, geom: Geometry, num_blocks: int, sharding: Any) -> jax.Array:
        x = pattern_fn(geom.pool_shape(num_blocks), self.dsh)(jnp.uint32(self._next_seed()))
        return x if sharding is self.dsh else jax.device_put(x, sharding)

    def zero_pool(self, geom: Geometry, num_blocks: int, sharding: Any) -> jax.Array:
        x = zeros_fn(geom.pool_shape(num_blocks), self.dsh)()
        return x if sharding is self.dsh else jax.device_put(x, sharding)

    def matrix(self, n: int, scale: float) -> jax.Array:
        bits = pattern_fn((n, n), self.dsh)(jnp.uint32(self._next_seed()))
        # small finite values from the pattern's low bits
        f = jax.jit(lambda b: ((lax.bitcast_convert_type(b, jnp.uint16) & 0xFF).astype(jnp.float32)
                               / 255.0 - 0.5) * scale)
        return f(bits).astype(DTYPE)

    def perms(self, k: int, b: int, num_blocks: int) -> np.ndarray:
        return np.stack([self.rng.permutation(num_blocks)[:b] for _ in range(k)]).astype(np.int32)

    def fetch(self, pool: jax.Array, idx: Any) -> np.ndarray:
        """Blocks `idx` of a pool as uint16 bits (host pools go through the device)."""
        a = pool
        if a.sharding.memory_kind not in (None, "device"):
            a = jax.device_put(a, self.dsh)
        return np.asarray(a[np.asarray(idx, np.int32)]).view(np.uint16)

    # --- timing helpers -----------------------------------------------------------------------

    def plan(self, op_bytes: int, d2d: bool, kmax: int | None = None) -> tuple[int, int]:
        """(K ops per jit call, calls per sample) so that dispatch is amortised."""
        c = self.cfg
        call_t = c.call_target_d2d if d2d else c.call_target_host
        k = clamp(math.ceil(call_t / max(op_bytes, 1)), 1, kmax if kmax is not None else c.kmax)
        return k, self.pipe_for(k * op_bytes, d2d)

    def pipe_for(self, call_bytes: int, d2d: bool) -> int:
        """Calls per sample for calls that move `call_bytes` each: one sample pays one dispatch
        before the GPU starts and one sync at its end, so it moves about the sample target."""
        c = self.cfg
        sample_t = c.sample_target_d2d if d2d else c.sample_target_host
        return clamp(math.ceil(sample_t / max(call_bytes, 1)), 2, c.max_pipe)

    def time_jax(self, call: Callable[[], Any], *, pipe: int, samples: int | None = None
                 ) -> tuple[list[float], float]:
        """Seconds per call(): `pipe` calls dispatched back to back, then one block."""
        samples = samples or self.cfg.repeats
        t0 = time.perf_counter()
        block_on(call())
        first = time.perf_counter() - t0

        def sample() -> float:
            t = time.perf_counter()
            outs = [call() for _ in range(pipe)]
            block_on(outs)
            return (time.perf_counter() - t) / pipe

        for _ in range(self.cfg.warmup):
            sample()
        return [sample() for _ in range(samples)], first

    def gpu_times(self, call: Callable[[], Any], calls: int = 3) -> dict[str, Any] | None:
        """From a profiler trace of `calls` calls dispatched back to back (CUPTI's device
        timestamps, as the memcpy ceiling is timed with CUDA events), per call(): the GPU time
        of jax_kvxfer's own kernels (`kernel_s`: the gaps and host work between them left out),
        the span of the GPU timeline from the first of them to the last (`span_s`: gaps
        included, but not the host's dispatch before the GPU starts or its wake-up after), and
        the other GPU work in that span (`others_us`: the three longest, by name). None without
        such kernels in the trace (CPU, the copy engines' path, no CUPTI)."""
        if self.backend != "gpu":
            return None
        profile = traced_profile(lambda: block_on([call() for _ in range(calls)]))
        if profile is None:
            return None
        kernel, span, others = timeline_ns(profile)
        if not kernel:
            return None
        top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
        return {"kernel_s": kernel * 1e-9 / calls, "span_s": span * 1e-9 / calls,
                "others_us": {name[:80]: round(ns * 1e-3 / calls, 1) for name, ns in top}}

    # --- case bookkeeping ---------------------------------------------------------------------

    def case(self, desc: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        rec = dict(desc)
        label = (f"{rec.get('direction', '')} {fmt_size(rec.get('block_bytes', 0))} "
                 f"{rec['path']}" + (f" n={rec['n_label']}" if "n_label" in rec else ""))
        if self.past_deadline():
            rec["skipped"] = f"past the {self.cfg.deadline_s:.0f} s deadline"
            self.results.append(rec)
            return rec
        try:
            rec.update(fn())
            rec["error"] = None
        except Exception as e:  # noqa: BLE001 - one failing path must not stop the run
            rec["error"] = err_text(e)
            rec["traceback"] = traceback.format_exc(limit=6)
            self.log(f"{label}: ERROR {rec['error'][:300]}")
            self.results.append(rec)
            self.save()
            return rec
        self.results.append(rec)
        self.save()  # after every case: a run cut short (or aborted by XLA) keeps its data
        ceil = self.ceilings.get((rec.get("direction"), rec.get("block_bytes")), {}).get("gbps")
        ratio = f" ({rec['gbps'] / ceil:6.1%} of {ceil:.1f})" if ceil and rec.get("gbps") else ""
        ver = "" if rec.get("verified") in (None, True) else "  VERIFY FAILED"
        self.log(f"{label}: {rec.get('gbps', float('nan')):9.2f} GB/s{ratio}{ver}")
        return rec

    @staticmethod
    def timing(times: list[float], bytes_moved: int, **extra: Any) -> dict[str, Any]:
        med = median(times)
        return {"seconds": med, "seconds_all": times, "bytes_moved": bytes_moved,
                "gbps": bytes_moved / med / 1e9 if med > 0 else None, **extra}
