"""Pools over an engine's own per-layer KV arrays (`KVCacheBlockPool.from_layers`).

The GPU side is the engine's arrays as they are, one per layer (or per layer and K/V), each in
its own layout (`_layouts.py`: blocks along `block_axis`, a partial copy's tokens along
`token_axis`). The host side is one `pinned_host` array `[num_host_blocks, row]` whose row holds
a block of every layer, in order (K/V-first layers slab by slab), so that offloading a block
writes one contiguous row. Every layer moves in one custom call per batch
(`jax_kvxfer_layer_copy`, ffi/layer_copy.h): the buffers are a variadic list.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import _layouts as layouts
from ..ops import _native
from ..ops._checks import dtype_bits, is_split
from ..ops._lowering import CopyPlan, block_copy_call
from ._hazards import NO_LANE


class LayerViews(NamedTuple):
    """The geometry of a pool's per-layer arrays, as the layered copy sees it (hashable: it is
    a static argument of the jitted copies)."""

    layouts: tuple[layouts.Layout, ...]  # one per array (of one device's shard, where split)
    itemsize: int  # bytes per element
    # where the arrays are split by heads over a mesh: each array's PartitionSpec, and the host
    # array's, `[rows, devices, row]` split along its second axis (one row part per device)
    specs: tuple[jax.sharding.PartitionSpec, ...] | None = None
    host_spec: jax.sharding.PartitionSpec | None = None

    @property
    def num_blocks(self) -> int:
        return self.layouts[0].num_blocks

    @property
    def tokens_per_block(self) -> int:
        lay = self.layouts[0]
        return lay.shape[lay.token_axis]

    def _part(self, lay: layouts.Layout) -> tuple[int, int, int]:
        """(copies, outer, row bytes) of one layer's block."""
        _, outer, _, _, _, row = lay.view
        return lay.copies, outer, row * self.itemsize

    @property
    def attribute(self) -> np.ndarray:
        """The custom call's `views`: per layer copies, num_blocks, outer, tokens, row bytes."""
        views = []
        for lay in self.layouts:
            copies, outer, row = self._part(lay)
            views += [copies, lay.num_blocks, outer, self.tokens_per_block, row]
        return np.array(views, np.int64)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one host row: a block of every layer."""
        return sum(c * o * self.tokens_per_block * r for c, o, r in map(self._part, self.layouts))


def layer_views(arrays: Any, token_axis: Any, block_axis: Any) -> LayerViews:
    """The views of `arrays` (an engine's per-layer arrays, on one device or split by heads over
    a mesh: then of each device's shard), checked.

    Raises:
      TypeError: not a sequence of jax.Arrays, an axis not an int, or dtypes that differ.
      ValueError: no arrays, an axis that does not fit, arrays that disagree on the number of
        blocks or tokens per block, or split otherwise than by one mesh axis along a head axis.
    """
    if isinstance(arrays, jax.Array) or not isinstance(arrays, Sequence):
        raise TypeError("arrays must be a sequence of jax.Arrays, one per layer (or per layer "
                        f"and K/V), got {type(arrays).__name__}")
    if not arrays:
        raise ValueError("arrays must hold at least one array")
    for i, a in enumerate(arrays):
        if not isinstance(a, jax.Array):
            raise TypeError(f"arrays[{i}] must be a jax.Array, got {type(a).__name__}")
    dtype = arrays[0].dtype
    if dtype_bits(dtype) % 8:
        raise TypeError(f"arrays have dtype {dtype}: pools over per-layer arrays take dtypes of "
                        "whole bytes")
    lays = []
    for i, a in enumerate(arrays):
        if a.dtype != dtype:
            raise TypeError(f"arrays[{i}] has dtype {a.dtype}, expected arrays[0]'s {dtype}")
        layouts.layout(f"arrays[{i}]", a, token_axis, block_axis)  # the axes fit the array
    split = _split(arrays, token_axis, block_axis)
    for i, a in enumerate(arrays):
        shard = jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype)
        lay = layouts.layout(f"arrays[{i}]", shard, token_axis, block_axis)
        first = lays[0] if lays else lay
        if lay.num_blocks != first.num_blocks:
            raise ValueError(f"arrays[{i}] has {lay.num_blocks} blocks along block_axis, "
                             f"expected arrays[0]'s {first.num_blocks}")
        tokens, first_tokens = lay.shape[lay.token_axis], first.shape[first.token_axis]
        if tokens != first_tokens:
            raise ValueError(f"arrays[{i}] has {tokens} tokens per block along token_axis, "
                             f"expected arrays[0]'s {first_tokens}")
        lays.append(lay)
    if split is None:
        return LayerViews(tuple(lays), jnp.dtype(dtype).itemsize)
    axis, specs = split
    return LayerViews(tuple(lays), jnp.dtype(dtype).itemsize, specs,
                      jax.sharding.PartitionSpec(None, axis, None))


def _split(arrays: Sequence[jax.Array], token_axis: Any, block_axis: Any) -> Any:
    """None for arrays on one device; for arrays split over a mesh, (the mesh axis, the arrays'
    specs), checked: every array split along one axis after block_axis other than token_axis
    (a head axis), by one mesh axis, the same for all, on one mesh."""
    if not any(is_split(a.sharding) for a in arrays):
        return None
    first = arrays[0].sharding
    axis, specs = None, []
    for i, a in enumerate(arrays):
        sh = a.sharding
        if not isinstance(sh, jax.sharding.NamedSharding) or not isinstance(
                first, jax.sharding.NamedSharding) or sh.mesh != first.mesh:
            raise ValueError(f"arrays[{i}] must be split by a NamedSharding over arrays[0]'s "
                             f"mesh, got {sh}")
        b = layouts.axis("block_axis", block_axis, a.ndim)
        t = layouts.axis("token_axis", token_axis, a.ndim)
        spec = tuple(sh.spec) + (None,) * (a.ndim - len(sh.spec))
        named = [(d, n) for d, n in enumerate(spec) if n is not None]
        if len(named) != 1 or not isinstance(named[0][1], str) or named[0][0] <= b or \
                named[0][0] == t or (axis is not None and named[0][1] != axis):
            raise ValueError(
                f"arrays[{i}] has PartitionSpec {sh.spec}: pools over an engine's arrays are "
                "split along one head axis (after block_axis, not token_axis) by one mesh "
                "axis, the same for every array")
        axis = named[0][1]
        specs.append(jax.sharding.PartitionSpec(*spec))
    return axis, tuple(specs)


def check_layers(name: str, arrays: Any, like: Sequence[jax.Array]) -> list[jax.Array]:
    """`arrays` as a list, checked to match `like` (shapes, dtype, sharding) in device memory."""
    if isinstance(arrays, jax.Array) or not isinstance(arrays, Sequence):
        raise TypeError(f"{name} must be a list of jax.Arrays, one per layer, got "
                        f"{type(arrays).__name__}")
    if len(arrays) != len(like):
        raise ValueError(f"{name} must hold {len(like)} arrays, got {len(arrays)}")
    out = []
    for i, (a, b) in enumerate(zip(arrays, like)):
        what = f"{name}[{i}]"
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
            raise TypeError(f"{what} must be a concrete jax.Array, got {type(a).__name__}")
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{what} must be {b.dtype}{list(b.shape)}, got {a.dtype}"
                             f"{list(a.shape)}")
        if a.is_deleted():
            raise ValueError(f"{what}: the array has been deleted (donated?)")
        if (a.sharding.memory_kind or "device") != "device" or \
                not a.sharding.is_equivalent_to(b.sharding.with_memory_kind("device"), a.ndim):
            raise ValueError(f"{what} must live in device memory with sharding "
                             f"{b.sharding.with_memory_kind('device')}, got {a.sharding}")
        out.append(a)
    return out


def layer_call(target: str, host: Any, layers: Sequence[Any], src_idx: Any, dst_idx: Any,
               tokens: Any, *, offload: bool, views: LayerViews, workspace: bool,
               **attributes: Any) -> Any:
    """Emits a layered custom call (`target`: the copy, or its lane form): offload (layers ->
    host rows, returns the new host array) or onboard (host rows -> layers, returns the new
    layers as a list). The destination is aliased to its result, so donated it is updated in
    place. `workspace`: the first result is the GPU's int32 scan workspace, one per pair."""
    extra = (jax.ShapeDtypeStruct((src_idx.shape[0],), jnp.int32),) if workspace else ()
    if offload:
        results, aliases = (*extra, jax.typeof(host)), {3: len(extra)}
    else:
        results = (*extra, *(jax.typeof(a) for a in layers))
        aliases = {4 + k: len(extra) + k for k in range(len(layers))}
    call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases,
                            vmap_method="sequential")
    out = call(src_idx, dst_idx, tokens, host, *layers, offload=np.bool_(offload),
               views=views.attribute, **attributes)[len(extra):]
    return out[0] if offload else list(out)


