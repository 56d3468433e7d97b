"""A batch of (src_block, dst_block) pairs checked and held as NumPy columns.

The manager's per-call Python work is on the critical path of every transfer (its target is
well under 200 us for 64 blocks), so the pairs are read and checked in one native pass
(ffi/slot_columns.cc); the per-pair Python loops run only to name the first bad pair in an
error, or to split mixed batches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..ops import _native
from .block import KVCacheBlock

_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class PairBatch:
    """Validated pairs: block indices, memories (True: primary) and token counts."""

    src: np.ndarray  # int64 [n]
    src_primary: np.ndarray  # bool [n]
    dst: np.ndarray  # int64 [n]
    dst_primary: np.ndarray  # bool [n]
    tokens: np.ndarray  # int32 [n], clipped to [-1, int32 max]
    whole: bool  # every pair copies a whole block (a part of a batch: false if the batch's is)
    # (source, destination) memory (True: primary) shared by every pair; None: mixed or empty
    direction: tuple[bool, bool] | None
    # `unique_dst` where the check found it on its way (the native pass does); None: worked
    # out when first asked, which the transfer lanes never do
    unique_dst_found: bool | None = None

    def __len__(self) -> int:
        return len(self.src)

    @functools.cached_property
    def unique_dst(self) -> bool:
        """No two pairs write one slot (index and memory)."""
        if self.unique_dst_found is not None:
            return self.unique_dst_found
        if self.direction is not None:  # one memory: the indices tell
            return len(set(self.dst.tolist())) == len(self)
        return len(set(zip(self.dst.tolist(), self.dst_primary.tolist()))) == len(self)

    def take(self, rows: slice | np.ndarray) -> PairBatch:
        src_primary, dst_primary = self.src_primary[rows], self.dst_primary[rows]
        # a part of a batch without repeated destinations has none; else found out when asked
        return PairBatch(self.src[rows], src_primary, self.dst[rows], dst_primary,
                         self.tokens[rows], self.whole, _direction(src_primary, dst_primary),
                         self.unique_dst_found or None)


def _direction(src_primary: np.ndarray, dst_primary: np.ndarray) -> tuple[bool, bool] | None:
    n = len(src_primary)
    s, d = np.count_nonzero(src_primary), np.count_nonzero(dst_primary)
    return (s == n, d == n) if n and s in (0, n) and d in (0, n) else None


def check_batch(pairs: Any, num_tokens: Any, num_primary: int, num_secondary: int,
                tokens_per_block: int) -> PairBatch:
    """Checks the pairs' types and indices, then the token counts; returns them as columns."""
    try:
        pairs = list(pairs)
    except TypeError as e:
        raise TypeError("pairs must be a sequence of (src_block, dst_block) tuples") from e
    n = len(pairs)
    # Read and checked in one native pass (slot_columns.cc): rows 0 / 1 hold the sources /
    # destinations.
    index, primary = np.empty((2, n), np.int64), np.empty((2, n), np.bool_)
    found = _native.slot_columns(pairs, KVCacheBlock, num_primary, num_secondary, index,
                                 primary)
    if found is None:  # some pair is not two blocks in range
        _explain_bad_pair(pairs, num_primary, num_secondary)
        # Only a block whose slot code is missing or disagrees gets here (not made by
        # KVCacheBlock(...)), or a pool of 2**62 blocks or more.
        raise TypeError("pairs must be a sequence of (src_block, dst_block) tuples of "
                        "KVCacheBlocks made by KVCacheBlock(...)")
    direction, unique_dst = found
    tokens = _check_tokens(num_tokens, n)
    return PairBatch(src=index[0], src_primary=primary[0], dst=index[1], dst_primary=primary[1],
                     tokens=tokens, whole=_whole(num_tokens, tokens, tokens_per_block),
                     direction=direction, unique_dst_found=unique_dst)


# What each verb may copy, as (source is primary, destination is primary): an offload moves
# GPU blocks to the host; an onboard moves host blocks to the GPU, or copies within the GPU
# (TensorRT-LLM's partial-reuse copy).
VERB_DIRECTIONS = {"offload": ((True, False),), "onboard": ((False, True), (True, True))}


