"""Tests of kvx.copy_blocks and kvx.partial_block_copy against an independent NumPy reference.

Every comparison is bitwise (raw bytes), on random data, eagerly and inside jax.jit with the
indices and token counts traced. Runs on the default backend (CPU or GPU).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    FOUR_BIT_DTYPES,
    SOME_DTYPES,
    as_bytes,
    assert_bitwise_equal,
    assert_unchanged,
    dtype_id,
    jit_copy,
    jit_copy_donated,
    jit_copy_intra,
    jit_copy_intra_donated,
    jit_copy_whole,
    jit_partial,
    make_pools,
    put,
    random_values,
    reference_copy_blocks,
    reference_partial_block_copy,
    requires_gpu,
    run_copy_blocks,
)

import jax_kvxfer as kvx

MODES = ("eager", "jit", "jit_donated")
MEMORY_KINDS = ("device", "pinned_host")


def token_cases(tokens_per_block: int) -> list[int]:
    t = tokens_per_block
    return [-1, 0, 1, t // 2, t - 1, t, t + 3]


# ---------------------------------------------------------------------------------------------
# every dtype x every token count, one small shape

DTYPE_SHAPE = (6, 2, 2, 2, 6, 4)  # [num_blocks, layers, kv, heads, tokens_per_block, size_per_head]
DTYPE_T = DTYPE_SHAPE[4]
# Pair 0 and pair 4 write block 4 (the later wins); pair 3 is padding.
DTYPE_SRC = [3, 0, 5, -1, 2]
DTYPE_DST = [1, 4, 0, 2, 4]


@pytest.mark.parametrize("n", token_cases(DTYPE_T))
def test_copy_blocks_every_dtype_and_token_count(dtype, n, rng):
    dst, src = make_pools(rng, DTYPE_SHAPE, dtype)
    expected = reference_copy_blocks(dst, src, DTYPE_SRC, DTYPE_DST, n)
    per_pair = [n] * len(DTYPE_SRC)
    for mode, tokens in (("eager", n), ("eager", per_pair), ("jit", per_pair),
                         ("jit_donated", per_pair)):
        out = run_copy_blocks(mode, dst, src, DTYPE_SRC, DTYPE_DST, tokens)
        assert out.dtype == dtype and out.shape == DTYPE_SHAPE
        assert_bitwise_equal(out, expected, f"{mode} tokens={tokens}")


def test_copy_blocks_whole_block_default(dtype, rng):
    dst, src = make_pools(rng, DTYPE_SHAPE, dtype)
    expected = reference_copy_blocks(dst, src, DTYPE_SRC, DTYPE_DST, None)
    for mode in MODES:
        out = run_copy_blocks(mode, dst, src, DTYPE_SRC, DTYPE_DST, None)
        assert_bitwise_equal(out, expected, mode)


# ---------------------------------------------------------------------------------------------
# shapes, including 1 head, 1 token per block, size_per_head 1 and 3, kv_factor 1 and 2

SHAPES = [
    (3, 1, 1, 1, 1, 1),  # everything 1: a block is one element
    (4, 1, 2, 1, 4, 3),  # size_per_head 3
    (4, 2, 1, 3, 5, 1),  # size_per_head 1, kv_factor 1, odd tokens_per_block
    (5, 1, 2, 2, 8, 6),
    (3, 3, 1, 1, 2, 2),
    (2, 1, 1, 1, 16, 128),  # a realistic row
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", SOME_DTYPES, ids=dtype_id, indirect=True)
def test_copy_blocks_shapes(shape, dtype, rng):
    num_blocks, tokens_per_block = shape[0], shape[4]
    cases = token_cases(tokens_per_block)
    # One pair per token count; destinations wrap around so blocks get several writers with
    # different token counts (the later pair wins for the tokens it writes).
    si = [int(v) for v in rng.integers(0, num_blocks, len(cases))]
    di = [i % num_blocks for i in range(len(cases))]
    dst, src = make_pools(rng, shape, dtype)
    expected = reference_copy_blocks(dst, src, si, di, cases)
    for mode in MODES:
        out = run_copy_blocks(mode, dst, src, si, di, cases)
        assert_bitwise_equal(out, expected, mode)


@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES, ids=dtype_id, indirect=True)
@pytest.mark.parametrize("shape", [(3, 1, 1, 1, 1, 2), (4, 1, 2, 1, 4, 4), (3, 2, 1, 3, 5, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_copy_blocks_four_bit_shapes(shape, dtype, rng):
    num_blocks, cases = shape[0], token_cases(shape[4])
    si = [int(v) for v in rng.integers(0, num_blocks, len(cases))]
    di = [(i + 1) % num_blocks for i in range(len(cases))]
    dst, src = make_pools(rng, shape, dtype)
    expected = reference_copy_blocks(dst, src, si, di, cases)
    for mode in MODES:
        assert_bitwise_equal(run_copy_blocks(mode, dst, src, si, di, cases), expected, mode)


def test_src_and_dst_pools_of_different_sizes(rng):
    dst, src = make_pools(rng, (3, 1, 2, 2, 4, 8), jnp.float32, src_blocks=7)
    si, di, nt = [6, 0, 4], [0, 2, 1], [2, 0, 3]
    expected = reference_copy_blocks(dst, src, si, di, nt)
    for mode in MODES:
        out = run_copy_blocks(mode, dst, src, si, di, nt)
        assert out.shape == dst.shape
        assert_bitwise_equal(out, expected, mode)


# ---------------------------------------------------------------------------------------------
# explicit semantics (not only through the reference)


@pytest.mark.parametrize("mode", MODES)
def test_untouched_tokens_and_blocks_keep_old_values(mode, rng):
    shape = (4, 2, 2, 3, 8, 4)
    dst, src = make_pools(rng, shape, jnp.float32)
    out = np.asarray(run_copy_blocks(mode, dst, src, [1], [2], [3]))
    # block 2, tokens < 3: from src block 1, for every layer, K/V and head
    assert_bitwise_equal(out[2, :, :, :, :3], src[1, :, :, :, :3], "copied tokens")
    # block 2, tokens >= 3: old dst values
    assert_bitwise_equal(out[2, :, :, :, 3:], dst[2, :, :, :, 3:], "untouched tokens")
    # other blocks: old dst values
    for b in (0, 1, 3):
        assert_bitwise_equal(out[b], dst[b], f"untouched block {b}")
    assert not np.array_equal(as_bytes(out[2]), as_bytes(dst[2]))


@pytest.mark.parametrize("mode", MODES)
def test_duplicate_destinations_last_writer_wins_per_token(mode, rng):
    shape = (5, 1, 2, 2, 6, 2)
    dst, src = make_pools(rng, shape, jnp.int32)
    # Block 2 is written whole by pair 0, its first 4 tokens by pair 1, its first token by
    # pair 3; pair 2 (block 3) is unrelated.
    out = np.asarray(run_copy_blocks(mode, dst, src, [0, 1, 4, 3], [2, 2, 3, 2], [0, 4, 6, 1]))
    assert_bitwise_equal(out[2, ..., 0:1, :], src[3, ..., 0:1, :], "token 0 (pair 3)")
    assert_bitwise_equal(out[2, ..., 1:4, :], src[1, ..., 1:4, :], "tokens 1-3 (pair 1)")
    assert_bitwise_equal(out[2, ..., 4:, :], src[0, ..., 4:, :], "tokens 4-5 (pair 0)")
    assert_bitwise_equal(out[3], src[4], "block 3")
    for b in (0, 1, 4):
        assert_bitwise_equal(out[b], dst[b], f"block {b}")


@pytest.mark.parametrize("mode", MODES)
def test_later_whole_block_overrides_earlier_partial(mode, rng):
    dst, src = make_pools(rng, (3, 1, 2, 1, 4, 4), jnp.bfloat16)
    out = np.asarray(run_copy_blocks(mode, dst, src, [0, 1], [2, 2], [2, -1]))
    assert_bitwise_equal(out[2], src[1], "block 2")


@pytest.mark.parametrize("mode", MODES)
def test_negative_indices_skip_the_pair(mode, rng):
    dst, src = make_pools(rng, (4, 1, 2, 1, 4, 4), jnp.float16)
    si, di = [-1, 2, 0, -7], [1, -1, 3, -3]
    out = np.asarray(run_copy_blocks(mode, dst, src, si, di, [2, 0, 0, 1]))
    expected = dst.copy()
    expected[3] = src[0]
    assert_bitwise_equal(out, expected, mode)
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, [2, 0, 0, 1]), mode)


@pytest.mark.parametrize("donate", [False, True])
def test_traced_out_of_range_indices_are_skipped(donate, rng):
    shape = (4, 1, 2, 2, 4, 2)
    dst, src = make_pools(rng, shape, jnp.float32, src_blocks=6)
    # out of range: src 6 (== num_src_blocks), dst 4 (== num_dst_blocks), huge values;
    # pairs 1 and 4 are valid (src 5 is valid for the 6-block source).
    si = np.array([6, 5, 1, 2**31 - 1, 0, -2**31], np.int32)
    di = np.array([0, 1, 4, 2, 3, 2], np.int32)
    nt = np.array([0, 2, 0, 0, 3, 0], np.int32)
    fn = jit_copy_donated if donate else jit_copy
    d = put(dst)
    out = np.asarray(fn(d, put(src), si, di, nt))
    expected = dst.copy()
    expected[1, :, :, :, :2] = src[5, :, :, :, :2]
    expected[3, :, :, :, :3] = src[0, :, :, :, :3]
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, nt))
    assert d.is_deleted() == donate


def test_empty_batch(rng):
    dst, src = make_pools(rng, (3, 1, 2, 1, 4, 2), jnp.uint8)
    for si, di in (([], []), (np.zeros(0, np.int32), np.zeros(0, np.int64))):
        assert_bitwise_equal(kvx.copy_blocks(put(dst), put(src), si, di), dst)
        assert_bitwise_equal(kvx.copy_blocks(put(dst), put(src), si, di, []), dst)
    out = jit_copy(put(dst), put(src), np.zeros(0, np.int32), np.zeros(0, np.int32),
                   np.zeros(0, np.int32))
    assert_bitwise_equal(out, dst)


def test_index_and_token_argument_forms_agree(rng):
    dst, src = make_pools(rng, (5, 1, 2, 2, 4, 2), jnp.float32)
    si, di, nt = [4, 1, 0], [0, 3, 1], [1, 0, 3]
    expected = reference_copy_blocks(dst, src, si, di, nt)
    forms = [
        (si, di, nt),
        (tuple(si), tuple(di), tuple(nt)),
        (np.array(si, np.int64), np.array(di, np.int16), np.array(nt, np.uint8)),
        (jnp.array(si), jnp.array(di, jnp.int8), jnp.array(nt)),
        (np.array(si, np.uint32), jnp.array(di, jnp.uint16), np.array(nt, np.int8)),
    ]
    for s, d, n in forms:
        assert_bitwise_equal(kvx.copy_blocks(put(dst), put(src), s, d, n), expected, repr(s))
    # scalar token counts: Python int, NumPy scalar, 0-d arrays (concrete and traced)
    expected = reference_copy_blocks(dst, src, si, di, 2)
    for n in (2, np.int64(2), np.array(2, np.int32), jnp.array(2, jnp.int16)):
        assert_bitwise_equal(kvx.copy_blocks(put(dst), put(src), si, di, n), expected, repr(n))
    scalar_jit = jax.jit(lambda d_, s_, a, b, n: kvx.copy_blocks(d_, s_, a, b, n))
    assert_bitwise_equal(scalar_jit(put(dst), put(src), np.array(si), np.array(di),
                                    np.int32(2)), expected, "traced scalar")


def test_indices_beyond_int32_are_not_wrapped(x64, rng):
    """int64 indices that do not fit int32 must not wrap into valid block indices."""
    dst, src = make_pools(rng, (4, 1, 2, 1, 4, 2), jnp.float32)
    d, s = put(dst), put(src)
    big = 2**32 + 1  # wraps to 1 as int32
    for idx in (np.array([big], np.int64), jnp.array([big], jnp.int64),
                jnp.array([2**32 - 1], jnp.uint32)):
        with pytest.raises(IndexError, match="src_indices"):
            kvx.copy_blocks(d, s, idx, [3])
        with pytest.raises(IndexError, match="dst_indices"):
            kvx.copy_blocks(d, s, [1], idx)
    assert_unchanged(d, dst, "dst_pool")
    # traced: out of range, so skipped (never copied into block 1 / 3)
    si = jnp.array([big, 0], jnp.int64)
    di = jnp.array([3, big], jnp.int64)
    out = jit_copy_whole(d, s, si, di)
    assert_bitwise_equal(out, dst)
    # traced token counts beyond int32 copy whole blocks, like any count >= tokens_per_block
    out = jit_copy(d, s, jnp.array([0], jnp.int64), jnp.array([3], jnp.int64),
                   jnp.array([big], jnp.int64))
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, [0], [3], None))
    out = jax.jit(kvx.partial_block_copy)(put(dst[0]), put(src[1]), jnp.int64(big))
    assert_bitwise_equal(out, src[1])


# ---------------------------------------------------------------------------------------------
# one pool as source and destination (functional semantics)


def test_intra_pool_chain_eager(rng):
    pool_np = random_values(rng, (5, 1, 2, 2, 4, 4), jnp.float32)
    pool = put(pool_np)
    out = np.asarray(kvx.copy_blocks(pool, pool, [1, 2], [2, 3]))
    assert_bitwise_equal(out[3], pool_np[2], "block 3 must get the OLD block 2")
    assert_bitwise_equal(out[2], pool_np[1], "block 2")
    assert_bitwise_equal(out, reference_copy_blocks(pool_np, pool_np, [1, 2], [2, 3]))
    assert_unchanged(pool, pool_np, "the pool")
    # partial chain and a swap, same object twice
    for si, di, nt in (([1, 2], [2, 3], [2, 3]), ([1, 2], [2, 1], None), ([3, 3], [3, 0], [1, 2])):
        out = kvx.copy_blocks(pool, pool, si, di, nt)
        assert_bitwise_equal(out, reference_copy_blocks(pool_np, pool_np, si, di, nt), str(si))


@pytest.mark.parametrize("donate", [False, True])
def test_intra_pool_chain_jit_traced(donate, rng):
    pool_np = random_values(rng, (5, 2, 2, 1, 4, 2), jnp.bfloat16)
    fn = jit_copy_intra_donated if donate else jit_copy_intra
    cases = [
        ([1, 2], [2, 3], [0, 0]),
        ([1, 2], [2, 3], [3, 2]),
        ([1, 2], [2, 1], [0, 0]),  # swap
        ([0, 1], [2, 4], [0, 0]),  # no hazard
        ([2, 2], [2, 2], [1, 0]),  # self copies
        ([4, 3, 2], [3, 2, 4], [2, 0, 3]),  # cycle
    ]
    for si, di, nt in cases:
        pool = put(pool_np)
        out = fn(pool, np.array(si, np.int32), np.array(di, np.int32), np.array(nt, np.int32))
        assert_bitwise_equal(out, reference_copy_blocks(pool_np, pool_np, si, di, nt), str(si))
        assert pool.is_deleted() == donate


@pytest.mark.parametrize("donate", [False, True])
def test_intra_pool_chain_jit_concrete_indices(donate, rng):
    """Indices known at trace time (closed over): the op decides statically whether to stage."""
    pool_np = random_values(rng, (5, 1, 2, 2, 4, 2), jnp.int8)
    for si, di in (([1, 2], [2, 3]), ([1, 2], [2, 1]), ([0, 1], [3, 4])):
        fn = jax.jit(lambda p, si=si, di=di: kvx.copy_blocks(p, p, si, di, 3),
                     donate_argnums=0 if donate else ())
        out = fn(put(pool_np))
        assert_bitwise_equal(out, reference_copy_blocks(pool_np, pool_np, si, di, 3), str(si))


# ---------------------------------------------------------------------------------------------
# jit: no recompiles, in place with donation


def test_jit_does_not_recompile_for_new_indices_or_token_counts(rng):
    traces = []

    @jax.jit
    def step(dst, src, si, di, nt):
        traces.append(1)
        return kvx.copy_blocks(dst, src, si, di, nt)

    shape = (6, 1, 2, 2, 4, 2)
    dst, src = make_pools(rng, shape, jnp.float32)
    d, s = put(dst), put(src)
    for _ in range(6):
        si = rng.integers(-1, 6, 3).astype(np.int32)
        di = rng.integers(-1, 8, 3).astype(np.int32)  # some traced out-of-range ones
        nt = rng.integers(-1, 6, 3).astype(np.int32)
        out = step(d, s, si, di, nt)
        assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, nt))
    assert len(traces) == 1
    assert step._cache_size() == 1
    # partial_block_copy with a traced token count
    traces.clear()

    @jax.jit
    def partial(dst, src, n):
        traces.append(1)
        return kvx.partial_block_copy(dst, src, n)

    for n in (1, 3, 0, 7):
        out = partial(d[0], s[1], np.int32(n))
        assert_bitwise_equal(out, reference_partial_block_copy(dst[0], src[1], n))
    assert len(traces) == 1
    assert partial._cache_size() == 1


def _compiled_text(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def _pool_copies(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines()
            if re.search(r"\bcopy(-start|-done)?\(", line) or "copy-start" in line]


@pytest.mark.parametrize("dst_kind", MEMORY_KINDS)
def test_donated_destination_is_updated_in_place(dst_kind, rng):
    shape = (8, 2, 2, 2, 8, 8)
    dst, src = make_pools(rng, shape, jnp.float32)
    d, s = put(dst, dst_kind), put(src)
    si, di, nt = (np.array(v, np.int32) for v in ([0, 5, 2], [1, 2, 7], [3, 0, 8]))
    hlo = _compiled_text(jit_copy_donated, d, s, si, di, nt)
    assert 'custom_call_target="jax_kvxfer_block_copy"' in hlo
    assert not _pool_copies(hlo), "the donated pool is copied:\n" + "\n".join(_pool_copies(hlo))
    out = jit_copy_donated(d, s, si, di, nt)
    assert d.is_deleted()
    assert not s.is_deleted()
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, si, di, nt))
    # and again, on the result (a running cache updated step after step)
    out2 = jit_copy_donated(out, s, di, si, nt)
    assert out.is_deleted()
    expected = reference_copy_blocks(reference_copy_blocks(dst, src, si, di, nt), src, di, si, nt)
    assert_bitwise_equal(out2, expected)


def test_non_donated_jit_keeps_the_input(rng):
    dst, src = make_pools(rng, (4, 1, 2, 1, 4, 2), jnp.float32)
    d = put(dst)
    out = jit_copy(d, put(src), np.array([0], np.int32), np.array([1], np.int32),
                   np.array([2], np.int32))
    assert_unchanged(d, dst, "non-donated dst")
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, [0], [1], [2]))


# ---------------------------------------------------------------------------------------------
# memory kinds


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("src_kind", MEMORY_KINDS)
@pytest.mark.parametrize("dst_kind", MEMORY_KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int4], ids=dtype_id, indirect=True)
def test_memory_kinds(dst_kind, src_kind, mode, dtype, rng):
    shape = (4, 2, 2, 2, 4, 6)
    dst, src = make_pools(rng, shape, dtype, src_blocks=5)
    si, di, nt = [4, 0, 2, -1], [1, 3, 1, 0], [0, 2, 3, 1]
    expected = reference_copy_blocks(dst, src, si, di, nt)
    out = run_copy_blocks(mode, dst, src, si, di, nt, dst_kind=dst_kind, src_kind=src_kind)
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, expected, f"{src_kind} -> {dst_kind}, {mode}")


@pytest.mark.parametrize("src_kind", MEMORY_KINDS)
@pytest.mark.parametrize("dst_kind", MEMORY_KINDS)
def test_memory_kinds_partial_block_copy(dst_kind, src_kind, rng):
    dst, src = make_pools(rng, (2, 2, 3, 5, 4), jnp.bfloat16)
    d, s = put(dst, dst_kind), put(src, src_kind)
    out = kvx.partial_block_copy(d, s, 2)
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, reference_partial_block_copy(dst, src, 2))
    out = jit_partial(d, s, np.int32(3))
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, reference_partial_block_copy(dst, src, 3))


def test_eager_result_keeps_the_destination_sharding(rng):
    dst, src = make_pools(rng, (3, 1, 2, 1, 2, 2), jnp.float32)
    for kind in MEMORY_KINDS:
        d = put(dst, kind)
        out = kvx.copy_blocks(d, put(src), [0], [1])
        assert out.sharding == d.sharding
        assert out.sharding.memory_kind == kind


# ---------------------------------------------------------------------------------------------
# partial_block_copy


@pytest.mark.parametrize("dtype", SOME_DTYPES + FOUR_BIT_DTYPES + (jnp.dtype(jnp.int64),),
                         ids=dtype_id, indirect=True)
def test_partial_block_copy(dtype, rng):
    block = (2, 2, 3, 6, 4)
    dst, src = random_values(rng, block, dtype), random_values(rng, block, dtype)
    for n in token_cases(block[3]):
        expected = reference_partial_block_copy(dst, src, n)
        d, s = put(dst), put(src)
        for got in (kvx.partial_block_copy(d, s, n), kvx.partial_block_copy(d, s, np.int64(n)),
                    kvx.partial_block_copy(d, s, jnp.array(n)), jit_partial(d, s, np.int32(n))):
            assert got.shape == block and got.dtype == dtype
            assert_bitwise_equal(got, expected, f"n={n}")
        assert_unchanged(d, dst, "dst")


def test_partial_block_copy_same_block(rng):
    blk_np = random_values(rng, (1, 2, 1, 4, 2), jnp.float32)
    blk = put(blk_np)
    assert_bitwise_equal(kvx.partial_block_copy(blk, blk, 2), blk_np)
    assert_bitwise_equal(jit_partial(blk, blk, np.int32(2)), blk_np)


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM's BlockManagerTestPartialCopy


TRT_DTYPES = [jnp.int64, jnp.int32, jnp.float32, jnp.bfloat16, jnp.float16, jnp.bool_,
              jnp.uint8, jnp.int8, jnp.float8_e4m3fn]
# Values every dtype holds exactly: float8_e4m3fn holds the integers 0..16, bfloat16 0..256.
TRT_MODULUS = {"bool": 2, "float8_e4m3fn": 16, "int8": 128, "uint8": 256, "bfloat16": 256}


@pytest.mark.parametrize("dtype", TRT_DTYPES, ids=dtype_id, indirect=True)
def test_trtllm_partial_copy_pattern(dtype):
    layers, kv, heads, tokens_per_block, size_per_head = 2, 2, 2, 8, 16
    block = (layers, kv, heads, tokens_per_block, size_per_head)
    h = np.arange(heads)[:, None, None]
    t = np.arange(tokens_per_block)[None, :, None]
    c = np.arange(size_per_head)[None, None, :]
    pattern = (h * tokens_per_block + t) * size_per_head + c  # [heads, tokens, channels]
    pattern = pattern % TRT_MODULUS.get(dtype.name, 1 << 30)
    values = np.broadcast_to(pattern, block).astype(dtype)
    assert np.array_equal(values.astype(np.int64), np.broadcast_to(pattern, block)), "not exact"
    zero = np.zeros(block, dtype)
    num_tokens = 3

    def check(out):
        out = np.asarray(out)
        assert_bitwise_equal(out[:, :, :, :num_tokens], values[:, :, :, :num_tokens], "pattern")
        assert not np.any(out[:, :, :, num_tokens:].astype(np.float32)), "tokens >= 3 not zero"
        assert_bitwise_equal(out[:, :, :, num_tokens:], zero[:, :, :, num_tokens:], "zeros")

    check(kvx.partial_block_copy(put(zero), put(values), num_tokens))
    check(jit_partial(put(zero), put(values), np.int32(num_tokens)))
    # the same through copy_blocks: pool block 0 holds the pattern, block 1 is zeroed
    pool = np.stack([values, zero])
    out = np.asarray(kvx.copy_blocks(put(pool), put(pool), [0], [1], num_tokens))
    check(out[1])
    assert_bitwise_equal(out[0], values, "source block")


# ---------------------------------------------------------------------------------------------
# 4-bit dtypes: whole bytes only


@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES, ids=dtype_id, indirect=True)
def test_four_bit_odd_block_element_count_raises(dtype, rng):
    shape = (3, 1, 1, 1, 3, 1)  # 3 elements per block
    dst, src = make_pools(rng, shape, dtype)
    d, s = put(dst), put(src)
    for nt in (None, 0, 2, [1]):
        with pytest.raises(ValueError, match="even number of elements"):
            kvx.copy_blocks(d, s, [0], [1], nt)
    with pytest.raises(ValueError, match="even number of elements"):
        jit_copy_whole(d, s, np.array([0], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="even number of elements"):
        kvx.partial_block_copy(d[0], s[1], 0)
    assert_unchanged(d, dst, "dst_pool")
    assert_unchanged(s, src, "src_pool")


@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES, ids=dtype_id, indirect=True)
def test_four_bit_odd_size_per_head(dtype, rng):
    shape = (4, 1, 1, 2, 2, 3)  # size_per_head 3, 12 elements per block
    T = shape[4]
    dst, src = make_pools(rng, shape, dtype)
    d, s = put(dst), put(src)
    si, di = [3, 0, 1], [1, 2, 1]
    # whole-block copies work: None, n <= 0, n >= tokens_per_block
    for nt in (None, 0, -1, T, T + 3, [0, T, -5]):
        expected = reference_copy_blocks(dst, src, si, di, nt)
        assert_bitwise_equal(kvx.copy_blocks(d, s, si, di, nt), expected, f"nt={nt}")
    expected = reference_copy_blocks(dst, src, si, di, None)
    assert_bitwise_equal(jit_copy_whole(d, s, np.array(si), np.array(di)), expected, "jit")
    for nt in (0, T, -1):
        assert_bitwise_equal(kvx.partial_block_copy(d[0], s[3], nt), src[3])
    # partial copies do not
    for nt in (1, [0, 1, 0]):
        with pytest.raises(ValueError, match="size_per_head"):
            kvx.copy_blocks(d, s, si, di, nt)
    with pytest.raises(ValueError, match="size_per_head"):  # traced: may be partial
        jit_copy(d, s, np.array(si), np.array(di), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="size_per_head"):
        kvx.partial_block_copy(d[0], s[3], 1)
    assert_unchanged(d, dst, "dst_pool")
    assert_unchanged(s, src, "src_pool")


@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES, ids=dtype_id, indirect=True)
def test_four_bit_operands_are_packed(dtype, rng):
    """Both handlers assume XLA hands them 4-bit pools packed two per byte (layout E(4)),
    on the CPU as on the GPU; the CPU handler once assumed one per byte and overran."""
    dst, src = make_pools(rng, (2, 1, 1, 1, 2, 4), dtype)
    d, s = put(dst), put(src)
    hlo = _compiled_text(jit_copy, d, s, np.array([0], np.int32), np.array([1], np.int32),
                         np.array([1], np.int32))
    call = next(line for line in hlo.splitlines() if "custom-call(" in line)
    type_name = {"int4": "s4", "uint4": "u4", "float4_e2m1fn": "f4e2m1fn"}[dtype.name]
    assert re.search(type_name + r"\[2,1,1,1,2,4\]\{[0-9,]+:[^}]*E\(4\)", call), call
    # the smallest pools: two blocks of two elements, one byte each
    dst, src = make_pools(rng, (2, 1, 1, 1, 1, 2), dtype)
    for si, di in (([1], [0]), ([0], [1]), ([1, 0], [0, 1])):
        assert_bitwise_equal(kvx.copy_blocks(put(dst), put(src), si, di),
                             reference_copy_blocks(dst, src, si, di), str(si))


# ---------------------------------------------------------------------------------------------
# errors: each leaves the pools as they were


@pytest.fixture
def pools(rng):
    dst, src = make_pools(rng, (4, 1, 2, 2, 4, 2), jnp.float32, src_blocks=6)
    d, s = put(dst), put(src)
    yield d, s
    assert_unchanged(d, dst, "dst_pool")
    assert_unchanged(s, src, "src_pool")


def test_error_wrong_rank(pools):
    d, s = pools
    with pytest.raises(ValueError, match="dst_pool must be a 6-D pool"):
        kvx.copy_blocks(d[0], s, [0], [1])
    with pytest.raises(ValueError, match="src_pool must be a 6-D pool"):
        kvx.copy_blocks(d, s[None], [0], [1])
    with pytest.raises(ValueError, match="src must be a 5-D block"):
        kvx.partial_block_copy(d[0], s, 1)
    with pytest.raises(ValueError, match="dst must be a 5-D block"):
        kvx.partial_block_copy(d, s[0], 1)
    with pytest.raises(ValueError, match="dst_pool must be a 6-D pool"):
        jax.jit(lambda a, b: kvx.copy_blocks(a, b, [0], [1]))(d[0, 0], s)


def test_error_block_shape_mismatch(pools, rng):
    d, _ = pools
    other = put(random_values(rng, (4, 1, 2, 2, 4, 4), jnp.float32))
    with pytest.raises(ValueError, match="src_pool has block shape"):
        kvx.copy_blocks(d, other, [0], [1])
    with pytest.raises(ValueError, match="src has block shape"):
        kvx.partial_block_copy(d[0], other[0], 1)
    with pytest.raises(ValueError, match="src_pool has block shape"):
        jit_copy(d, other, np.array([0]), np.array([1]), np.array([1]))


def test_error_dtype_mismatch(pools):
    d, s = pools
    with pytest.raises(TypeError, match="src_pool has dtype"):
        kvx.copy_blocks(d, s.astype(jnp.bfloat16), [0], [1])
    with pytest.raises(TypeError, match="src has dtype"):
        kvx.partial_block_copy(d[0], s[0].astype(jnp.int32), 1)


@pytest.mark.parametrize("bad", [np.array([0.0]), [1.5], jnp.array([1.0]),
                                 np.array([True]), [True], jnp.array([False])],
                         ids=["np-float", "list-float", "jnp-float", "np-bool", "list-bool",
                              "jnp-bool"])
def test_error_non_integer_indices(pools, bad):
    d, s = pools
    with pytest.raises(TypeError, match="src_indices must hold integers"):
        kvx.copy_blocks(d, s, bad, [1])
    with pytest.raises(TypeError, match="dst_indices must hold integers"):
        kvx.copy_blocks(d, s, [1], bad)
    with pytest.raises(TypeError, match="src_indices must hold integers"):
        jit_copy(d, s, jnp.asarray(bad), np.array([1]), np.array([0]))


def test_error_non_numeric_indices(pools):
    d, s = pools
    with pytest.raises(TypeError, match="src_indices"):
        kvx.copy_blocks(d, s, ["a"], [1])
    with pytest.raises(TypeError, match="dst_indices"):
        kvx.copy_blocks(d, s, [0], [object()])


def test_error_index_shapes(pools):
    d, s = pools
    with pytest.raises(ValueError, match="src_indices has length 2 but dst_indices has length 1"):
        kvx.copy_blocks(d, s, [0, 1], [1])
    with pytest.raises(ValueError, match="dst_indices has length 3"):
        jit_copy(d, s, np.array([0]), np.array([1, 2, 3]), np.array([0]))
    with pytest.raises(ValueError, match="src_indices must be 1-D"):
        kvx.copy_blocks(d, s, [[0, 1]], [1, 2])
    with pytest.raises(ValueError, match="dst_indices must be 1-D"):
        kvx.copy_blocks(d, s, [0], 1)


def test_error_num_tokens_wrong_length(pools):
    d, s = pools
    with pytest.raises(ValueError, match="num_tokens has length 3, expected 2"):
        kvx.copy_blocks(d, s, [0, 1], [1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="num_tokens has length 1"):
        jit_copy(d, s, np.array([0, 1]), np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="num_tokens must be 1-D"):
        kvx.copy_blocks(d, s, [0, 1], [1, 2], [[1, 2]])


@pytest.mark.parametrize("bad", [1.5, [1.0, 2.0], np.array([1.0, 2.0], np.float32),
                                 jnp.array(2.0), True, [True, False], np.float32(2)],
                         ids=["float", "list-float", "np-float", "jnp-float0d", "bool",
                              "list-bool", "np-float-scalar"])
def test_error_num_tokens_not_integer(pools, bad):
    d, s = pools
    with pytest.raises(TypeError, match="num_tokens"):
        kvx.copy_blocks(d, s, [0, 1], [1, 2], bad)


def test_error_partial_block_copy_num_tokens(pools):
    d, s = pools
    for bad in (1.5, True, [1], np.array([1]), jnp.array(2.0), "2", None):
        with pytest.raises(TypeError, match="num_tokens"):
            kvx.partial_block_copy(d[0], s[0], bad)


def test_error_concrete_index_out_of_range(pools):
    d, s = pools  # dst has 4 blocks, src 6
    with pytest.raises(IndexError, match="src_indices holds block index 6, but src_pool has 6"):
        kvx.copy_blocks(d, s, [0, 6], [1, 2])
    with pytest.raises(IndexError, match="dst_indices holds block index 4, but dst_pool has 4"):
        kvx.copy_blocks(d, s, [5, 0], [4, 1])
    with pytest.raises(IndexError, match="src_indices"):
        kvx.copy_blocks(d, s, np.array([2**40]), [1])
    with pytest.raises(IndexError, match="dst_indices"):
        kvx.copy_blocks(d, s, [0], jnp.array([100]))
    # concrete indices closed over inside jit are checked too
    with pytest.raises(IndexError, match="dst_indices"):
        jax.jit(lambda a, b: kvx.copy_blocks(a, b, [0], [9]))(d, s)
    # index 5 is valid for the 6-block source
    kvx.copy_blocks(d, s, [5], [3]).block_until_ready()


def test_error_deleted_pool(rng):
    dst, src = make_pools(rng, (4, 1, 2, 2, 4, 2), jnp.float32)
    d, s = put(dst), put(src)
    out = jit_copy_donated(d, s, np.array([0]), np.array([1]), np.array([0]))
    assert d.is_deleted()
    with pytest.raises(ValueError, match="dst_pool has been deleted"):
        kvx.copy_blocks(d, s, [0], [1])
    with pytest.raises(ValueError, match="src_pool has been deleted"):
        kvx.copy_blocks(out, d, [0], [1])
    blk = put(src[0])
    jax.jit(kvx.partial_block_copy, donate_argnums=0)(blk, s[0], np.int32(1))
    assert blk.is_deleted()
    with pytest.raises(ValueError, match="dst has been deleted"):
        kvx.partial_block_copy(blk, s[0], 1)
    with pytest.raises(ValueError, match="src has been deleted"):
        kvx.partial_block_copy(s[0], blk, 1)
    assert_unchanged(s, src, "src_pool")
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, [0], [1]))


def test_error_unpinned_host_memory(pools):
    d, s = pools
    try:
        unpinned = jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                     memory_kind="unpinned_host")
        du = jax.device_put(d, unpinned)
    except (ValueError, RuntimeError) as e:  # pragma: no cover - depends on the backend
        pytest.skip(f"no unpinned_host memory here: {e}")
    su = jax.device_put(s, unpinned)
    with pytest.raises(ValueError, match="dst_pool must live in memory kind"):
        kvx.copy_blocks(du, s, [0], [1])
    with pytest.raises(ValueError, match="src_pool must live in memory kind"):
        kvx.copy_blocks(d, su, [0], [1])
    with pytest.raises(ValueError, match="dst must live in memory kind"):
        kvx.partial_block_copy(jax.device_put(d[0], unpinned), s[0], 1)
    with pytest.raises(ValueError, match="src must live in memory kind"):
        kvx.partial_block_copy(d[0], jax.device_put(s[0], unpinned), 1)
    assert_unchanged(du, np.asarray(d), "unpinned dst")


def test_error_non_array_pool(pools):
    d, s = pools
    with pytest.raises(TypeError, match="dst_pool must be a jax.Array, got ndarray"):
        kvx.copy_blocks(np.asarray(d), s, [0], [1])
    with pytest.raises(TypeError, match="src_pool must be a jax.Array, got list"):
        kvx.copy_blocks(d, np.asarray(s).tolist(), [0], [1])
    with pytest.raises(TypeError, match="src must be a jax.Array"):
        kvx.partial_block_copy(d[0], np.asarray(s[0]), 1)


def test_error_unsupported_sub_byte_dtype(rng):
    if not hasattr(jnp, "int2"):
        pytest.skip("no int2 in this jax")
    d = put(np.zeros((2, 1, 1, 1, 2, 4), jnp.int2))
    with pytest.raises(TypeError, match="int2"):
        kvx.copy_blocks(d, d, [0], [1])


# ---------------------------------------------------------------------------------------------
# GPU only


@requires_gpu
def test_gpu_uses_the_cuda_handler(rng):
    assert kvx.HAS_CUDA_HANDLERS
    dst, src = make_pools(rng, (4, 1, 2, 2, 4, 8), jnp.float16)
    d, s = put(dst), put(src)
    assert d.devices().pop().platform == "gpu"
    args = (d, s, np.array([1, 2], np.int32), np.array([2, 3], np.int32),
            np.array([2, 0], np.int32))
    for fn in (jit_copy, jit_copy_donated):
        hlo = _compiled_text(fn, *args)
        assert 'custom_call_target="jax_kvxfer_block_copy"' in hlo
    out = jit_copy(*args)
    assert_bitwise_equal(out, reference_copy_blocks(dst, src, [1, 2], [2, 3], [2, 0]))


@requires_gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id, indirect=True)
def test_gpu_host_device_round_trip_is_exact(dtype, rng):
    """Offload device -> pinned_host and onboard pinned_host -> device, partial and whole."""
    shape = (6, 2, 2, 4, 8, 64)
    gpu_np, host_np = make_pools(rng, shape, dtype)
    gpu, host = put(gpu_np, "device"), put(host_np, "pinned_host")
    si, di, nt = [0, 3, 5, 1], [5, 0, 2, 5], [0, 3, 8, 5]
    offloaded = kvx.copy_blocks(host, gpu, si, di, nt)
    assert offloaded.sharding.memory_kind == "pinned_host"
    expected_host = reference_copy_blocks(host_np, gpu_np, si, di, nt)
    assert_bitwise_equal(offloaded, expected_host, "offload")
    onboarded = jit_copy_donated(gpu, offloaded, np.array(di, np.int32), np.array(si, np.int32),
                                 np.array(nt, np.int32))
    assert onboarded.sharding.memory_kind == "device"
    assert_bitwise_equal(onboarded, reference_copy_blocks(gpu_np, expected_host, di, si, nt),
                         "onboard")


@requires_gpu
def test_gpu_four_bit_is_packed():
    """The CUDA handler assumes 4-bit types are packed two per byte on the GPU."""
    assert jnp.zeros((4, 6), jnp.int4).on_device_size_in_bytes() == 12
    assert jnp.zeros((4, 6), jnp.uint4).on_device_size_in_bytes() == 12


@pytest.mark.parametrize("dst_kind", ["device", "pinned_host"])
def test_eager_copy_with_donate_updates_in_place(dst_kind, rng):
    dst_np = random_values(rng, (5, 2, 2, 1, 4, 2), jnp.float32)
    src_np = random_values(rng, (5, 2, 2, 1, 4, 2), jnp.float32)
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=dst_kind)
    dst = jax.device_put(dst_np, sharding)
    src = jax.device_put(src_np, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))
    out = kvx.copy_blocks(dst, src, [0, 3], [1, 4], [2, 0], donate=True)
    assert dst.is_deleted(), "donate=True consumes the destination"
    assert out.sharding.memory_kind == dst_kind
    assert_bitwise_equal(out, reference_copy_blocks(dst_np, src_np, [0, 3], [1, 4], [2, 0]))
    kept = jax.device_put(dst_np, sharding)
    kvx.copy_blocks(kept, src, [0], [1])  # the default is functional
    assert not kept.is_deleted()
    with pytest.raises(ValueError, match="donate=True needs src_pool"):
        kvx.copy_blocks(out, out, [0], [1], donate=True)


