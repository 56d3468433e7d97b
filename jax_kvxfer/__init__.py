"""jax_kvxfer: KV-cache block transfers between GPU and pinned host memory for JAX.

- `copy_blocks`, `partial_block_copy`: batched and partial block copies, XLA FFI custom calls
  usable inside `jax.jit` (CPU and CUDA).
- `KVCacheBlockPool`, `KVCacheBlock`, `KVCacheTransferManager`: TensorRT-LLM's offload/onboard
  machinery with pools held as `jax.Array`s (primary in `device`, secondary in `pinned_host`);
  on a GPU the manager's copies run on transfer lanes beside compute; `wait_for_layers` lets a
  step's layers wait only for their own onboarded blocks.
- `BlockManager`: a prefix cache over a pool, with stores behind it.
"""

from .cache import BlockManager, BlockManagerStats, PoolExhaustedError, PrefixMatch
from .ops import HAS_CUDA_HANDLERS, copy_blocks, partial_block_copy
from .transfer.manager import (
    DonationWarning,
    KVCacheTransferManager,
    PendingTransfer,
    TransferStats,
    layer_group_bounds,
    wait_for_layers,
)
from .transfer.pool import KVCacheBlock, KVCacheBlockPool, to_numpy

__all__ = [
    "HAS_CUDA_HANDLERS",
    "BlockManager",
    "BlockManagerStats",
    "DonationWarning",
    "KVCacheBlock",
    "KVCacheBlockPool",
    "KVCacheTransferManager",
    "PendingTransfer",
    "PoolExhaustedError",
    "PrefixMatch",
    "TransferStats",
    "copy_blocks",
    "layer_group_bounds",
    "partial_block_copy",
    "to_numpy",
    "wait_for_layers",
]
__version__ = "0.1.0"
