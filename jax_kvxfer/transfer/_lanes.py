"""Transfer lanes: the manager's copies beside compute, as TensorRT-LLM's side streams do.

Each GPU has two lanes, streams of the library's own: lane 0 carries offloads (device ->
pinned host), lane 1 onboards (pinned host -> device) and copies within the GPU pool. A lane
copy is a custom call on XLA's stream that enqueues its copy on the lane behind everything XLA's
stream had before it, and returns; XLA's later work, the model step, runs beside the copy. The
lanes move blocks with the GPU's copy engines, so they take no SMs from the step (but for an
onboard of small host rows in runs: one copy per run into staging, then the copy kernel on a
few SMs scatters the blocks). A join makes XLA's stream wait for the lanes it names: everything
after it sees their copies done.

Who keeps what safe (the manager, manager.py, uses these):
- an offload snapshots its source blocks on XLA's stream before the lane copies them, so compute
  may overwrite the source blocks at once;
- the handler reads the block indices on the host as it enqueues (the plan ring's pinned_host
  arrays), so nothing XLA owns is read after the call;
- the lanes wait for each other where the manager says one lane's copy touches slots that the
  other's pending copies touch, and XLA's stream waits for lane 1 before snapshotting blocks
  that lane 1 is still writing;
- until a join, compute must not read or write the blocks that onboards and copies within the
  GPU pool write (nor the sources of the latter): the pool keeps this, by joining lane 1 when
  user code reads its primary array (pool.py, `hold_for_lanes`), as TensorRT-LLM's
  `syncTransfers` does at the step boundary; or, after a layer-wise sync, the step joins it
  itself, each layer waiting for its group's copies (`wait_for_layers`).

On the CPU a lane copy is done when its call is, and a join hands its array on.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..ops import _native
from ..ops._checks import check_int
from ._hazards import NO_LANE, OFFLOAD_LANE, ONBOARD_LANE


def lane_copy_call(dst_pool, src_pool, src_idx, dst_idx, tokens, *, lane: int,
                   wait_lane: int = NO_LANE, stream_wait_lane: int = NO_LANE,
                   whole_blocks: bool = False, layer_groups: int = 1):
    """The copy of `copy_blocks` (same pair semantics, `src_pool is dst_pool` within one pool)
    enqueued on `lane`. The indices must be pinned_host arrays whose values are written before
    the dispatch (the manager's plan ring). wait_lane: the lane first waits for that lane's
    pending copies; stream_wait_lane: XLA's stream waits for that lane first (NO_LANE: none);
    layer_groups: an onboard's copies in that many groups of layers (`layer_group_bounds`),
    each marked for `wait_for_layers` as it lands (1: not split)."""
    within = src_pool is dst_pool
    target = _native.LANE_COPY_WITHIN_TARGET if within else _native.LANE_COPY_TARGET
    call = jax.ffi.ffi_call(target, jax.typeof(dst_pool), input_output_aliases={0: 0},
                            vmap_method="sequential")
    pools = (dst_pool,) if within else (dst_pool, src_pool)
    return call(*pools, src_idx, dst_idx, tokens, lane=np.int64(lane),
                wait_lane=np.int64(wait_lane), stream_wait_lane=np.int64(stream_wait_lane),
                whole_blocks=np.bool_(whole_blocks), layer_groups=np.int64(layer_groups))


def layer_group_bounds(group: int, groups: int, num_layers: int) -> tuple[int, int]:
    """The layers `[lo, hi)` of group `group` of `groups` over `num_layers` layers, as an
    onboard with layer groups splits them (the native side, ffi/dma_plan.h, spells the same
    rule): as near equal as whole layers allow."""
    return group * num_layers // groups, (group + 1) * num_layers // groups


def wait_for_layers(array: Any, layers: int) -> Any:
    """`array`, handed on once the first `layers` layers of every onboard issued so far have
    landed: for a model step, inside `jax.jit`, before its layers below `layers` read the
    pool, after `KVCacheTransferManager.sync_transfers(block=False, layer_wise=True)`.

    On a GPU, XLA's stream waits there for the onboards' copies of those layers alone (a
    manager with `layer_groups` copies an onboard group of layers by group, see
    `layer_group_bounds`); the step's earlier layers run meanwhile. On the CPU the copies are
    done already, and the array is handed on.

    Args:
      array: a jax.Array (or a traced one) on the pool's device, which the wait orders: pass
        the pool array the next layers read, and read it from the result. For a pool of much
        of the device's memory, pass instead what every read of those layers indexes the
        pool by (their layer indices), index by the result, and keep the wait after the
        earlier layers (an optimization barrier with their activations), as the demo's model
        does: XLA's memory estimate counts a pool passed through a wait more than once and,
        past the device's memory, compiles another program for the step.
      layers: how many of the pool's first layers (`pool.num_layers`; for a pool over an
        engine's arrays, its arrays in order) must have landed, at least 1.

    Raises:
      TypeError, ValueError: `layers` not a positive integer.
    """
    if check_int("layers", layers) < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    call = jax.ffi.ffi_call(_native.WAIT_LAYERS_TARGET, jax.typeof(array),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(array, layers=np.int64(layers))


def join_call(array, lanes: tuple[int, ...] = (OFFLOAD_LANE, ONBOARD_LANE)):
    """`array`, handed on once XLA's stream has waited for these lanes of its device."""
    call = jax.ffi.ffi_call(_native.JOIN_LANES_TARGET, jax.typeof(array),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(array, lanes=np.int64(sum(1 << lane for lane in lanes)))


# The host's side of the lanes, in the compiled module (ffi/streams.h).
wait_lanes = _native.wait_lanes
lanes_idle = _native.lanes_idle
take_exposed_seconds = _native.take_exposed_seconds
