"""Pools and the transfer manager: `KVCacheBlockPool` (`pool.py`, over a storage strategy:
`_storage.py`, `_layers.py` for an engine's per-layer arrays), `KVCacheBlock` and `to_numpy`
(`block.py`), and `KVCacheTransferManager`
(`manager.py`): the checked batch (`_batch.py`), the plan ring of pinned-host index arrays
(`_plan_ring.py`), the two engines, in line on XLA's stream or on the transfer lanes
(`_engines.py`, `_lanes.py`), the lanes' hazards (`_hazards.py`), and the memory limits a pool
is checked against (`limits.py`).
"""
