"""What tests, scripts and the benchmark may observe of the library's insides, in one public
place: which path a copy took, the manager's dispatchers and plan ring, the table of FFI
targets, and the internal functions that tests call directly. Not an API to program against:
it changes with the library. Tests import these from here, never from a private module
(tests/test_layering.py checks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from . import _kvxfer_cpu
from .ops import _native

# What known indices prove (IndexFacts() proves nothing): for a CopyPlan.
from .ops._checks import IndexFacts

# The jitted program an eager copy of a plan runs: the sharded tests lower it to look for
# collectives; the emitter of any plan: the targets' attributes.
from .ops._lowering import eager_copy, emit

# The table of FFI targets and their attributes: its checks against the compiled registrations,
# the C++ decodings and the emitters.
from .ops._native import TARGET_ATTRIBUTES, TARGETS

# The copy-engine policy's threshold: the test of dma="auto" picks block sizes around it.
from .ops._plan import DMA_AUTO_MIN_BLOCK_BYTES, CopyPlan

# Besides the hooks defined below, the internals that tests (and scripts, and the bench) call
# or read directly, each for one reason.
from .transfer import _engines

# The manager's batch check (pairs -> NumPy columns): its test against plain Python, and the
# bench's host-speed reference.
from .transfer._batch import check_batch, split_runs

# The lanes' hazard bookkeeping, pure NumPy: its unit test against a brute-force model.
from .transfer._hazards import NO_LANE, OFFLOAD_LANE, ONBOARD_LANE, LaneHazards, LaneOrder

# The lane copies' and the join's custom calls: their attributes against the table.
from .transfer._lanes import join_call, lane_copy_call, layer_lane_copy_call

# The layered copy's custom call: the sanitizer traces it in a jit of its own.
from .transfer._layers import layer_copy_call
from .transfer._plan_ring import PlanRing
from .transfer.manager import KVCacheTransferManager

# The native pass behind check_batch: its own edge cases (bad column shapes, odd blocks).
slot_columns = _kvxfer_cpu.slot_columns
plan_tokens = _engines.plan_tokens  # the tokens a dispatch reading plan ring slots donates

# The manager's jitted dispatchers by name: each is (donating the pools, not donating them).
DISPATCHERS = ("COPY_ACROSS", "COPY_WITHIN", "LANE_ACROSS", "LANE_WITHIN", "JOIN")


def dma_batches() -> int | None:
    """Batches the CUDA handlers have copied with the copy engines so far, in this process
    (None where the default backend is not a GPU or the build has no CUDA handlers): a test
    reads it before and after a call to see whether the call really took that path."""
    if jax.default_backend() != "gpu" or not _native.HAS_CUDA_HANDLERS:
        return None
    return _native._kvxfer_cuda.dma_batches()


def registered_targets() -> dict[str, list[str]]:
    """The target names each compiled module registers with XLA, by platform ("cpu", and
    "cuda" where this build has the CUDA handlers), sorted."""
    found = {"cpu": sorted(_kvxfer_cpu.registrations())}
    if _native.HAS_CUDA_HANDLERS:
        found["cuda"] = sorted(_native._kvxfer_cuda.registrations())
    return found


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

__all__ = [
    "DISPATCHERS",
    "DMA_AUTO_MIN_BLOCK_BYTES",
    "NO_LANE",
    "OFFLOAD_LANE",
    "ONBOARD_LANE",
    "TARGETS",
    "TARGET_ATTRIBUTES",
    "CopyPlan",
    "IndexFacts",
    "LaneHazards",
    "LaneOrder",
    "check_batch",
    "copy_engine",
    "count_dispatches",
    "dispatcher",
    "dma_batches",
    "eager_copy",
    "emit",
    "join_call",
    "lane_copy_call",
    "layer_copy_call",
    "layer_lane_copy_call",
    "plan_ring",
    "plan_tokens",
    "registered_targets",
    "slot_columns",
    "split_runs",
]
