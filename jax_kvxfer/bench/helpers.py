"""Small shared helpers: medians, error text, device names, seeded pools, compile counting."""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import DTYPE


def clamp(x: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, x)))


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def block_on(tree: Any) -> None:
    leaves = [x for x in jax.tree.leaves(tree)
              if isinstance(x, jax.Array) and not x.is_deleted()]
    jax.block_until_ready(leaves)


def time_calls(call: Callable[[int], Any], sync: Callable[[], Any], calls: int,
               before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds each of `calls` calls of call(i) takes to return, none waiting for the device
    inside the timed call; sync() every 8 calls (so the queue stays short) and at the end;
    before(), untimed, ahead of each call. (The bench's host section.)"""
    times = []
    for i in range(calls):
        if before is not None:
            before()
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
        if i % 8 == 7:
            sync()
    sync()
    return times


def err_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 1500 else text[:1500] + " ..."


@functools.cache
def cpu_model() -> str:
    """The host CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_name(dev: Any) -> str:
    if dev.platform != "cpu":
        return str(getattr(dev, "device_kind", dev.platform))
    return "cpu: " + cpu_model()


def xla_onboard_rows(dst: jax.Array, src: jax.Array, si: jax.Array, di: jax.Array,
                     count: int) -> jax.Array:
    """The XLA-native onboard (traced inside jit): `count` unrolled dynamic_slices of the
    pinned_host pool, each moved to device memory and written with dynamic_update_slice."""
    for b in range(count):
        row = lax.dynamic_slice_in_dim(src, si[b], 1, axis=0)
        row = jax.device_put(row, jax.memory.Space.Device)
        dst = lax.dynamic_update_slice_in_dim(dst, row, di[b], 0)
    return dst


@functools.cache
def pattern_fn(shape: tuple[int, ...], sharding: Any) -> Callable[[jax.Array], jax.Array]:
    """Pseudo-random bf16 pool from a seed: an integer hash of the element index (compiles fast,
    unlike jax.random on CPU), top exponent bit cleared so no value is NaN or inf and paths that
    pass values through float ops still compare bit-exact."""
    size = int(np.prod(shape))

    def make(seed: jax.Array) -> jax.Array:
        h = lax.iota(jnp.uint32, size) * jnp.uint32(2654435761) + seed * jnp.uint32(0x9E3779B9)
        h = h ^ (h >> 15)
        h = h * jnp.uint32(0x2C1B3C6D)
        h = h ^ (h >> 12)
        bits = (h >> 16).astype(jnp.uint16) & jnp.uint16(0xBFFF)
        return lax.bitcast_convert_type(bits, DTYPE).reshape(shape)

    return jax.jit(make, out_shardings=sharding)


@functools.cache
def zeros_fn(shape: tuple[int, ...], sharding: Any) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, DTYPE), out_shardings=sharding)


class CompileCounter:
    """Counts XLA backend compilations (all of them, jit and eager) through jax.monitoring."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self.registered = False
        try:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self.registered = True
        except Exception:  # noqa: BLE001 - no listener API: compiles are then not counted
            self.registered = False

    def _on_event(self, name: str, duration: float, **kwargs: Any) -> None:
        if name == self.EVENT:
            self.count += 1

    def close(self) -> None:
        if self.registered:
            try:
                jax.monitoring.unregister_event_duration_listener(self._on_event)
            except Exception:  # noqa: BLE001 - older jax: the listener stays, harmlessly
                self.count = 0
            self.registered = False


def cache_size(fn: Any) -> int | None:
    try:
        return int(fn._cache_size()) if fn is not None else None
    except Exception:  # noqa: BLE001
        return None
