"""Memory limits checked before a pool is allocated, so an oversized pool is a clear error."""

from __future__ import annotations

import os

import jax

# XLA's pinned-host allocator on GPUs is capped by this variable (GiB), 64 by default.
HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_LIMIT_GIB = 64


def pinned_host_limit_bytes(device: jax.Device) -> int | None:
    """The pinned-host memory XLA lets this device's client allocate, or None if unbounded."""
    if device.platform != "gpu":
        return None
    value = os.environ.get(HOST_LIMIT_ENV, str(DEFAULT_HOST_LIMIT_GIB))
    try:
        return int(float(value) * 2**30)
    except ValueError:
        return None


def available_host_bytes() -> int | None:
    """The host memory the kernel can still hand out without swapping (MemAvailable), or None
    where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_device_bytes(device: jax.Device) -> int | None:
    """Device memory the allocator can still hand out, or None where the backend does not say.
    A CPU device's memory is the host's: what the system has available."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats raise various errors
        stats = None
    if not stats or "bytes_limit" not in stats:
        return available_host_bytes() if device.platform == "cpu" else None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_fits(device: jax.Device, memory_kind: str, nbytes: int, what: str) -> None:
    """Raises MemoryError when `nbytes` cannot fit, naming the limit and how to raise it."""
    gib = nbytes / 2**30
    if memory_kind == "device":
        free = free_device_bytes(device)
        if free is not None and nbytes > free:
            remedy = ("use fewer blocks" if device.platform == "cpu" else
                      "use fewer blocks, or give XLA more of the GPU "
                      "(XLA_PYTHON_CLIENT_MEM_FRACTION)")
            raise MemoryError(f"{what} needs {gib:.2f} GiB but {device} has "
                              f"{free / 2**30:.2f} GiB free; {remedy}")
        return
    limit = pinned_host_limit_bytes(device)
    if limit is not None and nbytes > limit:
        raise MemoryError(
            f"{what} needs {gib:.2f} GiB of pinned host memory, over XLA's limit of "
            f"{limit / 2**30:.2f} GiB; raise it with {HOST_LIMIT_ENV}=<GiB> (set before JAX "
            "starts) or use fewer secondary blocks"
        )
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"{what} needs {gib:.2f} GiB of host memory but this machine has "
            f"{available / 2**30:.2f} GiB available; use fewer secondary blocks")
