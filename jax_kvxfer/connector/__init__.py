"""The connector: jax_kvxfer's host pool and stores for an engine that owns its GPU pages and
prefix cache, in vLLM v1's offloading shape.

- `OffloadingManager` (scheduler side): which engine blocks (by the engine's block hashes) the
  host pool and the stores hold; `lookup`, `prepare_load`, `touch`, `complete_load`,
  `prepare_store`, `complete_store`, `take_events`. It moves no data.
- `OffloadingWorker` (worker side): moves them between the engine's own KV arrays, pinned host
  rows and the stores: `submit_store`, `submit_load`, `get_finished`, `wait`, `kv_caches`.
- The parts both sides share: the stores' row I/O (`tiers`), the admission policies
  (`admission`) and the priority LRU (`lru`, the block manager's GPU queue too).

`jax_kvxfer.cache.BlockManager`, the GPU allocator and prefix cache for engines without their
own, stands on one `OffloadingManager` and one `OffloadingWorker` for everything below the GPU,
through the same calls.
"""

from .admission import AlwaysAdmit, FrequencyGate, ReuseGate, admission_policy
from .scheduler import OffloadingManager, OffloadingStats
from .specs import (
    LoadSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    StoreRead,
    StoreSpec,
    store_key,
)
from .worker import OffloadingWorker

__all__ = ["AlwaysAdmit", "FrequencyGate", "LoadSpec", "OffloadingEvent", "OffloadingManager",
           "OffloadingStats", "OffloadingWorker", "PrepareStoreOutput", "ReuseGate", "StoreRead",
           "StoreSpec", "admission_policy", "store_key"]
