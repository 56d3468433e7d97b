"""jax_kvxfer: KV-cache block transfers between GPU and pinned host memory for JAX.

- `copy_blocks`, `partial_block_copy`: batched and partial block copies, XLA FFI custom calls
  usable inside `jax.jit` (CPU and CUDA); `on_stream` runs other work on a GPU stream of its
  own beside a copy made with `copy_blocks(..., stream=N)`; `copy_blocks_both_ways` offloads
  and onboards between the same two pools at once.
- `KVCacheBlockPool`, `KVCacheBlock`, `KVCacheTransferManager`: TensorRT-LLM's offload/onboard
  machinery with pools held as `jax.Array`s (primary in `device`, secondary in `pinned_host`).
"""

from ._both_ways import copy_blocks_both_ways
from ._lowering import on_stream
from ._native import HAS_CUDA_HANDLERS
from ._plan import DMA_AUTO_MIN_BLOCK_BYTES, HOST_COPY_CTAS
from .cache import BlockManager, BlockManagerStats, PoolExhaustedError, PrefixMatch
from .manager import DonationWarning, KVCacheTransferManager, PendingTransfer, TransferStats
from .ops import copy_blocks, partial_block_copy
from .pool import KVCacheBlock, KVCacheBlockPool, to_numpy

__all__ = [
    "DMA_AUTO_MIN_BLOCK_BYTES",
    "HAS_CUDA_HANDLERS",
    "HOST_COPY_CTAS",
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
    "copy_blocks_both_ways",
    "on_stream",
    "partial_block_copy",
    "to_numpy",
]
__version__ = "0.1.0"
