"""The block manager's index: chained block hashes and cached blocks (on the GPU or on the
host), and the step's transfers it hands to the connector's worker."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Hashable, Sequence

import numpy as np

from ..connector.lru import DEFAULT_PRIORITY, MAX_PRIORITY
from ..transfer.pool import KVCacheBlock, KVCacheBlockPool

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
    # blocks a store holds that prompts recomputed, their read expected to take longer
    store_skipped_blocks: int = 0
    # store_on_release's blocks not written: no store's reads would beat recomputing them
    store_declined_blocks: int = 0
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
    # blocks a store holds, past the match: recomputed, their read expected to take longer
    store_skipped_blocks: int = 0


def block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a block: its parent's key and its own token ids.

    Equal keys mean equal prefixes (up to a 128-bit collision), so one lookup per block finds
    a shared prefix. Partially filled blocks hash their tokens too; their length is in the hash.
    """
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:  # one per block length: the bytes of `np.asarray(tokens, "<i8")`
        packer = _PACKERS[n] = struct.Struct(f"<{n}q")
    try:  # struct, not NumPy: a block's few tokens cost less than an array (per block)
        data = packer.pack(*tokens)
    except struct.error:
        data = np.asarray(tokens, dtype="<i8").tobytes()  # NumPy's own error for bad ids
    return hashlib.blake2b(parent_key + data, digest_size=16).digest()


_PACKERS: dict[int, struct.Struct] = {}


