"""How the transfer manager's copies run: in line on XLA's stream, or on the transfer lanes.

The manager (manager.py) checks a batch and splits it into runs of one direction; an engine
dispatches each run as one jitted call that copies it in every pool, the destinations donated
(updated in place), and gives the pools their new arrays.

- `InLineEngine`: the copy kernel on XLA's stream, in line with compute; every later use of a
  pool sees the copies. For `dma=False`, sharded pools and `plan_ring=False`.
- `LaneEngine`: the copies enqueued on the transfer lanes (_lanes.py), beside compute, ordered by
  `LaneHazards` (_hazards.py), joined at the step boundary or when user code reads a pool array
  that lane copies use.

Both take block indices from the plan ring (_plan_ring.py) when there is one, and share one
fallback for a destination that cannot be donated (a NumPy view pins it): the same call without
donating, with a `DonationWarning`.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..ops._checks import IndexFacts, index_facts
from ..ops._jax_seams import memory_space, pinned_by_external_reference
from ._batch import PairBatch
from ._hazards import OFFLOAD_LANE, ONBOARD_LANE, LaneHazards
from ._lanes import join_call, lanes_idle, wait_lanes
from ._plan_ring import PlanRing, PlanSlot


class DonationWarning(UserWarning):
    """A pool array could not be donated, so a transfer copied the whole pool."""


# One jitted dispatch per run covers every pool: one custom call per pool, the destinations
# donated so that each copy happens in place. `plan` holds the source indices, destination
# indices and token counts: three pinned-host arrays from the plan ring, or one [3, B] NumPy
# array where there is no pinned_host memory. `storages` holds each pool's storage
# (_storage.py), which makes its copy: a pool split over `mesh` is copied by every device on its
# own shard, with no traffic between devices.
#
# Besides the pools, a dispatch takes donated and hands back unchanged the tokens of the plan
# ring slots it reads (_plan_ring.py): XLA aliases them to outputs, so no op runs for them, and
# each returned token is ready when the dispatch has run. Without the ring, tokens are None.
def _copy_across_impl(dsts, srcs, plan, token, facts, mesh, storages, whole=False):
    """whole: every pair copies a whole block."""
    return tuple(st.copy(d, s, plan, facts, whole, mesh)
                 for d, s, st in zip(dsts, srcs, storages)), token


def _copy_within_impl(pools, plan, token, facts, mesh, storages, whole=False):
    return tuple(st.copy_within(p, plan, facts, whole, mesh)
                 for p, st in zip(pools, storages)), token


def _lane_across_impl(dsts, srcs, plan, token, lane, wait_lane, stream_wait_lane, whole,
                      storages, layer_groups):
    lanes = {"lane": lane, "wait_lane": wait_lane, "stream_wait_lane": stream_wait_lane,
             "whole_blocks": whole, "layer_groups": layer_groups}
    # within one pool when d is s: one traced value
    return tuple(st.lane_copy(d, s, plan, **lanes)
                 for d, s, st in zip(dsts, srcs, storages)), token


def _lane_within_impl(pools, plan, token, lane, wait_lane, stream_wait_lane, whole, storages,
                      layer_groups):
    # each pool is its own source: one traced value, which the lane copy copies within
    return _lane_across_impl(pools, pools, plan, token, lane, wait_lane, stream_wait_lane, whole,
                             storages, layer_groups)


def _join_impl(arrays, token, lanes):
    # One wait on XLA's stream, through the first device array; the other device arrays pass
    # through a barrier with it, which puts them after the wait in XLA's order too (one custom
    # call, not one per array: a pool over an engine's arrays may have dozens). A pinned_host
    # array (a pool's host rows: one a pool) gets a join of its own: host memory goes only
    # where custom calls take it.
    out = list(arrays)
    on_device = [i for i, a in enumerate(arrays) if memory_space(a) != jax.memory.Space.Host]
    for i, a in enumerate(arrays):
        if i not in on_device[1:]:
            out[i] = join_call(a, lanes)
    if len(on_device) > 1:
        for i, a in zip(on_device, jax.lax.optimization_barrier(tuple(out[i] for i in on_device))):
            out[i] = a
    return tuple(out), token


def _donated_and_not(impl, pools_argnums: tuple[int, ...], token_argnum: int, static):
    """The jitted `impl` donating its pools (updated in place) and its plan-ring tokens, and the
    same donating only the tokens: for a pool a NumPy view pins (XLA then copies it)."""
    return (jax.jit(impl, donate_argnums=pools_argnums + (token_argnum,), static_argnames=static),
            jax.jit(impl, donate_argnums=token_argnum, static_argnames=static))


_STATIC = ("facts", "mesh", "storages", "whole")
_LANE_STATIC = ("lane", "wait_lane", "stream_wait_lane", "whole", "storages", "layer_groups")
COPY_ACROSS = _donated_and_not(_copy_across_impl, (0,), 3, _STATIC)
COPY_WITHIN = _donated_and_not(_copy_within_impl, (0,), 2, _STATIC)
LANE_ACROSS = _donated_and_not(_lane_across_impl, (0,), 3, _LANE_STATIC)
LANE_WITHIN = _donated_and_not(_lane_within_impl, (0,), 2, _LANE_STATIC)
JOIN = _donated_and_not(_join_impl, (0,), 1, ("lanes",))


def _bucket(n: int) -> int:
    """Batch sizes are padded to powers of two so a new batch size rarely recompiles."""
    return 1 << max(0, n - 1).bit_length()


def plan_tokens(slots: Sequence[PlanSlot | None], retry: bool = False) -> tuple[Any, ...]:
    """The tokens a dispatch reading these plan ring slots donates (None for a NumPy plan).
    retry: after a dispatch that failed, which may have consumed them."""
    if retry:
        for slot in slots:
            if slot is not None:
                slot.fresh_token()
    return tuple(None if slot is None else slot.token for slot in slots)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The stack level, counted from warnings.warn's caller, of the first frame outside this
    package: the user's call, however deep the manager's own frames go."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level - 1


class Fence:
    """Every copy an engine dispatched before the fence was made: `done()` says whether they
    have all finished without waiting, `wait()` waits; both may be called from any thread.

    The last dispatch's plan-ring token is ready once XLA has run that dispatch, and XLA runs
    a device's dispatches in order; a lane copy is enqueued when its dispatch runs, so after
    that, idle lanes mean the copies are done. A token that has been deleted was donated to a
    later dispatch reading its ring slot, which the ring hands out only once the token was
    ready.
    """

    def __init__(self, token: jax.Array | None, lanes: bool) -> None:
        self._token, self._lanes = token, lanes

    def done(self) -> bool:
        return self._dispatches_ran(wait=False) and (not self._lanes or lanes_idle())

    def wait(self) -> None:
        self._dispatches_ran(wait=True)
        if self._lanes:
            wait_lanes()

    def _dispatches_ran(self, wait: bool) -> bool:
        token = self._token
        if token is None:
            return True
        try:
            if wait:
                token.block_until_ready()
                return True
            return token.is_ready()
        except Exception:  # donated meanwhile, by the serving thread
            if token.is_deleted():
                return True
            raise


class Engine:
    """What both engines share: the pools, the plan ring, and the donating dispatch."""

    def __init__(self, pools: Sequence[Any], plans: PlanRing | None) -> None:
        self.pools = tuple(pools)
        self.plans = plans
        first = self.pools[0]
        self.mesh = first.mesh
        self.storages = tuple(p.storage for p in self.pools)
        self.last_token: jax.Array | None = None  # of the last copy dispatched (see Fence)

    def plan_arrays(self, run: PairBatch) -> tuple[Any, PlanSlot | None]:
        """(what to pass for the run's [3, bucket] plan, its ring slot or None)."""
        n = len(run)
        if self.plans is None:
            plan = np.full((3, _bucket(n)), -1, np.int32)  # -1: a padding pair, skipped
            plan[0, :n], plan[1, :n], plan[2, :n] = run.src, run.dst, run.tokens
            return plan, None
        slot = self.plans.next_slot(_bucket(n))
        return slot.write((run.src, run.dst, run.tokens)), slot

    def dispatch(self, fns: tuple[Any, Any], args: tuple, slots: Sequence[PlanSlot | None],
                 static: dict[str, Any], which: str) -> Any:
        """Runs the donating form of `fns`; where a NumPy view pins a pool array (it cannot be
        donated), the other form, which copies that pool, with a DonationWarning naming
        `which` pool array. The slots' tokens are passed last and handed back to them."""
        donated, undonated = fns
        try:
            *results, tokens = donated(*args, plan_tokens(slots), **static)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if not pinned_by_external_reference(e):
                raise
            warnings.warn(
                f"pool.{which} could not be updated in place because a NumPy view of it exists "
                "(np.asarray on a host-memory array keeps one); this transfer copied the whole "
                "pool instead. Read pools with jax_kvxfer.to_numpy.", DonationWarning,
                stacklevel=_user_stacklevel())
            *results, tokens = undonated(*args, plan_tokens(slots, True), **static)
        for slot, token in zip(slots, tokens):
            if slot is not None:
                slot.dispatched(token)
                self.last_token = token
        return results[0] if len(results) == 1 else results

    def current(self, is_primary: bool) -> tuple[Any, ...]:
        """The pools' arrays of one memory, as a copy takes them: the manager found them live
        (`_check_live`) before it dispatched anything."""
        return tuple([p.stored(is_primary) for p in self.pools])

    def take(self, is_primary: bool, arrays: Sequence[Any]) -> None:
        for pool, array in zip(self.pools, arrays):
            pool.take_copy_result(is_primary, array)

    def fence(self) -> Fence:
        """A fence for the copies dispatched so far. Without the plan ring there is no token
        to tell by: this waits for them at once."""
        if self.plans is None:
            self.sync()
            return Fence(None, False)
        return Fence(self.last_token, isinstance(self, LaneEngine) and self.asynchronous)

    def sync(self) -> None:
        """Blocks until every copy dispatched so far is done."""
        self._arrays_ready()
        if self.plans is not None:
            self.plans.all_done()

    def _arrays_ready(self) -> None:
        arrays = jax.tree.leaves([(p.stored(True), p.stored(False)) for p in self.pools])
        jax.block_until_ready([a for a in arrays if not a.is_deleted()])


class InLineEngine(Engine):
    """The copy kernel on XLA's stream, in line with compute."""

    def copy(self, run: PairBatch) -> None:
        src_primary, dst_primary = run.direction
        plan, slot = self.plan_arrays(run)
        static = {"mesh": self.mesh, "storages": self.storages, "whole": run.whole}
        if src_primary == dst_primary:  # within the GPU pool
            blocks = self.pools[0].num_primary_blocks
            static["facts"] = index_facts(run.src, run.dst, blocks, blocks)
            args, fns = (self.current(True), plan), COPY_WITHIN
        else:
            static["facts"] = IndexFacts(hazard_free=True, unique_dst=run.unique_dst)
            args, fns = (self.current(dst_primary), self.current(src_primary), plan), COPY_ACROSS
        self.take(dst_primary, self.dispatch(fns, args, (slot,), static,
                                             "primary" if dst_primary else "secondary"))

    def join(self, everything: bool) -> None:
        """Nothing to join: every copy is on XLA's stream already."""

    def hand_to_step(self) -> None:
        """Nothing to hand over: every copy is on XLA's stream already."""


class LaneEngine(Engine):
    """The copies on the transfer lanes, beside compute (_lanes.py), ordered by LaneHazards.

    asynchronous: the lanes really run behind XLA's back (a GPU); on the CPU a lane copy is
    done when its call is, and nothing needs joining.
    """

    def __init__(self, pools: Sequence[Any], plans: PlanRing, lock: Any,
                 layer_groups: int = 1) -> None:
        super().__init__(pools, plans)
        self.layer_groups = layer_groups  # an onboard's copies, in groups of layers
        first = self.pools[0]
        self.hazards = LaneHazards(first.num_primary_blocks, first.num_secondary_blocks)
        self.asynchronous = first.device.platform == "gpu"
        self._lock = lock
        if self.asynchronous:
            # An engine dropped with copies in flight: its pools' arrays must outlive them.
            weakref.finalize(self, wait_lanes)
        # What a pool calls when user code reads or assigns an array the lanes still use
        # (KVCacheBlockPool.hold_for_lanes); weak, so that pools do not keep their manager.
        this = weakref.ref(self)
        self._user_join = lambda name: (e := this()) is not None and e.user_join(name)

    def copy(self, run: PairBatch) -> None:
        src_primary, dst_primary = run.direction
        order = self.hazards.order(run.src, run.dst, src_primary, dst_primary)
        plan, slot = self.plan_arrays(run)
        static = {"lane": order.lane, "wait_lane": order.wait_lane,
                  "stream_wait_lane": order.stream_wait_lane, "whole": run.whole,
                  "storages": self.storages, "layer_groups": self.layer_groups}
        if src_primary == dst_primary:
            args, fns = (self.current(True), plan), LANE_WITHIN
        else:
            args, fns = (self.current(dst_primary), self.current(src_primary), plan), LANE_ACROSS
        self.take(dst_primary, self.dispatch(fns, args, (slot,), static,
                                             "primary" if dst_primary else "secondary"))
        if self.asynchronous:
            # the arrays the lane still uses: what it writes, and an onboard's source (an
            # offload's source was snapshotted)
            held = (("secondary",) if not dst_primary else
                    ("primary",) if src_primary else ("primary", "secondary"))
            for pool in self.pools:
                pool.hold_for_lanes(held, self._user_join)
        self.hazards.record(run.src, run.dst, src_primary, dst_primary)

    def join(self, everything: bool, through: tuple[bool, ...] | None = None) -> None:
        """XLA's stream waits for lane 1 (onboards and copies within the GPU pool: everything
        compute may read) or, with `everything`, for both lanes; one dispatch. Later copies
        and steps then come after those lanes' pending copies, whose slots are pending no more.
        through: the memories (True: primary) whose arrays the join takes and hands on, which
        only places it in XLA's order (default: the primary, and with `everything` the
        secondary too); the arrays it takes are replaced, so a reference user code kept to
        one of them is deleted.
        """
        hazards = self.hazards
        if not (hazards.onboards_pending or (everything and hazards.offloads_pending)):
            if hazards.offloads_pending and self.fence().done():
                self._offloads_done()
            return
        lanes = (OFFLOAD_LANE, ONBOARD_LANE) if everything else (ONBOARD_LANE,)
        through = through or ((True, False) if everything else (True,))
        # the pools' arrays (a pool over an engine's arrays has a list), absent ones left out
        arrays, tree = jax.tree.flatten([[p.stored(m) for m in through] for p in self.pools])
        which = " and ".join(("primary", "secondary")[not m] for m in through)
        joined = self.dispatch(JOIN, (tuple(arrays),), (), {"lanes": lanes}, which)
        for pool, new in zip(self.pools, jax.tree.unflatten(tree, list(joined))):
            for memory, array in zip(through, new):
                if array is not None:
                    pool.take_copy_result(memory, array)
        self._settled(everything)

    def hand_to_step(self) -> None:
        """The step dispatched next joins lane 1 itself, layer by layer (`wait_for_layers`,
        every layer before it reads it): no join here, and later copies count lane 1's
        pending copies as joined, as after `join`."""
        self._settled(False)

    def _settled(self, everything: bool) -> None:
        """Once XLA's stream is ordered after lane 1 (and with `everything`, lane 0)."""
        self._onboards_done()
        # Idle lanes alone would not do: an offload whose dispatch XLA has not run yet is not
        # on its lane yet.
        if everything or not self.hazards.offloads_pending or self.fence().done():
            self._offloads_done()

    def user_join(self, name: str) -> None:
        """User code reads or assigns a pool's `name` array ("primary" or "secondary") while
        lane copies use it: XLA's stream waits for them before anything dispatched later (the
        primary: for lane 1, whose copies write it; the secondary: for both lanes). A
        non-blocking sync of what that array needs: offloads still run beside the next step
        when only the primary is read, and the join takes only that array, so references
        user code holds to the other stay live."""
        with self._lock:
            if name == "primary":
                self.join(everything=False)
            else:
                self.join(everything=True, through=(False,))

    def sync(self) -> None:
        # Once the pools' arrays are ready, every lane copy is enqueued; once the lanes are
        # idle, all is done, and later work needs no join on XLA's stream.
        self._arrays_ready()
        if self.hazards.onboards_pending or self.hazards.offloads_pending:
            wait_lanes()
            self._onboards_done()
            self._offloads_done()
        self.plans.all_done()

    def _onboards_done(self) -> None:
        # the secondary arrays, which onboards read, stay held while offloads write them
        held = ("primary",) if self.hazards.offloads_pending else ("primary", "secondary")
        for pool in self.pools:
            pool.release_lanes(held)
        self.hazards.onboards_done()

    def _offloads_done(self) -> None:
        for pool in self.pools:
            pool.release_lanes(("secondary",))
        self.hazards.offloads_done()
