"""Index plans that the copy kernel reads from pinned host memory, rewritten in place.

Each manager dispatch needs a plan: source indices, destination indices and token counts.
Passed as a NumPy array, JAX moves it to the device with every call: 60-90 us on the H200
machine, as much as the rest of the dispatch (`scripts/profile_manager.py`). Instead the manager
keeps, per batch bucket, a small ring of plan arrays in `pinned_host` memory, writes each plan
into the next free slot with NumPy (a host memcpy of a few hundred bytes) and passes those
arrays: the kernel reads them through unified addressing, and no transfer is issued.

JAX arrays are immutable to everyone else; these never leave the manager, and a slot is
rewritten only after the dispatch that read it has finished (`PlanSlot.done`).
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np


class PlanSlot:
    """One plan: source indices, destination indices and token counts, three int32[B] arrays
    (separate, so that each reaches the custom call as it is, with no slicing op in between),
    and writable NumPy views of their host buffers (one per device)."""

    def __init__(self, arrays: tuple[jax.Array, jax.Array, jax.Array]) -> None:
        self.arrays = jax.block_until_ready(arrays)  # their fill must land before we write
        self._views = [
            [np.ctypeslib.as_array((ctypes.c_int32 * a.size).from_address(
                shard.data.unsafe_buffer_pointer())) for shard in a.addressable_shards]
            for a in arrays]
        self.done: jax.Array | None = None  # an output of the last dispatch that read the slot

    def write(self, plan: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stores plan ([3, B] int32) and returns the arrays to pass for it."""
        for row, views in zip(plan, self._views):
            for view in views:
                view[...] = row
        return self.arrays


class PlanRing:
    """Per batch bucket, `slots` plan arrays in pinned host memory, used round robin."""

    def __init__(self, sharding: jax.sharding.Sharding, slots: int = 16) -> None:
        self._sharding = sharding
        self._slots = slots
        self._rings: dict[int, list[PlanSlot]] = {}
        self._next: dict[int, int] = {}

    @staticmethod
    def sharding_for(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
        """The plans' sharding: replicated like `sharding`, in pinned_host memory; None where
        the backend has no pinned_host memory (the manager then sends NumPy plans)."""
        kinds = {m.kind for d in sharding.device_set for m in d.addressable_memories()}
        if "pinned_host" not in kinds:
            return None
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(),
                                              memory_kind="pinned_host")
        return sharding.with_memory_kind("pinned_host")

    def next_slot(self, bucket: int) -> PlanSlot:
        """The next slot of this bucket's ring, once the dispatch that last read it has
        finished (it usually has: a slot comes round again after 15 other dispatches of its
        bucket, and a sync frees them all). The caller sets `done` after its dispatch."""
        ring = self._rings.get(bucket)
        if ring is None:
            # A fresh NumPy array for each: on CPU, device_put may keep the NumPy buffer
            # itself as the array's buffer, and arrays sharing one would share their plans.
            ring = self._rings[bucket] = [
                PlanSlot(tuple(jax.device_put(np.zeros(bucket, np.int32), self._sharding)
                               for _ in range(3)))
                for _ in range(self._slots)]
            self._next[bucket] = 0
        i = self._next[bucket]
        self._next[bucket] = (i + 1) % len(ring)
        slot = ring[i]
        if slot.done is not None:
            slot.done.block_until_ready()
            slot.done = None
        return slot

    def all_done(self) -> None:
        """Every dispatch has finished (the manager synced): no slot needs waiting for."""
        for ring in self._rings.values():
            for slot in ring:
                slot.done = None

    def arrays(self) -> list[jax.Array]:
        """The arrays the ring holds, for memory checks: plans (with the per-device arrays of
        their shards, which JAX keeps as arrays of their own) and pending `done` markers."""
        out = []
        for ring in self._rings.values():
            for slot in ring:
                for a in slot.arrays:
                    out += [a] + [s.data for s in a.addressable_shards]
                out += [slot.done] if slot.done is not None else []
        return out