class KeyChains:
    """The chained keys of recent prompts' full blocks, computed once, as far as asked: the
    Server matches a waiting prompt each step and again when it admits it (~400 blocks each at
    the h200 preset). Keys depend on the tokens alone, so a memo is exact."""

    def __init__(self, tokens_per_block: int, capacity: int = 64) -> None:
        self.tokens_per_block, self.capacity = tokens_per_block, capacity
        self._chains: dict[tuple[int, ...], list[bytes]] = {}
        # the last call's tokens (held, so that its id stays theirs) and chain: a match asks
        # for one prompt's keys block by block, and hashing a 6k-token tuple to find its
        # chain again costs ~30 us, ten times a block's key
        self._last: tuple[tuple[int, ...], list[bytes]] = ((), [])

    def keys(self, tokens: tuple[int, ...], blocks: int) -> list[bytes]:
        """The keys of `tokens`' full blocks from the root, computed at least as far as its
        first `blocks` full blocks; the list is kept, and later calls for the same tokens grow
        it in place."""
        last_tokens, chain = self._last
        if tokens is not last_tokens:
            chain = self._chains.get(tokens)
            if chain is None:
                if len(self._chains) >= self.capacity:  # the oldest prompt goes
                    del self._chains[next(iter(self._chains))]
                chain = self._chains[tokens] = []
            self._last = (tokens, chain)
        t = self.tokens_per_block
        key = chain[-1] if chain else ROOT_KEY
        for i in range(len(chain), min(blocks, len(tokens) // t)):
            key = block_key(key, tokens[i * t:(i + 1) * t])
            chain.append(key)
        return chain


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
        return self.block_of(block_key(parent_key, tokens), tokens)

    def block_of(self, key: bytes, tokens: tuple[int, ...]) -> CachedBlock | None:
        """The stored block of `key` (`block_key` of its parent and `tokens`), if it holds
        exactly `tokens`."""
        block = self.by_key.get(key)
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
    return tuple(arr.tolist())  # Python ints, in one C call (a generator: ~1 ms a prompt)


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


class StepTransfers:
    """The transfers of one step, queued while blocks are allocated and handed over together at
    the step boundary (or earlier, where an ordering rule needs it): to the connector's worker
    one store job (GPU pages into host rows, then written through to the stores) and one load
    job (host rows into GPU pages: whole blocks, or the first tokens of a partially matched
    one); then the GPU pool's own copies of partially matched blocks.

    Stores go first, then loads, then copies, whatever order they were queued in. That is exact
    because a queued load's or copy's source is pinned until issued (its row or page is not
    reused before), and the block manager issues early where a later transfer would meet an
    earlier one: an offload reading a GPU page that a queued load or copy writes, a load or
    copy writing a page one writes already, a host block evicted while its store is queued. A
    copy may read a page that a load writes (a block onboarded, then partially matched), never
    the reverse.
    """

    def __init__(self) -> None:
        self.store_keys: list[bytes] = []
        self.store_pages: list[int] = []
        self.store_rows: list[int] = []
        self.staged: list[bytes] = []  # store_on_release's copies: off the host once issued
        self.load_keys: list[bytes] = []
        self.load_rows: list[int] = []
        self.load_pages: list[int] = []
        self.load_tokens: list[int] = []  # per load, its first tokens (0: the whole block)
        self.moved: list[bytes] = []  # blocks loaded whole: they leave the host once issued
        self.host_pins: list[CachedBlock] = []  # host blocks partial loads read
        self.copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self.copy_tokens: list[int] = []
        self.gpu_pins: list[CachedBlock] = []  # the copies' sources
        self._written: set[int] = set()  # GPU pages the queued loads and copies write
        self._stored: set[bytes] = set()  # keys of the queued stores
        self.lowest_store_priority = MAX_PRIORITY  # of the queued offloads (not store_on_release's)

    def __bool__(self) -> bool:
        return bool(self.store_keys or self.load_keys or self.copies)

    def store(self, key: bytes, page: int, row: int, priority: int, *,
              staged: bool = False) -> None:
        """GPU page -> host row, written through to the stores once issued: an offload of a
        block of `priority`, or store_on_release's copy (`staged`)."""
        self.store_keys.append(key)
        self.store_pages.append(page)
        self.store_rows.append(row)
        if staged:
            self.staged.append(key)
        else:
            self._stored.add(key)
            self.lowest_store_priority = min(self.lowest_store_priority, priority)

    def take_stores(self) -> tuple[list[bytes], list[int], list[int], list[bytes]]:
        """The queued stores' keys, pages, rows and store_on_release's keys, taken out of the
        queue (to be issued ahead of the rest)."""
        out = self.store_keys, self.store_pages, self.store_rows, self.staged
        self.store_keys, self.store_pages, self.store_rows, self.staged = [], [], [], []
        self._stored = set()
        self.lowest_store_priority = MAX_PRIORITY
        return out

    def load(self, src: CachedBlock, page: int, num_tokens: int = 0) -> None:
        """Host block `src` (its row) -> GPU page: whole (it moves to the GPU) or its first
        `num_tokens` (a partial match: it stays on the host, pinned until issued)."""
        self.load_keys.append(src.key)
        self.load_rows.append(src.slot)
        self.load_pages.append(page)
        self.load_tokens.append(num_tokens)
        self._written.add(page)
        if num_tokens:
            self.host_pins.append(src)
        else:
            self.moved.append(src.key)

    def copy(self, src: CachedBlock, page: int, num_tokens: int) -> None:
        """The first `num_tokens` of GPU block `src` (pinned until issued) -> GPU page."""
        self.copies.append((KVCacheBlock(src.block_id, src.slot, True),
                            KVCacheBlock(src.block_id, page, True)))
        self.copy_tokens.append(num_tokens)
        self._written.add(page)
        self.gpu_pins.append(src)

    def writes_page(self, page: int) -> bool:
        return page in self._written

    def stores(self, key: bytes) -> bool:
        """Whether the block of `key` is queued to be offloaded (its row is still to be
        written, and written through)."""
        return key in self._stored

    def offloads_queued(self) -> bool:
        return bool(self._stored)

    def frees_host_rows(self) -> bool:
        """Whether issuing frees host rows (those of the blocks loaded whole)."""
        return bool(self.moved)