def check_direction(op: str, name: str, pairs: Any, batch: PairBatch) -> None:
    """Raises ValueError naming the first pair of `batch` (argument `name`) that goes against
    the verb `op`'s direction: a reversed pair would silently copy the other way."""
    allowed = VERB_DIRECTIONS[op]
    if batch.direction in allowed:
        return
    ok = np.zeros(len(batch), np.bool_)
    for src_primary, dst_primary in allowed:
        ok |= (batch.src_primary == src_primary) & (batch.dst_primary == dst_primary)
    bad = np.flatnonzero(~ok)
    if not bad.size:
        return
    i = int(bad[0])
    src, dst = list(pairs)[i]
    memory = {True: "primary", False: "secondary"}
    wanted = " or ".join(f"{memory[s]} -> {memory[d]}" for s, d in allowed)
    other = next((verb for verb, directions in VERB_DIRECTIONS.items()
                  if (src.is_primary, dst.is_primary) in directions), None)
    raise ValueError(
        f"{op}: {name}[{i}] copies a {memory[src.is_primary]} block into a "
        f"{memory[dst.is_primary]} block ({src!r} -> {dst!r}), but {op} copies {wanted}"
        + (f"; that pair is an {other}" if other else ""))


def check_index_batch(src: Any, dst: Any, num_tokens: Any, src_primary: bool,
                      dst_primary: bool, num_primary: int, num_secondary: int,
                      tokens_per_block: int) -> PairBatch:
    """The batch of slot-index arrays `src` -> `dst` (every source in one memory, every
    destination in one: True for primary), checked; the errors name `src`, `dst` and
    `num_tokens` and the first bad entry."""
    columns = []
    for name, values, primary in (("src", src, src_primary), ("dst", dst, dst_primary)):
        array = _host_array(name, values, "a 1-D array or sequence of slot indices")
        if array.size == 0:
            array = array.astype(np.int64).reshape(-1)
        if array.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
        if array.dtype.kind not in "iu":  # not bool ("b"), float, ...
            raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
        column = array.astype(np.int64)  # the batch's own copy
        limit = num_primary if primary else num_secondary
        # one comparison finds both ends: as unsigned, a negative index is past any limit
        if np.count_nonzero(column.view(np.uint64) >= limit):
            _raise_out_of_range(name, array, limit, "primary" if primary else "secondary")
        columns.append(column)
    if len(columns[0]) != len(columns[1]):
        raise ValueError(f"src has {len(columns[0])} entries but dst has {len(columns[1])}; "
                         "give one destination per source")
    n = len(columns[0])
    tokens = _check_tokens(num_tokens, n)
    return PairBatch(src=columns[0], src_primary=_one_memory(n, src_primary),
                     dst=columns[1], dst_primary=_one_memory(n, dst_primary), tokens=tokens,
                     whole=_whole(num_tokens, tokens, tokens_per_block),
                     direction=(src_primary, dst_primary) if n else None)


@functools.lru_cache(maxsize=256)
def _one_memory(n: int, primary: bool) -> np.ndarray:
    """The memory column of n pairs in one memory: read-only and shared, since an engine's
    batches come in few sizes and nothing writes a batch's columns."""
    column = np.full(n, primary)
    column.flags.writeable = False
    return column


def _raise_out_of_range(name: str, array: np.ndarray, limit: int, memory: str) -> None:
    """Raises the error of the first index of `array` outside 0..limit-1, naming it."""
    if limit == 0:
        raise ValueError(f"{name} indexes the secondary pool, but the pools have 0 "
                         "secondary blocks")
    i = int(np.flatnonzero((array < 0) | (array >= limit))[0])
    raise IndexError(f"{name}[{i}] is {int(array[i])}, outside the {memory} pool's "
                     f"0..{limit - 1}")


def _whole(num_tokens: Any, tokens: np.ndarray, tokens_per_block: int) -> bool:
    """Whether every pair copies a whole block: its count (`tokens`, checked from
    `num_tokens`) is not in 1..tokens_per_block-1."""
    if num_tokens is None:
        return True
    if isinstance(num_tokens, (int, np.integer)):
        return not 0 < int(num_tokens) < tokens_per_block
    return not np.count_nonzero((tokens > 0) & (tokens < tokens_per_block))


