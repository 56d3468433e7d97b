"""What the scheduler side hands the worker side, and the events it keeps: vLLM v1's offloading
shapes (`vllm/v1/kv_offload/abstract.py`) for a host pool in rows and the stores below it.

Block hashes are the engine's own (ints, as eSurge's and vLLM's Python hashes, or bytes, as
vLLM's SHA-256 ones). Below the host they become 16-byte store keys (`store_key`), the same in
every process that sees the same hash, so replicas sharing a store find each other's blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable

import numpy as np

MEDIUM_CPU = "CPU"  # vLLM's offloading connector names its host tier so

BlockHash = int | bytes


def check_block_hash(name: str, block_hash: object) -> BlockHash:
    """An engine's block hash as given, or a TypeError naming it."""
    if isinstance(block_hash, bool) or not isinstance(block_hash, (int, bytes, np.integer)):
        raise TypeError(f"{name} must be an int or bytes block hash, got "
                        f"{type(block_hash).__name__} {block_hash!r}")
    return int(block_hash) if isinstance(block_hash, np.integer) else block_hash


def store_key(block_hash: BlockHash) -> bytes:
    """The 16-byte key under which the stores keep an engine's block: a hash of 16 bytes as it
    is (a digest already, such as the block manager's chained keys, under which its stores
    have always kept their blocks), else a digest of the hash tagged with its type, so that
    the int 1 and the bytes b"\\x01" stay apart."""
    if isinstance(block_hash, bytes) and len(block_hash) == 16:
        return block_hash
    if isinstance(block_hash, int):
        data = b"i" + block_hash.to_bytes(block_hash.bit_length() // 8 + 1, "big", signed=True)
    else:
        data = b"b" + block_hash
    return hashlib.blake2b(data, digest_size=16, person=b"kvxfer-engine").digest()


def event_key(block_hash: BlockHash) -> bytes:
    """The key a KV event publishes for a block (`events.block_hash64` reads its first 8
    bytes): an int hash's low 64 bits, or a bytes hash's first 8 bytes, so that a router sees
    the engine's own hashes."""
    if isinstance(block_hash, int):
        return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big") + bytes(8)
    return (block_hash + bytes(16))[:16]


def _slots(host_slots: object) -> np.ndarray:
    slots = np.array(host_slots, dtype=np.int32).reshape(-1)
    slots.flags.writeable = False
    return slots


@dataclasses.dataclass(frozen=True, eq=False)
class HostSpec:
    """Host-pool rows, one per block hash, in order (vLLM: `CPULoadStoreSpec`)."""

    block_hashes: tuple[BlockHash, ...]
    host_slots: np.ndarray  # int32, read-only

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_slots", _slots(self.host_slots))

    @staticmethod
    def medium() -> str:
        return MEDIUM_CPU

    def __len__(self) -> int:
        return len(self.block_hashes)


@dataclasses.dataclass(frozen=True, eq=False)
class StoreSpec(HostSpec):
    """Where the worker writes blocks the GPU holds: their host rows. With stores, the worker
    also writes the rows through to every store once they have landed."""


@dataclasses.dataclass(frozen=True, eq=False)
class StoreRead:
    """Blocks `[start, stop)` of a load, read first from store `store` into their host rows."""

    store: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, eq=False)
class LoadSpec(HostSpec):
    """Where the worker reads blocks from: their host rows, some of which a store fills first
    (`store_reads`). A load with store reads finishes once they have arrived and the rows are
    copied to the GPU; a block that does not arrive intact fails the load (nothing of it is
    copied: the engine computes those tokens)."""

    store_reads: tuple[StoreRead, ...] = ()

    @property
    def num_from_store(self) -> int:
        """Blocks of this load that a store holds, not the host pool."""
        return sum(r.stop - r.start for r in self.store_reads)


@dataclasses.dataclass(frozen=True)
class PrepareStoreOutput:
    """vLLM's `PrepareStoreOutput`: the blocks to store (those not held yet, in order), where
    to write them, and the blocks evicted from the host pool to make room."""

    block_hashes_to_store: list[BlockHash]
    store_spec: StoreSpec
    block_hashes_evicted: list[BlockHash]


@dataclasses.dataclass(frozen=True)
class OffloadingEvent:
    """vLLM's `OffloadingEvent`: blocks stored on, or removed from, one medium ("CPU" for the
    host pool, a store's tier name such as "DISK" or "REDIS")."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool


JobId = Hashable
