"""Index plans that the copy kernel reads from pinned host memory, rewritten in place.

Each manager dispatch needs a plan: source indices, destination indices and token counts.
Passed as a NumPy array, JAX moves it to the device with every call: 60-90 us on the H200
machine, as much as the rest of the dispatch. Instead the manager
keeps, per batch bucket, a small ring of plan arrays in `pinned_host` memory, writes each plan
into the next free slot with NumPy (a host memcpy of a few hundred bytes) and passes those
arrays: the kernel reads them through unified addressing, and no transfer is issued.

JAX arrays are immutable to everyone else; these never leave the manager, and a slot is
rewritten only after the dispatch that read it has finished. That dispatch tells when: each
slot owns a token, an int32[1] device array that the dispatch takes donated and hands back
unchanged (`PlanSlot.token`). XLA aliases it to the output, so no op runs for it (a marker made
by an op, as before, cost a memcpy on the host and on the GPU stream with every dispatch), and
the returned array, like every output of an execution, is ready only when the execution is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops._jax_seams import host_byte_views
from .block import local_zeros


class PlanSlot:
    """One plan: source indices, destination indices and token counts, three int32[B] arrays
    (separate, so that each reaches the custom call as it is, with no slicing op in between),
    and writable NumPy views of their host buffers (one per device)."""

    def __init__(self, arrays: tuple[jax.Array, jax.Array, jax.Array],
                 token_sharding: jax.sharding.Sharding) -> None:
        self.arrays = jax.block_until_ready(arrays)  # their fill must land before we write
        self._views = [[v.view(np.int32) for v in host_byte_views(a)] for a in arrays]
        self._token_sharding = token_sharding
        # What the next dispatch that reads the slot donates; it hands back the new token.
        self.token = self._new_token()
        self.busy = False  # a dispatch that read the slot may not have finished
        self._filled = arrays[0].shape[0]  # entries from here on hold -1 (none: zeros at first)

    def _new_token(self) -> jax.Array:
        # Made by an op, so no NumPy buffer stands in the way of donating it.
        return jnp.zeros((1,), jnp.int32, device=self._token_sharding)

    def dispatched(self, token: jax.Array) -> None:
        """Records the token that the dispatch reading this slot handed back."""
        self.token, self.busy = token, True

    def fresh_token(self) -> None:
        """A new token, where a failed dispatch consumed the slot's (its donation happened)."""
        if self.token.is_deleted():
            self.token = self._new_token()

    def write(self, rows: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stores a plan (source indices, destination indices, token counts: three rows of n
        <= B integers, or a [3, n] array), pads it with -1 (pairs the kernel skips) and returns
        the arrays to pass for it."""
        n = len(rows[0])
        for row, views in zip(rows, self._views):
            for view in views:
                view[:n] = row
                if n < self._filled:  # only what the last plan wrote past n is not -1 yet
                    view[n:self._filled] = -1
        self._filled = n
        return self.arrays


class PlanRing:
    """Per batch bucket, `slots` plan arrays in pinned host memory, used round robin."""

    def __init__(self, sharding: jax.sharding.Sharding, slots: int = 16) -> None:
        self._sharding = sharding
        self._token_sharding = sharding.with_memory_kind("device")
        self._slots = slots
        self._rings: dict[int, list[PlanSlot]] = {}
        self._next: dict[int, int] = {}
        self._handed_out: set[PlanSlot] = set()  # since `all_done`: the only slots maybe busy

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
        bucket, and a sync frees them all). The caller donates the slot's token to its
        dispatch and records the one handed back (`PlanSlot.dispatched`)."""
        ring = self._rings.get(bucket)
        if ring is None:
            # A fresh buffer for each (local_zeros): arrays sharing one would share their
            # plans; and no cross-process check where the mesh spans processes.
            ring = self._rings[bucket] = [
                PlanSlot(tuple(local_zeros((bucket,), np.int32, self._sharding)
                               for _ in range(3)), self._token_sharding)
                for _ in range(self._slots)]
            self._next[bucket] = 0
        i = self._next[bucket]
        self._next[bucket] = (i + 1) % len(ring)
        slot = ring[i]
        if slot.busy:
            slot.token.block_until_ready()
            slot.busy = False
        self._handed_out.add(slot)
        return slot

    def all_done(self) -> None:
        """Every dispatch has finished (the manager synced): no slot needs waiting for."""
        for slot in self._handed_out:
            slot.busy = False
        self._handed_out.clear()

    def arrays(self) -> list[jax.Array]:
        """The arrays the ring holds, for memory checks: plans and tokens (with the per-device
        arrays of their shards, which JAX keeps as arrays of their own)."""
        out = []
        for ring in self._rings.values():
            for slot in ring:
                for a in (*slot.arrays, slot.token):
                    out += [a] + [s.data for s in a.addressable_shards]
        return out
