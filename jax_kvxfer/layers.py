"""Pools over an engine's own per-layer KV arrays (`KVCacheBlockPool.from_layers`).

The GPU side is the engine's arrays as they are, one per layer (or per layer and K/V), each in
its own layout (`_layouts.py`: blocks along `block_axis`, a partial copy's tokens along
`token_axis`). The host side is one `pinned_host` array `[num_host_blocks, row]` whose row holds
a block of every layer, in order (K/V-first layers slab by slab), so that offloading a block
writes one contiguous row. Every layer moves in one custom call per batch
(`jax_kvxfer_layer_copy`, ffi/layer_copy.h): the buffers are a variadic list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _layouts as layouts
from . import _native
from ._checks import dtype_bits, is_split


class LayerViews(NamedTuple):
    """The geometry of a pool's per-layer arrays, as the layered copy sees it (hashable: it is
    a static argument of the jitted copies)."""

    layouts: tuple[layouts.Layout, ...]  # one per array
    itemsize: int  # bytes per element

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
        return np.array([x for lay in self.layouts for x in (
            lay.copies, lay.num_blocks, self._part(lay)[1], self.tokens_per_block,
            self._part(lay)[2])], np.int64)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one host row: a block of every layer."""
        return sum(c * o * self.tokens_per_block * r for c, o, r in map(self._part, self.layouts))

    def token_nbytes(self) -> int:
        """Bytes one token of a block occupies in all layers together."""
        return self.row_nbytes // self.tokens_per_block


def layer_views(arrays: Any, token_axis: Any, block_axis: Any) -> LayerViews:
    """The views of `arrays` (an engine's per-layer arrays), checked.

    Raises:
      TypeError: not a sequence of jax.Arrays, an axis not an int, or dtypes that differ.
      ValueError: no arrays, an axis that does not fit, or arrays that disagree on the number
        of blocks, tokens per block or device.
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
        lay = layouts.layout(f"arrays[{i}]", a, token_axis, block_axis)
        first = lays[0] if lays else lay
        if lay.num_blocks != first.num_blocks:
            raise ValueError(f"arrays[{i}] has {lay.num_blocks} blocks along block_axis, "
                             f"expected arrays[0]'s {first.num_blocks}")
        tokens, first_tokens = lay.shape[lay.token_axis], first.shape[first.token_axis]
        if tokens != first_tokens:
            raise ValueError(f"arrays[{i}] has {tokens} tokens per block along token_axis, "
                             f"expected arrays[0]'s {first_tokens}")
        lays.append(lay)
    return LayerViews(tuple(lays), jnp.dtype(dtype).itemsize)


def check_layers(name: str, arrays: Any, like: Sequence[jax.Array],
                 sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """`arrays` as a list, checked to match `like` (shapes, dtype) and live on `sharding`."""
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
        if is_split(a.sharding):
            raise ValueError(f"{what} is split over {len(a.sharding.device_set)} devices: pools "
                             "over an engine's arrays take arrays on one device")
        if (a.sharding.memory_kind or "device") != "device" or \
                not a.sharding.is_equivalent_to(sharding, a.ndim):
            raise ValueError(f"{what} must live in device memory on {sharding}, got "
                             f"{a.sharding}")
        out.append(a)
    return out


def layer_copy_call(host: Any, layers: Sequence[Any], src_idx: Any, dst_idx: Any, tokens: Any,
                    *, offload: bool, views: LayerViews, unique_dst: bool = False,
                    max_ctas: int | None = None, dma: bool = False,
                    whole_blocks: bool = False) -> Any:
    """Emits the layered copy: offload (layers -> host rows, returns the new host array) or
    onboard (host rows -> layers, returns the new layers as a list). The destination is aliased
    to its result, so donated it is updated in place."""
    operands = (src_idx, dst_idx, tokens, host, *layers)
    batch = src_idx.shape[0]
    workspace = jax.ShapeDtypeStruct((batch,), jnp.int32)
    if offload:
        results, aliases = (workspace, jax.typeof(host)), {3: 1}
    else:
        results = (workspace, *(jax.typeof(a) for a in layers))
        aliases = {4 + k: 1 + k for k in range(len(layers))}
    call = jax.ffi.ffi_call(_native.LAYER_COPY_TARGET, results, input_output_aliases=aliases,
                            vmap_method="sequential")
    out = call(*operands, offload=np.bool_(offload), views=views.attribute,
               unique_dst=np.bool_(unique_dst), max_ctas=np.int64(min(max_ctas or 0, 1 << 30)),
               dma=np.bool_(dma), whole_blocks=np.bool_(whole_blocks))
    return out[1] if offload else list(out[1:])


def host_rows_view(host: Any) -> Any:
    """The host array as a 6-D pool of whole rows (copies between host rows take whole blocks)."""
    return host.reshape(host.shape[0], 1, 1, 1, 1, math.prod(host.shape[1:]))

