"""Tiers below the host pool: the contract they implement (base.py) and the stores: FileStore
(disk, file.py) and RedisStore (a Redis or Valkey server, redis.py; needs the `redis` client)."""

from .base import CorruptBlock, Store, StoreStats, layout_fingerprint
from .file import FileStore, aligned_rows
from .redis import RedisStore

__all__ = ["CorruptBlock", "FileStore", "RedisStore", "Store", "StoreStats", "aligned_rows",
           "layout_fingerprint"]
