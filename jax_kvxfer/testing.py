"""Hooks for tests, scripts and the benchmark into what a user never needs to see: which path a
copy took, the manager's jitted dispatchers and its plan ring, and the targets the compiled
modules register. Not an API to program against: it changes with the library. Tests that need
an internal function or constant import it from its own module (`jax_kvxfer.ops._plan`, ...);
this module re-exports none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from .ops import _native
from .transfer import _engines

# The manager's jitted dispatchers by name (transfer/_engines.py): each is (donating the pools,
# not donating them).
DISPATCHERS = ("COPY_ACROSS", "COPY_WITHIN", "LANE_ACROSS", "LANE_WITHIN", "JOIN")


def dma_batches() -> int | None:
    """Batches the CUDA handlers have copied with the copy engines so far, in this process
    (None where the default backend is not a GPU or the build has no CUDA handlers): a test
    reads it before and after a call to see whether the call really took that path."""
    if jax.default_backend() != "gpu":
        return None
    return _native.dma_batches()


def staged_onboards() -> int | None:
    """Lane onboards that went through a staging buffer in device memory so far, in this
    process (None where there is no GPU or no CUDA handlers): read before and after a call to
    see whether it took that path."""
    if jax.default_backend() != "gpu":
        return None
    return _native.staged_onboards()


@contextlib.contextmanager
def onboard_staging(below_bytes: int) -> Iterator[None]:
    """Within the block, the lanes stage onboards of host rows smaller than `below_bytes`
    that come in runs (0: none); the default is restored after. For comparing both ways.

    Raises:
      ValueError: `below_bytes` is not an integer >= 0.
    """
    if isinstance(below_bytes, bool) or not isinstance(below_bytes, int) or below_bytes < 0:
        raise ValueError(f"below_bytes must be an integer >= 0, got {below_bytes!r}")
    previous = _native.stage_onboards_below(below_bytes)
    try:
        yield
    finally:
        if previous is not None:
            _native.stage_onboards_below(previous)


def registered_targets() -> dict[str, list[str]]:
    """The target names each compiled module registers with XLA, by platform ("cpu", and
    "cuda" where this build has the CUDA handlers), sorted."""
    return _native.registered_targets()


def dispatcher(name: str) -> Any:
    """The manager's jitted dispatcher `name` (one of DISPATCHERS), in its donating form: for
    its compile cache and its lowering."""
    return getattr(_engines, name)[0]


@contextlib.contextmanager
def count_dispatches(name: str) -> Iterator[list[dict[str, Any]]]:
    """Within the block, every call of dispatcher `name` (either form) appends its static
    arguments, plus "pools": how many pools its first argument holds, to the yielded list."""
    calls: list[dict[str, Any]] = []
    real = getattr(_engines, name)

    def counted(fn):
        def call(*args, **static):
            calls.append({"pools": len(args[0]), **static})
            return fn(*args, **static)
        return call

    setattr(_engines, name, tuple(counted(fn) for fn in real))
    try:
        yield calls
    finally:
        setattr(_engines, name, real)


def copy_engine(manager: Any) -> str:
    """How a KVCacheTransferManager copies: "lanes" (the transfer lanes; on the CPU their copies
    are done when their call returns) or "in line" (the copy kernel on XLA's stream)."""
    return "lanes" if isinstance(manager._engine, _engines.LaneEngine) else "in line"


def plan_ring(manager: Any) -> Any:
    """A KVCacheTransferManager's plan ring (transfer/_plan_ring.py; None: it passes indices as
    NumPy arrays)."""
    return manager._engine.plans


__all__ = ["DISPATCHERS", "copy_engine", "count_dispatches", "dispatcher", "dma_batches",
           "onboard_staging", "plan_ring", "registered_targets", "staged_onboards"]
