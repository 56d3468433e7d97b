"""Engines' own KV layouts as views the block copy takes.

The copy's native geometry is a pool `[num_blocks, outer..., tokens, inner...]` whose blocks are
contiguous: a partial copy of n tokens takes, for every outer index, the first n token rows.
Any array whose token axis comes after its block axis is such a pool once reshaped (a free
bitcast inside `jax.jit`): the axes between the block and token axes fold into one outer axis,
the axes after the token axis into one row. Axes before the block axis (K/V first,
`[2, num_blocks, ...]`) make each block `copies` slabs, one per leading index; folded into the
block axis, they become `copies * num_blocks` blocks, and a pair (s, d) becomes `copies` pairs
(s + k * num_blocks, d + k * num_blocks).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np


class Layout(NamedTuple):
    shape: tuple[int, ...]  # the array's own shape
    block_axis: int
    token_axis: int

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_axis]

    @property
    def copies(self) -> int:
        """Slabs per block: the product of the axes before the block axis."""
        return math.prod(self.shape[:self.block_axis])

    @property
    def view(self) -> tuple[int, ...]:
        """The 6-D pool shape the copy takes: `[copies * num_blocks, outer, 1, 1, tokens,
        row]`."""
        s, b, t = self.shape, self.block_axis, self.token_axis
        return (self.copies * s[b], math.prod(s[b + 1:t]), 1, 1, s[t], math.prod(s[t + 1:]))


def axis(name: str, value: Any, ndim: int) -> int:
    """`value` as an axis of an array of `ndim` dimensions (negative counts from the end)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not -ndim <= value < ndim:
        raise ValueError(f"{name}={value} is out of range for an array of {ndim} dimensions")
    return int(value) % ndim


def layout(name: str, array: Any, token_axis: Any, block_axis: Any) -> Layout:
    """The layout of `array` (named `name` in errors) with these axes.

    Raises:
      TypeError: an axis that is not an int.
      ValueError: an axis out of range, or the token axis not after the block axis.
    """
    ndim = len(array.shape)
    if ndim < 2:
        raise ValueError(f"{name} must have a block axis and a token axis, got shape "
                         f"{tuple(array.shape)}")
    b = axis("block_axis", block_axis, ndim)
    t = axis("token_axis", token_axis, ndim)
    if t <= b:
        raise ValueError(f"token_axis ({t}) must come after block_axis ({b}) in {name} of shape "
                         f"{tuple(array.shape)}")
    return Layout(tuple(array.shape), b, t)


def expand_pairs(indices: Any, lay: Layout) -> Any:
    """Each index as `copies` indices into the view's blocks, slab by slab; a negative or (traced)
    out-of-range index stays one the copy skips."""
    if lay.copies == 1:
        return indices
    xp = np if isinstance(indices, np.ndarray) else jnp
    valid = (indices >= 0) & (indices < lay.num_blocks)
    return xp.concatenate([xp.where(valid, indices + k * lay.num_blocks, -1)
                           for k in range(lay.copies)]).astype(np.int32)


def expand_tokens(tokens: Any, lay: Layout) -> Any:
    xp = np if isinstance(tokens, np.ndarray) else jnp
    return tokens if lay.copies == 1 else xp.tile(tokens, lay.copies)
