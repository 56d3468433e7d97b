"""The block manager's index: chained block hashes, cached blocks and their eviction queues."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable, Sequence

import numpy as np

from ..connector.lru import DEFAULT_PRIORITY
from ..pool import KVCacheBlock, KVCacheBlockPool

ROOT_KEY = bytes(16)
"""The parent key of a sequence's first block."""


class PoolExhaustedError(RuntimeError):
    """Every primary block is in use by a running sequence: nothing can be evicted."""


@dataclasses.dataclass
class BlockManagerStats:
    """What the block manager did since the last `get_and_reset_stats` (counts of blocks)."""

    prompt_tokens: int = 0  # tokens given to add_sequence
    reused_tokens: int = 0  # of those, found in the cache (their K/V need not be computed)
    reused_blocks: int = 0  # full blocks reused in place in the primary pool
    onboarded_blocks: int = 0  # full blocks brought back from the secondary pool
    partial_copies: int = 0  # partially matched blocks copied from a primary block
    partial_onboards: int = 0  # ... copied from a secondary block
    offloaded_blocks: int = 0  # evicted primary blocks kept in the secondary pool
    dropped_primary_blocks: int = 0  # evicted primary blocks lost (low priority / no room)
    dropped_secondary_blocks: int = 0  # secondary blocks evicted to make room for an offload
    store_hit_blocks: int = 0  # full blocks read from a store (then onboarded)
    transfer_seconds: float = 0.0  # wall time issuing transfers and in sync_transfers

    @property
    def prefix_hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens (0 when no prompt was seen)."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """What `add_sequence` would reuse for a prompt (see `BlockManager.match_prefix`)."""

    num_tokens: int  # prompt tokens whose K/V are cached (at most len(prompt) - 1)
    primary_blocks: int  # full blocks reused in place
    secondary_blocks: int  # full blocks to onboard
    partial_tokens: int  # tokens copied out of a partially matched block (0: none)
    partial_source_is_primary: bool | None  # where that block lives (None: no partial match)
    store_blocks: int = 0  # full blocks only a store holds (read into host rows, onboarded)
    partial_from_store: bool = False  # the partially matched block only a store holds


def block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a block: its parent's key and its own token ids.

    Equal keys mean equal prefixes (up to a 128-bit collision), so one lookup per block finds
    a shared prefix. Partially filled blocks hash their tokens too; their length is in the hash.
    """
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(parent_key + data, digest_size=16).digest()


@dataclasses.dataclass(eq=False)
class CachedBlock:
    """A logical block: where it lives, and (once stored for reuse) what it holds.

    TensorRT-LLM: `KVCacheBlock` with its hash, tokens, priority and reference count.
    """

    block_id: int
    slot: int  # memory_pool_block_index in the primary or secondary pool
    is_primary: bool
    key: bytes | None = None  # None until stored for reuse
    parent_key: bytes | None = None
    tokens: tuple[int, ...] = ()
    priority: int = DEFAULT_PRIORITY
    ref_count: int = 0  # sequences using it, plus pins held until transfers are issued


