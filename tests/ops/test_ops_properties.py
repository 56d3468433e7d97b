"""Hypothesis property tests of kvx.copy_blocks / kvx.partial_block_copy.

Random shapes (1s and odd sizes included), dtypes, index lists with repeated sources, duplicate
destinations, -1 padding and (traced) out-of-range entries, and token counts; every result is
compared bitwise with two independent NumPy formulations of the semantics. Runs on the default
backend. KVXFER_HYPOTHESIS_SCALE multiplies the example counts (default 1).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    as_bytes,
    assert_bitwise_equal,
    assert_unchanged,
    dtype_id,
    four_bit_error,
    jit_copy,
    jit_copy_donated,
    jit_copy_intra,
    jit_copy_intra_donated,
    jit_copy_whole,
    jit_partial,
    normalize_tokens_ref,
    put,
    random_values,
    reference_copy_blocks,
    reference_partial_block_copy,
    x64_if_needed,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jax_kvxfer as kvx

SCALE = float(os.environ.get("KVXFER_HYPOTHESIS_SCALE", "1"))


def examples(n: int) -> settings:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        database=None,  # no .hypothesis/ directory in the checkout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


dtypes = st.sampled_from(ALL_DTYPES)
block_shapes = st.tuples(
    st.integers(1, 3),  # num_layers
    st.integers(1, 2),  # kv_factor
    st.integers(1, 3),  # num_kv_heads
    st.integers(1, 9),  # tokens_per_block
    st.integers(1, 5),  # size_per_head
)


def last_writer_reference(dst, src, si, di, num_tokens):
    """A second formulation: token t of block d comes from the last valid pair j with
    di[j] == d and t < n_j (n_j normalized), else keeps its old value."""
    out = as_bytes(dst).copy()
    sb = as_bytes(src)
    tokens_per_block = dst.shape[4]
    tokens = normalize_tokens_ref(num_tokens, len(si))
    valid = [0 <= s < src.shape[0] and 0 <= d < dst.shape[0] for s, d in zip(si, di)]
    for d in range(dst.shape[0]):
        for t in range(tokens_per_block):
            for j in reversed(range(len(si))):
                n = tokens[j] if 0 < tokens[j] < tokens_per_block else tokens_per_block
                if valid[j] and di[j] == d and t < n:
                    out[d, :, :, :, t] = sb[si[j], :, :, :, t]
                    break
    return out.view(dst.dtype).reshape(dst.shape)


@st.composite
def copy_cases(draw, traced: bool, intra: bool = False):
    """(block_shape, dtype, dst_blocks, src_blocks, si, di, num_tokens, seed)."""
    block = draw(block_shapes)
    dtype = draw(dtypes)
    dst_blocks = draw(st.integers(1, 6))
    src_blocks = dst_blocks if intra else draw(st.integers(1, 6))
    batch = draw(st.integers(0, 8))
    tokens_per_block = block[3]

    def index(num_blocks):
        # mostly valid (small ranges make repeats likely), some padding; when traced also
        # out-of-range values, which must be skipped.
        choices = [st.integers(0, num_blocks - 1), st.integers(0, num_blocks - 1),
                   st.integers(-3, -1)]
        if traced:
            choices += [st.integers(num_blocks, num_blocks + 3),
                        st.sampled_from([2**31 - 1, -2**31])]
        return st.one_of(*choices)

    si = draw(st.lists(index(src_blocks), min_size=batch, max_size=batch))
    di = draw(st.lists(index(dst_blocks), min_size=batch, max_size=batch))
    n = st.integers(-2, tokens_per_block + 3)
    num_tokens = draw(st.one_of(st.none(), n, st.lists(n, min_size=batch, max_size=batch)))
    seed = draw(st.integers(0, 2**32 - 1))
    return block, dtype, dst_blocks, src_blocks, si, di, num_tokens, seed


def _expected_error(block, dtype, num_tokens, batch, traced):
    if num_tokens is None:
        return four_bit_error(block, dtype, None)
    tokens = normalize_tokens_ref(num_tokens, batch)
    return four_bit_error(block, dtype, tokens, traced_tokens=traced)


@pytest.mark.slow
@examples(250)
@given(case=copy_cases(traced=False), data=st.data())
def test_eager_copy_blocks_matches_reference(case, data):
    block, dtype, dst_blocks, src_blocks, si, di, num_tokens, seed = case
    rng = np.random.default_rng(seed)
    # Eagerly, a known index >= num_blocks raises; draw one in now and then.
    if si and data.draw(st.booleans(), "out of range") and data.draw(st.booleans(), "again"):
        k = data.draw(st.integers(0, len(si) - 1), "pair")
        if data.draw(st.booleans(), "src side"):
            si[k] = src_blocks + data.draw(st.integers(0, 2), "excess")
        else:
            di[k] = dst_blocks + data.draw(st.integers(0, 2), "excess")
    with x64_if_needed(dtype):
        dst = random_values(rng, (dst_blocks,) + block, dtype)
        src = random_values(rng, (src_blocks,) + block, dtype)
        d, s = put(dst), put(src)
        oor = any(v >= src_blocks for v in si) or any(v >= dst_blocks for v in di)
        error = _expected_error(block, dtype, num_tokens, len(si), traced=False)
        event("sub-byte ValueError" if error else "out of range" if oor else "copied")
        if error is not None:
            with pytest.raises(ValueError, match=error):
                kvx.copy_blocks(d, s, si, di, num_tokens)
        elif oor:
            with pytest.raises(IndexError, match="src_indices|dst_indices"):
                kvx.copy_blocks(d, s, si, di, num_tokens)
        else:
            out = kvx.copy_blocks(d, s, si, di, num_tokens)
            expected = reference_copy_blocks(dst, src, si, di, num_tokens)
            assert_bitwise_equal(out, expected, "vs loop reference")
            assert_bitwise_equal(out, last_writer_reference(dst, src, si, di, num_tokens),
                                 "vs last-writer reference")
            assert out.sharding == d.sharding
        assert_unchanged(d, dst, "dst_pool")
        assert_unchanged(s, src, "src_pool")


@pytest.mark.slow
@examples(250)
@given(case=copy_cases(traced=True), donate=st.booleans())
def test_jit_copy_blocks_matches_reference(case, donate):
    block, dtype, dst_blocks, src_blocks, si, di, num_tokens, seed = case
    rng = np.random.default_rng(seed)
    with x64_if_needed(dtype):
        dst = random_values(rng, (dst_blocks,) + block, dtype)
        src = random_values(rng, (src_blocks,) + block, dtype)
        d, s = put(dst), put(src)
        si_a, di_a = np.array(si, np.int32), np.array(di, np.int32)
        error = _expected_error(block, dtype, num_tokens, len(si), traced=True)
        if num_tokens is None:
            call = lambda: jit_copy_whole(d, s, si_a, di_a)
        else:
            nt = np.array(normalize_tokens_ref(num_tokens, len(si)), np.int32)
            fn = jit_copy_donated if donate else jit_copy
            call = lambda: fn(d, s, si_a, di_a, nt)
        event("sub-byte ValueError" if error else "copied")
        skipped = any(not (0 <= a < src_blocks and 0 <= b < dst_blocks) for a, b in zip(si, di))
        event(f"some pairs skipped: {skipped}")
        if error is not None:
            with pytest.raises(ValueError, match=error):
                call()
            assert_unchanged(d, dst, "dst_pool")
            return
        out = call()
        assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, num_tokens))
        assert_bitwise_equal(out, last_writer_reference(dst, src, si, di, num_tokens),
                             "vs last-writer reference")
        assert d.is_deleted() == (donate and num_tokens is not None)
        assert_unchanged(s, src, "src_pool")


@pytest.mark.slow
@examples(200)
@given(case=copy_cases(traced=True, intra=True), mode=st.sampled_from(["eager", "jit", "donated"]))
def test_intra_pool_copy_is_functional(case, mode):
    """Source and destination are one array: every pair reads the pool as it was before."""
    block, dtype, num_blocks, _, si, di, num_tokens, seed = case
    if mode == "eager":  # eager indices are concrete: out-of-range ones raise, tested above
        si = [v if v < num_blocks else -1 for v in si]
        di = [v if v < num_blocks else -1 for v in di]
    rng = np.random.default_rng(seed)
    with x64_if_needed(dtype):
        pool_np = random_values(rng, (num_blocks,) + block, dtype)
        pool = put(pool_np)
        nt = normalize_tokens_ref(num_tokens, len(si))
        traced = mode != "eager"
        error = _expected_error(block, dtype, nt, len(si), traced=traced)
        if mode == "eager":
            call = lambda: kvx.copy_blocks(pool, pool, si, di, num_tokens)
        else:
            fn = jit_copy_intra_donated if mode == "donated" else jit_copy_intra
            call = lambda: fn(pool, np.array(si, np.int32), np.array(di, np.int32),
                              np.array(nt, np.int32))
        event("sub-byte ValueError" if error else "copied")
        if error is not None:
            with pytest.raises(ValueError, match=error):
                call()
            assert_unchanged(pool, pool_np, "pool")
            return
        out = call()
        assert_bitwise_equal(out, reference_copy_blocks(pool_np, pool_np, si, di, nt))
        assert_bitwise_equal(out, last_writer_reference(pool_np, pool_np, si, di, nt),
                             "vs last-writer reference")
        if mode == "donated":
            assert pool.is_deleted()
        else:
            assert_unchanged(pool, pool_np, "pool")


@pytest.mark.slow
@examples(120)
@given(block=block_shapes, dtype=dtypes, n=st.integers(-3, 12), traced=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_partial_block_copy_matches_reference(block, dtype, n, traced, seed):
    rng = np.random.default_rng(seed)
    with x64_if_needed(dtype):
        dst, src = random_values(rng, block, dtype), random_values(rng, block, dtype)
        d, s = put(dst), put(src)
        error = four_bit_error(block, dtype, [n], traced_tokens=traced)
        call = ((lambda: jit_partial(d, s, np.int32(n))) if traced
                else (lambda: kvx.partial_block_copy(d, s, n)))
        if error is not None:
            with pytest.raises(ValueError, match=error):
                call()
        else:
            assert_bitwise_equal(call(), reference_partial_block_copy(dst, src, n))
        assert_unchanged(d, dst, "dst")
        assert_unchanged(s, src, "src")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_last_writer_reference_agrees_with_loop_reference(dtype):
    """The two NumPy formulations used above agree (a check of the test's own references)."""
    rng = np.random.default_rng(1234)
    for _ in range(20):
        shape = (4, 1, 2, 1, int(rng.integers(1, 6)), 2)
        dst, src = random_values(rng, shape, dtype), random_values(rng, shape, dtype)
        b = int(rng.integers(0, 8))
        si, di = rng.integers(-1, 4, b).tolist(), rng.integers(-1, 4, b).tolist()
        nt = rng.integers(-1, shape[4] + 2, b).tolist()
        assert_bitwise_equal(last_writer_reference(dst, src, si, di, nt),
                             reference_copy_blocks(dst, src, si, di, nt))
        assert_bitwise_equal(last_writer_reference(dst, dst, si, di, nt),
                             reference_copy_blocks(dst, dst, si, di, nt))