def layer_copy_call(host: Any, layers: Sequence[Any], src_idx: Any, dst_idx: Any, tokens: Any,
                    *, offload: bool, views: LayerViews, unique_dst: bool = False,
                    max_ctas: int | None = None, dma: bool = False,
                    whole_blocks: bool = False) -> Any:
    """The layered copy on XLA's stream (`layer_call`)."""
    return layer_call(_native.LAYER_COPY_TARGET, host, layers, src_idx, dst_idx, tokens,
                      offload=offload, views=views, workspace=True,
                      unique_dst=np.bool_(unique_dst),
                      max_ctas=np.int64(min(max_ctas or 0, 1 << 30)), dma=np.bool_(dma),
                      whole_blocks=np.bool_(whole_blocks))


def layer_lane_copy_call(host, layers, src_idx, dst_idx, tokens, *, offload: bool,
                         views: LayerViews, lane: int, wait_lane: int = NO_LANE,
                         stream_wait_lane: int = NO_LANE, whole_blocks: bool = False,
                         layer_groups: int = 1):
    """The layered copy enqueued on transfer lane `lane`, as `_lanes.lane_copy_call`. Returns
    the new host array (offload) or the new list of arrays (onboard)."""
    return layer_call(_native.LAYER_LANE_COPY_TARGET, host, layers, src_idx, dst_idx, tokens,
                      offload=offload, views=views, workspace=False, lane=np.int64(lane),
                      wait_lane=np.int64(wait_lane), stream_wait_lane=np.int64(stream_wait_lane),
                      whole_blocks=np.bool_(whole_blocks), layer_groups=np.int64(layer_groups))


