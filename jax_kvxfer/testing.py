"""What tests and the benchmark may observe of the library's insides, in one public place:
which path a copy took, the manager's dispatchers and plan ring. Not an API to program
against: it changes with the library."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from . import _engines, _native

# The lanes' hazard bookkeeping, pure NumPy, for its unit test against a brute-force model.
from ._hazards import NO_LANE, OFFLOAD_LANE, ONBOARD_LANE, LaneHazards, LaneOrder
from .manager import KVCacheTransferManager
from .plan_ring import PlanRing

plan_tokens = _engines.plan_tokens  # the tokens a dispatch reading plan ring slots donates

# The manager's jitted dispatchers by name: each is (donating the pools, not donating them).
DISPATCHERS = ("COPY_ACROSS", "COPY_WITHIN", "BOTH_WAYS", "LANE_ACROSS", "LANE_WITHIN", "JOIN")


def dma_batches() -> int | None:
    """Batches the CUDA handlers have copied with the copy engines so far, in this process
    (None where the default backend is not a GPU or the build has no CUDA handlers): a test
    reads it before and after a call to see whether the call really took that path."""
    if jax.default_backend() != "gpu" or not _native.HAS_CUDA_HANDLERS:
        return None
    return _native._kvxfer_cuda.dma_batches()


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


def copy_engine(manager: KVCacheTransferManager) -> str:
    """How `manager` copies: "lanes" (the transfer lanes; on the CPU their copies are done when
    their call returns) or "in line" (the copy kernel on XLA's stream)."""
    return "lanes" if isinstance(manager._engine, _engines.LaneEngine) else "in line"


def plan_ring(manager: KVCacheTransferManager) -> PlanRing | None:
    """The manager's plan ring (None: it passes indices as NumPy arrays)."""
    return manager._engine.plans

__all__ = ["DISPATCHERS", "NO_LANE", "OFFLOAD_LANE", "ONBOARD_LANE", "LaneHazards", "LaneOrder",
           "copy_engine", "count_dispatches", "dispatcher", "dma_batches", "plan_ring",
           "plan_tokens"]