def _host_array(name: str, values: Any, expected: str) -> np.ndarray:
    """`values` (a NumPy array, a sequence or a concrete jax.Array, which engines keep their
    slot tables in: read on the host once) as a NumPy array."""
    if type(values) is np.ndarray:  # what engines pass, first: the checks below cost microseconds
        return values
    if isinstance(values, jax.core.Tracer):
        raise TypeError(f"{name} must be {expected} known on the host, got a traced value; "
                        "the manager's verbs are called outside jax.jit")
    if isinstance(values, jax.Array):
        if values.is_deleted():
            raise ValueError(f"{name}: the jax.Array has been deleted (donated?)")
        return np.asarray(values)
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be {expected}, got {type(values).__name__}")
    return np.asarray(values)


def _explain_bad_pair(pairs: list, num_primary: int, num_secondary: int) -> None:
    """Raises the error of the first bad pair, naming it; returns if every pair is fine."""
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"pairs[{i}] must be a (src_block, dst_block) tuple, got {pair!r}")
        for role, block in zip(("src", "dst"), pair):
            if not isinstance(block, KVCacheBlock):
                raise TypeError(f"pairs[{i}] {role} must be a KVCacheBlock, got {block!r}")
            limit = num_primary if block.is_primary else num_secondary
            if not 0 <= block.memory_pool_block_index < limit:
                if limit == 0:
                    raise ValueError(f"pairs[{i}] {role} is a secondary block, but the pools "
                                     "have 0 secondary blocks")
                memory = "primary" if block.is_primary else "secondary"
                raise IndexError(
                    f"pairs[{i}] {role} has memory_pool_block_index "
                    f"{block.memory_pool_block_index}, outside the {memory} pool's "
                    f"0..{limit - 1}")


def _check_tokens(num_tokens: Any, count: int) -> np.ndarray:
    """Token counts for `count` pairs from None, an int or a sequence of ints."""
    if num_tokens is None:
        return np.zeros(count, np.int32)
    if isinstance(num_tokens, jax.Array):
        num_tokens = _host_array("num_tokens", num_tokens, "None, an int or a sequence of ints")
    if isinstance(num_tokens, np.ndarray) and num_tokens.ndim == 0:
        num_tokens = num_tokens[()]  # a scalar array: one count for every pair
    if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, (bool, np.bool_)):
        return np.full(count, min(max(int(num_tokens), -1), _INT32_MAX), np.int32)
    if not isinstance(num_tokens, (Sequence, np.ndarray)) or isinstance(num_tokens, str):
        raise TypeError(f"num_tokens must be None, an int or a sequence of ints, "
                        f"got {num_tokens!r}")
    if len(num_tokens) != count:
        raise ValueError(f"num_tokens has {len(num_tokens)} entries for {count} pairs")
    values = np.asarray(num_tokens) if count else np.zeros(0, np.int64)
    if values.dtype == bool or not np.issubdtype(values.dtype, np.integer) or values.ndim != 1:
        for i, n in enumerate(num_tokens):  # name the first entry that is not an integer
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
                raise TypeError(f"num_tokens[{i}] must be an integer, got {n!r}")
        values = np.asarray([int(n) for n in num_tokens], np.int64)
    return values.clip(-1, _INT32_MAX).astype(np.int32)


def split_runs(batch: PairBatch) -> list[np.ndarray]:
    """Splits a batch into runs that one copy per pool can do, keeping call order.

    A run has one direction (source and destination memory), and no pair in it reads a slot
    that an earlier pair of the run writes (that read must see the new data).
    """
    n, direction = len(batch), batch.direction
    if n == 0 or (direction is not None and (direction[0] != direction[1]
                                             or not np.isin(batch.src, batch.dst).any())):
        return [np.arange(n)]
    runs: list[list[int]] = []
    run_direction, written = None, set()
    for i in range(n):
        d = (bool(batch.src_primary[i]), bool(batch.dst_primary[i]))
        if d != run_direction or (int(batch.src[i]), d[0]) in written:
            runs.append([])
            run_direction, written = d, set()
        runs[-1].append(i)
        written.add((int(batch.dst[i]), d[1]))
    return [np.asarray(r) for r in runs]
