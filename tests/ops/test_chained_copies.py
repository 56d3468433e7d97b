"""Chains of copies in one jitted program, executed again and again.

The kernel targets are command-buffer compatible: on a GPU, XLA may record a chain of five or
more of them into a CUDA graph and replay it without running the handler, re-recording a copy
only when one of its buffers moved. Every execution here must still be exact, whether it
replays (same buffers, new values in them), or re-records (new index arrays or pools at new
addresses).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bitwise_equal, make_pools, put, reference_copy_blocks, sharding

import jax_kvxfer as kvx

SHAPE = (12, 2, 2, 2, 8, 16)  # 12 blocks of 2 KiB (bfloat16)
T = SHAPE[4]
STEPS = 6  # copies per program: more than XLA's smallest graph (five commands)
BATCH = 7


def to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, sharding("device"))


def chain(a, b, idx):
    """STEPS copies, alternately b <- a and a <- b, then one within `a` (traced: staged)."""
    for k in range(STEPS):
        si, di, nt = idx[k]
        if k % 2 == 0:
            b = kvx.copy_blocks(b, a, si, di, nt)
        else:
            a = kvx.copy_blocks(a, b, si, di, nt)
    si, di, nt = idx[STEPS]
    return kvx.copy_blocks(a, a, si, di, nt), b


def reference(a, b, idx):
    for k in range(STEPS):
        if k % 2 == 0:
            b = reference_copy_blocks(b, a, *idx[k])
        else:
            a = reference_copy_blocks(a, b, *idx[k])
    return reference_copy_blocks(a, a, *idx[STEPS]), b


def random_indices(rng):
    """Per copy: indices with duplicates, padding and partial token counts."""
    out = []
    for _ in range(STEPS + 1):
        si = rng.integers(-1, SHAPE[0], BATCH).astype(np.int32)
        di = rng.integers(0, SHAPE[0], BATCH).astype(np.int32)
        nt = rng.integers(-1, T + 2, BATCH).astype(np.int32)
        out.append((si, di, nt))
    return out


@pytest.mark.parametrize("kinds", [("device", "device"), ("device", "pinned_host")])
def test_chain_exact_on_every_execution(kinds, rng):
    fn = jax.jit(chain, donate_argnums=(0, 1))
    a_np, b_np = make_pools(rng, SHAPE, jnp.bfloat16)
    a, b = put(a_np, kinds[0]), put(b_np, kinds[1])
    idx_np = random_indices(rng)
    idx = jax.device_put(idx_np)
    for step in ("first", "same buffers", "new indices", "new pools", "same buffers"):
        if step == "new indices":
            idx_np = random_indices(rng)
            idx = jax.device_put(idx_np)
        if step == "new pools":
            a_np, b_np = make_pools(rng, SHAPE, jnp.bfloat16)
            a, b = put(a_np, kinds[0]), put(b_np, kinds[1])
        want_a, want_b = reference(a_np, b_np, idx_np)
        a, b = fn(a, b, idx)
        # read through a device copy: a NumPy view of a pinned_host pool would keep a
        # reference to it, and the next execution could not donate it
        assert_bitwise_equal(to_device(a), want_a, f"pool a after '{step}'")
        assert_bitwise_equal(to_device(b), want_b, f"pool b after '{step}'")
        a_np, b_np = want_a, want_b


def copy_targets(fn, *args) -> set[str]:
    """The custom-call targets in fn's lowered program."""
    return set(re.findall(r"jax_kvxfer_block_copy\w*", jax.jit(fn).lower(*args).as_text()))


def test_graph_and_nograph_targets(rng):
    """Copies may be recorded into CUDA graphs, except those a graph would break: dma=True
    copies (the handler reads their indices on the host as it enqueues)."""
    a_np, b_np = make_pools(rng, SHAPE, jnp.bfloat16)
    a, b = put(a_np, "device"), put(b_np, "device")
    idx = jnp.asarray(rng.permutation(SHAPE[0])[:4].astype(np.int32))
    assert copy_targets(lambda a, b, i: kvx.copy_blocks(a, b, i, i), a, b, idx) == {
        "jax_kvxfer_block_copy"}
    assert copy_targets(lambda a, i: kvx.copy_blocks(a, a, i, i[::-1]), a, idx) == {
        "jax_kvxfer_block_copy_within"}
    if "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}:
        h = put(b_np, "pinned_host")
        hi = jax.device_put(np.asarray(idx), sharding("pinned_host"))
        assert copy_targets(lambda a, h, i: kvx.copy_blocks(a, h, i, i, dma=True), a, h, hi) == {
            "jax_kvxfer_block_copy_nograph"}
