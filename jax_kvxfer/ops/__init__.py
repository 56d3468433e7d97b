"""The block-copy op: `copy_blocks` and `partial_block_copy` (`copy.py`), XLA FFI custom calls
usable inside `jax.jit`, and what they stand on: the argument checks (`_checks.py`), the
engines' own layouts (`_layouts.py`), `plan_copy`, which decides a frozen `CopyPlan`
(`_plan.py`), `CopyPlan` and the one emitter of the custom calls (`_lowering.py`), the compiled
modules with the table of FFI targets (`_native.py`, the one place that loads `_kvxfer_cpu` /
`_kvxfer_cuda` and registers their handlers with XLA), and what the library relies on in JAX
(`_jax_seams.py`). The CPU module also holds the stores' loops over many values
(`receive_replies`, `send_values`, `stage_values`), which run with the GIL released.
"""

from ._native import HAS_CUDA_HANDLERS, receive_replies, send_values, stage_values
from .copy import copy_blocks, partial_block_copy

__all__ = ["HAS_CUDA_HANDLERS", "copy_blocks", "partial_block_copy", "receive_replies",
           "send_values", "stage_values"]
