"""The transfer manager: onboard/offload/copy blocks between primary and secondary pools.

TensorRT-LLM orders its transfers with two side streams and CUDA events. Here every transfer
consumes the pool arrays it touches and produces new ones (the destination is donated and
updated in place), so JAX's own buffer dependencies order the copies exactly as the calls were
made; `pending_transfers` makes that bookkeeping visible and `sync_transfers` waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .ops import _block_copy_call, _check_byte_rows, index_facts
from .pool import KVCacheBlock, KVCacheBlockPool

Slot = tuple[int, bool]  # (memory_pool_block_index, is_primary)


@dataclasses.dataclass
class TransferStats:
    """Blocks and bytes moved since the last `get_and_reset_transfer_stats` (bytes: all pools).

    TensorRT-LLM: the transfer manager's onboard/offload/intra-device statistics.
    """

    onboarded_blocks: int = 0  # pinned host -> device
    onboarded_bytes: int = 0
    offloaded_blocks: int = 0  # device -> pinned host
    offloaded_bytes: int = 0
    copied_blocks: int = 0  # within one memory (e.g. a partial-reuse copy on the device)
    copied_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class PendingTransfer:
    """What the transfers issued since the last sync do to one memory slot."""

    reads: int  # copies that read the slot
    writes: int  # copies that write it
    ops: tuple[str, ...]  # 'offload' / 'onboard' of each of those copies, in call order


# One jitted dispatch per batch covers every pool: one custom call per pool, the destinations
# donated so that each copy happens in place. `plan` is [3, B]: source indices, destination
# indices and token counts in one array, so a dispatch moves one small array to the device.
def _copy_across_impl(dsts, srcs, plan, facts):
    return tuple(_block_copy_call(d, s, plan[0], plan[1], plan[2], facts)
                 for d, s in zip(dsts, srcs))


def _copy_within_impl(pools, plan, facts):
    return tuple(_block_copy_call(p, p, plan[0], plan[1], plan[2], facts) for p in pools)


_copy_across = jax.jit(_copy_across_impl, donate_argnums=0, static_argnames="facts")
_copy_within = jax.jit(_copy_within_impl, donate_argnums=0, static_argnames="facts")
# The same without donation, for a destination that cannot be donated: on GPUs, reading a
# pinned_host array with NumPy (np.asarray) leaves JAX holding a zero-copy view of it, and a
# viewed buffer cannot be donated. XLA then copies the pool: correct, but not in place.
_copy_across_undonated = jax.jit(_copy_across_impl, static_argnames="facts")
_copy_within_undonated = jax.jit(_copy_within_impl, static_argnames="facts")


class DonationWarning(UserWarning):
    """A pool array could not be donated, so a transfer copied the whole pool."""


def _bucket(n: int) -> int:
    """Batch sizes are padded to powers of two so a new batch size rarely recompiles."""
    return 1 << max(0, n - 1).bit_length()


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


class KVCacheTransferManager:
    """Moves blocks between the primary (GPU) and secondary (pinned host) memory of its pools.

    TensorRT-LLM: `KVCacheTransferManager` (`onboard`, `offload`, `syncTransfers`). A logical
    block spans every pool, so each transfer copies the block in all of them.

    Every method returns without waiting for the copies; all that a program can observe is as
    if the transfers ran one after another in call order. Methods are thread-safe (one lock).
    """

    def __init__(self, pools: Sequence[KVCacheBlockPool]) -> None:
        """Args: pools: one or more pools with equal block counts and tokens per block."""
        if isinstance(pools, KVCacheBlockPool):
            pools = [pools]
        self._pools = tuple(pools)
        if not self._pools:
            raise ValueError("pools must hold at least one KVCacheBlockPool")
        for i, p in enumerate(self._pools):
            if not isinstance(p, KVCacheBlockPool):
                raise TypeError(f"pools[{i}] must be a KVCacheBlockPool, got {type(p).__name__}")
        if len({id(p) for p in self._pools}) != len(self._pools):
            raise ValueError("pools holds the same KVCacheBlockPool twice; pass each pool once")
        first = self._pools[0]
        for i, p in enumerate(self._pools[1:], start=1):
            for field in ("num_primary_blocks", "num_secondary_blocks", "tokens_per_block",
                          "device"):
                if getattr(p, field) != getattr(first, field):
                    raise ValueError(
                        f"pools[{i}].{field} is {getattr(p, field)}, but pools[0].{field} is "
                        f"{getattr(first, field)}: the pools of one manager must agree on it"
                    )
        self._lock = threading.RLock()
        self._pending: dict[Slot, list] = {}  # slot -> [reads, writes, [op, ...]]
        self._stats = TransferStats()
        # Bytes one pair moves in all pools: a whole block, or per token of a partial copy.
        self._block_nbytes = sum(p.block_nbytes for p in self._pools)
        self._token_nbytes = sum(p.token_run_nbytes(1) for p in self._pools)

    @property
    def pools(self) -> tuple[KVCacheBlockPool, ...]:
        return self._pools

    # -- the verbs ---------------------------------------------------------------------------

    def offload(self, block: KVCacheBlock, offload_block: KVCacheBlock,
                num_tokens: int = 0) -> None:
        """Copies `block` into `offload_block` (normally primary -> secondary).

        TensorRT-LLM: `KVCacheTransferManager::offload`.

        Args:
          block, offload_block: source and destination; direction follows their `is_primary`.
          num_tokens: copy the first n tokens; n <= 0 or n >= tokens_per_block: whole block.

        Raises:
          TypeError, ValueError, IndexError: bad blocks or num_tokens; nothing is copied.
        """
        self._transfer("offload", [(block, offload_block)], [_as_int("num_tokens", num_tokens)])

    def onboard(self, offload_block: KVCacheBlock, block: KVCacheBlock,
                num_tokens: int = 0) -> None:
        """Copies `offload_block` into `block` (secondary -> primary, or primary -> primary).

        TensorRT-LLM: `KVCacheTransferManager::onboard` (an onboard from a primary block is
        the intra-device copy of partial reuse). Arguments and errors as for `offload`.
        """
        self._transfer("onboard", [(offload_block, block)], [_as_int("num_tokens", num_tokens)])

    def offload_blocks(self, pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                       num_tokens: None | int | Sequence[int] = None) -> None:
        """Batched `offload` of `(src_block, dst_block)` pairs: one copy per pool per batch.

        Args:
          pairs: `(src_block, dst_block)` tuples, applied as if one after another.
          num_tokens: None (whole blocks), one int for all pairs, or one int per pair.
        """
        self._transfer("offload", pairs, num_tokens)

    def onboard_blocks(self, pairs: Sequence[tuple[KVCacheBlock, KVCacheBlock]],
                       num_tokens: None | int | Sequence[int] = None) -> None:
        """Batched `onboard`; arguments as for `offload_blocks`."""
        self._transfer("onboard", pairs, num_tokens)

    def sync_transfers(self) -> None:
        """Waits until every transfer issued so far is done and the pools' arrays are ready.

        TensorRT-LLM: `syncTransfers`. Clears `pending_transfers`.
        """
        with self._lock:
            arrays = [a for p in self._pools for a in (p.primary, p.secondary) if a is not None]
            jax.block_until_ready([a for a in arrays if not a.is_deleted()])
            self._pending.clear()

    @property
    def pending_transfers(self) -> Mapping[Slot, PendingTransfer]:
        """Slots touched since the last sync, keyed by `(memory_pool_block_index, is_primary)`.

        Keyed by memory slot, not logical block id: TensorRT-LLM's id keying let two blocks
        offloaded into one secondary slot race. A read-only snapshot.
        """
        with self._lock:
            return types.MappingProxyType({
                slot: PendingTransfer(reads, writes, tuple(ops))
                for slot, (reads, writes, ops) in self._pending.items()})

    def get_and_reset_transfer_stats(self) -> TransferStats:
        """Returns the blocks and bytes moved since the last call and starts counting anew."""
        with self._lock:
            stats, self._stats = self._stats, TransferStats()
            return stats

    # -- implementation ----------------------------------------------------------------------

    def _transfer(self, op: str, pairs: Sequence[Any], num_tokens: Any) -> None:
        with self._lock:
            pairs = self._checked_pairs(pairs)
            tokens = self._checked_tokens(num_tokens, len(pairs))
            memories = {b.is_primary for pair in pairs for b in pair}
            for pool in self._pools:  # every array must be live before anything is dispatched
                for is_primary in memories:
                    pool.current(is_primary, op)
            for segment in self._segments(pairs):
                self._dispatch([pairs[i] for i in segment], [tokens[i] for i in segment])
            self._record(op, pairs, tokens)

    def _checked_pairs(self, pairs: Any) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        try:
            pairs = [tuple(p) for p in pairs]
        except TypeError as e:
            raise TypeError("pairs must be a sequence of (src_block, dst_block) tuples") from e
        limits = {True: self._pools[0].num_primary_blocks,
                  False: self._pools[0].num_secondary_blocks}
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise ValueError(f"pairs[{i}] must be a (src_block, dst_block) tuple, got {pair!r}")
            for role, block in zip(("src", "dst"), pair):
                if not isinstance(block, KVCacheBlock):
                    raise TypeError(f"pairs[{i}] {role} must be a KVCacheBlock, got {block!r}")
                limit = limits[block.is_primary]
                if not 0 <= block.memory_pool_block_index < limit:
                    memory = "primary" if block.is_primary else "secondary"
                    if limit == 0:
                        raise ValueError(f"pairs[{i}] {role} is a secondary block, but the pools "
                                         "have 0 secondary blocks")
                    raise IndexError(
                        f"pairs[{i}] {role} has memory_pool_block_index "
                        f"{block.memory_pool_block_index}, outside the {memory} pool's "
                        f"0..{limit - 1}")
        return pairs

    def _checked_tokens(self, num_tokens: Any, count: int) -> list[int]:
        if num_tokens is None:
            tokens = [0] * count
        elif isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            tokens = [int(num_tokens)] * count
        elif isinstance(num_tokens, (Sequence, np.ndarray)) and not isinstance(num_tokens, str):
            if len(num_tokens) != count:
                raise ValueError(f"num_tokens has {len(num_tokens)} entries for {count} pairs")
            tokens = [_as_int(f"num_tokens[{i}]", n) for i, n in enumerate(num_tokens)]
        else:
            raise TypeError(f"num_tokens must be None, an int or a sequence of ints, "
                            f"got {num_tokens!r}")
        limit = np.iinfo(np.int32).max
        tokens = [min(max(n, -1), limit) for n in tokens]
        t = self._pools[0].tokens_per_block
        if any(0 < n < t for n in tokens):
            for pool in self._pools:
                _check_byte_rows(pool.block_shape, pool.dtype, partial_possible=True)
        return tokens

    @staticmethod
    def _segments(pairs: list[tuple[KVCacheBlock, KVCacheBlock]]) -> list[list[int]]:
        """Splits pairs into runs that one copy per pool can do, keeping call order.

        A run has one direction (source and destination memory), and no pair in it reads a
        slot that an earlier pair of the run writes (that read must see the new data).
        """
        runs: list[list[int]] = []
        direction, written = None, set()
        for i, (src, dst) in enumerate(pairs):
            d = (src.is_primary, dst.is_primary)
            if d != direction or src.slot in written:
                runs.append([])
                direction, written = d, set()
            runs[-1].append(i)
            written.add(dst.slot)
        return runs

    def _dispatch(self, pairs: list[tuple[KVCacheBlock, KVCacheBlock]], tokens: list[int]) -> None:
        n = len(pairs)
        plan = np.full((3, _bucket(n)), -1, np.int32)  # -1: a padding pair, skipped
        plan[0, :n] = [s.memory_pool_block_index for s, _ in pairs]
        plan[1, :n] = [d.memory_pool_block_index for _, d in pairs]
        plan[2, :n] = tokens
        src_primary, dst_primary = pairs[0][0].is_primary, pairs[0][1].is_primary
        dsts = tuple(p.current(dst_primary, "transfer") for p in self._pools)
        if src_primary == dst_primary:
            facts = index_facts(plan[0, :n], plan[1, :n], dsts[0].shape[0], dsts[0].shape[0])
            args = (dsts, plan)
            donated, undonated = _copy_within, _copy_within_undonated
        else:
            srcs = tuple(p.current(src_primary, "transfer") for p in self._pools)
            # Source and destination are different arrays: only duplicate writes matter.
            facts = index_facts(plan[0, :n], plan[1, :n], srcs[0].shape[0], dsts[0].shape[0])
            facts = facts._replace(hazard_free=True)
            args = (dsts, srcs, plan)
            donated, undonated = _copy_across, _copy_across_undonated
        kwargs = {"facts": facts}
        try:
            results = donated(*args, **kwargs)
        except (jax.errors.JaxRuntimeError, ValueError) as e:  # as raised by jax 0.10 / 0.11
            if "external reference" not in str(e):
                raise
            warnings.warn(
                f"pool.{'primary' if dst_primary else 'secondary'} could not be updated in place "
                "because a NumPy view of it exists (np.asarray on a host-memory array keeps "
                "one); this transfer copied the whole pool instead. Read pools with "
                "jax_kvxfer.to_numpy.", DonationWarning, stacklevel=4)
            results = undonated(*args, **kwargs)
        for pool, result in zip(self._pools, results):
            if dst_primary:
                pool._primary = result  # noqa: SLF001 - same shape, dtype and memory kind
            else:
                pool._secondary = result  # noqa: SLF001

    def _record(self, op: str, pairs: list[tuple[KVCacheBlock, KVCacheBlock]],
                tokens: list[int]) -> None:
        t, s = self._pools[0].tokens_per_block, self._stats
        for (src, dst), n in zip(pairs, tokens):
            for slot, index in ((src.slot, 0), (dst.slot, 1)):  # index 0: a read, 1: a write
                record = self._pending.get(slot)
                if record is None:
                    record = self._pending[slot] = [0, 0, []]
                record[index] += 1
                record[2].append(op)
            nbytes = self._block_nbytes if n <= 0 or n >= t else n * self._token_nbytes
            if src.is_primary and not dst.is_primary:
                s.offloaded_blocks += 1
                s.offloaded_bytes += nbytes
            elif dst.is_primary and not src.is_primary:
                s.onboarded_blocks += 1
                s.onboarded_bytes += nbytes
            else:
                s.copied_blocks += 1
                s.copied_bytes += nbytes
