"""Tiers below the host pool: the contract they implement (base.py) and the stores."""

from .base import CorruptBlock, Store, StoreStats, layout_fingerprint
from .file import FileStore, aligned_rows

__all__ = ["CorruptBlock", "FileStore", "Store", "StoreStats", "aligned_rows",
           "layout_fingerprint"]
