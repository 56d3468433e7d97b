"""What tests and the benchmark may observe of the library's insides, in one public place:
counters that say which path a copy took. Not part of the API users program against."""

from __future__ import annotations

import jax

from . import _native


def dma_batches() -> int | None:
    """Batches the CUDA handlers have copied with the copy engines so far, in this process
    (None where the default backend is not a GPU or the build has no CUDA handlers): a test
    reads it before and after a call to see whether the call really took that path."""
    if jax.default_backend() != "gpu" or not _native.HAS_CUDA_HANDLERS:
        return None
    return _native._kvxfer_cuda.dma_batches()
