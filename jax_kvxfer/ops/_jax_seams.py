"""What this library relies on in JAX beyond its documented behaviour, each in one place.

Each seam has a canary test (tests/test_jax_seams.py) that fails loudly when a JAX version
changes it, and says what the plain path is where there is one.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import numpy as np


def host_byte_views(array: jax.Array) -> list[np.ndarray]:
    """Writable NumPy byte views (uint8, flat) of the host buffers of a `pinned_host` array,
    one per addressable shard, in the array's row-major order.

    Relies on: `unsafe_buffer_pointer()` of a host array's shard is the memory that the next
    computation reading the array reads, and that its bytes are the shard's elements in
    row-major order with no padding; so values written there are what it sees, and what
    copies into it wrote is read there once they are done. The manager writes each dispatch's
    plan (its block indices) this way, instead of a `device_put` of three small arrays per
    dispatch (the plain path); the stores read and write host rows in place (the plain path:
    a `device_put` of each row, and a copy out of it).
    """
    views = []
    for shard in array.addressable_shards:
        nbytes = shard.data.on_device_size_in_bytes()
        views.append(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(
            shard.data.unsafe_buffer_pointer())))
    return views


def pinned_by_external_reference(error: Exception) -> bool:
    """Whether a dispatch failed because a buffer it donates is pinned by an external
    reference (a NumPy view from `np.asarray` of a GPU array).

    Relies on: JAX raises `JaxRuntimeError` (0.11) or `ValueError` (0.10) whose text says
    "external reference". The caller's plain path is the same computation without donation
    (a copy of the pool), with a `DonationWarning`.
    """
    return (isinstance(error, (jax.errors.JaxRuntimeError, ValueError))
            and "external reference" in str(error))


def memory_space(x: Any) -> Any:
    """x's memory space (`jax.memory.Space`) where JAX's type says it, else None (NumPy,
    older JAX): inside `jax.jit` this is the only way to tell a pinned_host operand.

    Relies on: `jax.typeof(x).memory_space`, an attribute of JAX's abstract arrays.
    """
    return getattr(jax.typeof(x), "memory_space", None) if isinstance(x, jax.Array) else None