class BlockIndex:
    """Stored blocks by key, and by parent key for partial matching (a radix tree, hashed)."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, CachedBlock] = {}
        self.children: dict[bytes, dict[bytes, CachedBlock]] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, block: CachedBlock) -> None:
        self.by_key[block.key] = block
        self.children.setdefault(block.parent_key, {})[block.key] = block

    def remove(self, block: CachedBlock) -> None:
        del self.by_key[block.key]
        siblings = self.children[block.parent_key]
        del siblings[block.key]
        if not siblings:
            del self.children[block.parent_key]
        block.key, block.parent_key, block.tokens = None, None, ()

    def full_block(self, parent_key: bytes, tokens: tuple[int, ...]) -> CachedBlock | None:
        """The stored full block holding exactly `tokens` after the prefix `parent_key`."""
        block = self.by_key.get(block_key(parent_key, tokens))
        if block is None or block.tokens != tokens:  # tokens compared: no trust in the hash
            return None
        return block

    def longest_partial(self, parent_key: bytes,
                        tokens: tuple[int, ...]) -> tuple[CachedBlock | None, int]:
        """The stored child of `parent_key` sharing the longest prefix with `tokens`."""
        best, best_len = None, 0
        for block in self.children.get(parent_key, {}).values():
            n = 0
            for a, b in zip(block.tokens, tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        return best, best_len


def check_token_ids(name: str, token_ids: Hashable | Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple of non-negative Python ints, or a clear TypeError/ValueError."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {token_ids!r}")
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a sequence of integer token ids, got {token_ids!r}") from e
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must hold non-negative token ids, got {int(arr.min())}")
    return tuple(int(t) for t in arr)


def checked_pools(pools: KVCacheBlockPool | Sequence[KVCacheBlockPool]) -> list[KVCacheBlockPool]:
    """The pools of one block manager as a list; they must agree on block counts and size."""
    pools = [pools] if isinstance(pools, KVCacheBlockPool) else list(pools)
    if not pools:
        raise ValueError("pools must hold at least one KVCacheBlockPool")
    for i, p in enumerate(pools):
        if not isinstance(p, KVCacheBlockPool):
            raise TypeError(f"pools[{i}] must be a KVCacheBlockPool, got {type(p).__name__}")
    for i, p in enumerate(pools[1:], start=1):
        for field in ("num_primary_blocks", "num_secondary_blocks", "tokens_per_block"):
            if getattr(p, field) != getattr(pools[0], field):
                raise ValueError(f"pools[{i}].{field} is {getattr(p, field)}, but "
                                 f"pools[0].{field} is {getattr(pools[0], field)}")
    return pools


class TransferQueue:
    """Transfers queued during allocation, issued as one batch of offloads, then of onboards
    (one `offload_and_onboard` call: both directions at once where that gives the same result).

    The reordering is valid because queued sources are pinned until issued, secondary slots
    read by queued onboards are freed only once issued, and the block manager issues early
    when an offload would read a primary slot that a queued onboard writes.
    """

    def __init__(self) -> None:
        self._offloads: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._onboards: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._onboard_tokens: list[int] = []
        self._written: set[int] = set()  # primary slots the queued onboards write
        self._pins: list[CachedBlock] = []
        self._slots_to_free: list[int] = []
        self._host_rows: list[int] = []  # secondary slots the queued transfers read or write

    def offload(self, block: CachedBlock, dst_slot: int) -> None:
        """Queues primary slot `block.slot` -> secondary `dst_slot` (call before moving it)."""
        self._offloads.append((KVCacheBlock(block.block_id, block.slot, True),
                               KVCacheBlock(block.block_id, dst_slot, False)))
        self._host_rows.append(dst_slot)

    def onboard(self, src: CachedBlock, dst_slot: int, num_tokens: int, *,
                pin: CachedBlock | None = None, free_secondary_slot: int | None = None) -> None:
        """Queues `src` -> primary `dst_slot`; `pin` is unreferenced and the slot freed on issue."""
        self._onboards.append((KVCacheBlock(src.block_id, src.slot, src.is_primary),
                               KVCacheBlock(src.block_id, dst_slot, True)))
        self._onboard_tokens.append(num_tokens)
        self._written.add(dst_slot)
        if not src.is_primary:
            self._host_rows.append(src.slot)
        if pin is not None:
            self._pins.append(pin)
        if free_secondary_slot is not None:
            self._slots_to_free.append(free_secondary_slot)

    def writes_primary(self, slot: int) -> bool:
        return slot in self._written

    def frees_secondary(self) -> bool:
        """Whether issuing frees secondary slots (the sources of queued onboards)."""
        return bool(self._slots_to_free)

    def issue(self, transfer_manager) -> tuple[list[CachedBlock], list[int], list[int]]:
        """Issues everything queued; returns the pins to release, the secondary slots to free,
        and every secondary slot the issued transfers read or write."""
        if self._offloads or self._onboards:  # both directions at once where exact
            transfer_manager.offload_and_onboard(self._offloads, self._onboards, None,
                                                 self._onboard_tokens)
        pins, slots, rows = self._pins, self._slots_to_free, self._host_rows
        self.__init__()
        return pins, slots, rows
