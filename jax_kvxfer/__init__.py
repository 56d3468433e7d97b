"""jax_kvxfer: KV-cache block transfers between GPU and pinned host memory for JAX.

The ops (`copy_blocks`, `partial_block_copy`) are XLA FFI custom calls usable inside `jax.jit`.
"""

from ._native import HAS_CUDA_HANDLERS
from .ops import copy_blocks, partial_block_copy

__all__ = ["HAS_CUDA_HANDLERS", "copy_blocks", "partial_block_copy"]
__version__ = "0.1.0"