def _on_devices(fn: Any, views: LayerViews, mesh: Any, in_specs: tuple, out_specs: Any) -> Any:
    """`fn` per device shard where the arrays are split over `mesh`, else `fn` itself."""
    if views.specs is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def manager_copy(dst: Any, src: Any, plan: Any, *, views: LayerViews, mesh: Any,
                 unique_dst: bool, dma: bool, whole: bool) -> Any:
    """The manager's copy between a pool's arrays (a list) and its host rows, either way; `plan`
    is `[3, B]` (source and destination slots, token counts)."""
    offload = not isinstance(dst, list)
    host, arrays = (dst, src) if offload else (src, dst)

    def copy(host, arrays, plan):
        local = host.reshape(host.shape[0], -1)  # a device's rows: [rows, 1, row] where split
        out = layer_copy_call(local, arrays, plan[0], plan[1], plan[2], offload=offload,
                              views=views, unique_dst=unique_dst, dma=dma, whole_blocks=whole)
        return out.reshape(host.shape) if offload else out

    everywhere = jax.sharding.PartitionSpec()
    specs = list(views.specs or ())
    return _on_devices(copy, views, mesh, (views.host_spec, specs, everywhere),
                       views.host_spec if offload else specs)(host, arrays, plan)


def _block_copy_within(view, src_idx, dst_idx, tokens, facts, *, whole_blocks):
    return block_copy_call(view, view, src_idx, dst_idx, tokens,
                           CopyPlan(facts, whole_blocks=whole_blocks))


def manager_copy_within(pool: Any, plan: Any, facts: Any, *, views: LayerViews, mesh: Any,
                        whole: bool, copy: Any = None) -> Any:
    """The manager's copy within a pool's arrays (the partial-reuse copy within the GPU), each
    in its own layout, through `copy(view, src_idx, dst_idx, tokens, facts)` of its 6-D view:
    by default the block copy on XLA's stream."""
    everywhere = jax.sharding.PartitionSpec()
    copy_view = copy or functools.partial(_block_copy_within, whole_blocks=whole)

    def copy_arrays(arrays, plan):
        out = []
        for a, lay in zip(arrays, views.layouts):
            pairs = (layouts.expand_pairs(plan[0], lay), layouts.expand_pairs(plan[1], lay),
                     layouts.expand_tokens(plan[2], lay))
            out.append(copy_view(a.reshape(lay.view), *pairs, facts).reshape(a.shape))
        return out
    specs = list(views.specs or ())
    return _on_devices(copy_arrays, views, mesh, (specs, everywhere), specs)(pool, plan)

