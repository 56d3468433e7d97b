"""What the demo keeps of a reply token's logits (model.token_record: argmax, the 32 largest
logits and their token ids, a fingerprint of the whole row) against an independent NumPy and
Python computation on fresh random rows; the fingerprint changing with any single logit's bits;
and serving.compare judging runs by those records."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_kvxfer.demo import serving
from jax_kvxfer.demo.model import (
    RECORD_KEPT,
    ModelConfig,
    Rows,
    create_pool,
    init_params,
    logits_fingerprint,
    make_step,
    pack_records,
    token_record,
    unpack_records,
)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
UINT = {2: np.uint16, 4: np.uint32}
M32 = 0xFFFFFFFF


def _fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _multiplier(i: int, salt: int) -> int:
    m31 = 0x7FFFFFFF
    x = (i ^ salt) & m31
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & m31
    x ^= x >> 12
    x = (x * 0x297A2D39) & m31
    x ^= x >> 15
    return 2 * x + 1


def _reference_fingerprint(row: np.ndarray) -> tuple[int, int]:
    """The fingerprint's definition in Python integers, one value at a time."""
    words = [int(b) for b in row.view(UINT[row.dtype.itemsize])]
    first = sum(b * _multiplier(i, 1) for i, b in enumerate(words)) & M32
    second = sum(_fmix32(b) * _multiplier(i, 2) for i, b in enumerate(words)) & M32
    return first, second


def _reference_record(rows: np.ndarray, k: int):
    """argmax, top-k (largest first; equal values lowest id first) and the fingerprints."""
    wide = rows.astype(np.float64)
    order = np.argsort(-wide, axis=1, kind="stable")[:, :k]
    return (np.argmax(wide, axis=1), np.take_along_axis(rows, order, axis=1), order,
            np.array([_reference_fingerprint(r) for r in rows], np.uint32))


def _random_rows(rng, shape, dtype) -> np.ndarray:
    rows = (rng.standard_normal(shape) * 4).astype(DTYPES[dtype])
    # ties among the largest: a few copies of each row's maximum, and of another top value
    top = np.sort(rows.astype(np.float32), axis=1)[:, -5]
    for r in range(shape[0]):
        rows[r, rng.choice(shape[1], 3, replace=False)] = rows[r].max()
        rows[r, rng.choice(shape[1], 2, replace=False)] = top[r]
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("vocab", [20, 1000])
def test_the_record_matches_numpy(dtype, vocab):
    rng, seed = _fresh_rng()
    rows = _random_rows(rng, (6, vocab), dtype)
    got = jax.jit(token_record, static_argnums=1)(jnp.asarray(rows.astype(np.float32)), dtype)
    tokens, top, ids, prints = _reference_record(rows, min(RECORD_KEPT, vocab))
    assert got.top_logits.dtype == DTYPES[dtype] and got.top_logits.shape == top.shape
    np.testing.assert_array_equal(np.asarray(got.tokens), tokens, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(got.top_logits), top, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(got.top_logit_tokens), ids, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(got.fingerprints), prints, err_msg=f"seed {seed}")


def _single_changes(rng, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(base rows, changed rows): for every position of `row`, a copy with that one value's
    bits changed: by one bit (a random one), to another random value, -0.0 against 0.0, and
    a NaN's payload against another's."""
    uint = UINT[row.dtype.itemsize]
    nbits = 8 * row.dtype.itemsize
    exponent = {2: 0x7C00 if row.dtype == np.float16 else 0x7F80, 4: 0x7F800000}[
        row.dtype.itemsize]
    n = row.size
    base = np.tile(row, (4 * n, 1))
    changed = base.copy()
    bits, changed_bits = base.view(uint), changed.view(uint)
    at = np.arange(n)
    flip = rng.integers(0, nbits, n).astype(uint)
    changed_bits[at, at] ^= uint(1) << flip
    other = _random_rows(rng, (1, n), _dtype_name(row.dtype))[0]
    same = other == row
    other[same] += 1  # a value of other bits everywhere
    changed[n + at, at] = other
    bits[2 * n + at, at], changed_bits[2 * n + at, at] = 0, uint(1) << (nbits - 1)  # 0.0, -0.0
    quiet = exponent | (exponent >> 1 & ~exponent)  # the exponent all ones, the quiet bit set
    bits[3 * n + at, at] = quiet | 1
    changed_bits[3 * n + at, at] = quiet | 2
    return base, changed


def _dtype_name(dtype) -> str:
    return next(name for name, d in DTYPES.items() if np.dtype(d) == dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_any_single_changed_logit_changes_both_sums(dtype):
    rng, seed = _fresh_rng()
    row = _random_rows(rng, (1, 300), dtype)[0]
    base, changed = _single_changes(rng, row)
    assert np.all(np.any(base.view(UINT[row.dtype.itemsize])
                         != changed.view(UINT[row.dtype.itemsize]), axis=1))
    fingerprint = jax.jit(logits_fingerprint)
    # the device holds the bits as given (NaN payloads and zeros' signs included)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(changed)).view(np.uint8),
                                  changed.view(np.uint8))
    got_base, got_changed = np.asarray(fingerprint(base)), np.asarray(fingerprint(changed))
    n = row.size  # the first 2n base rows are copies of `row`: the same sums
    assert np.all(got_base[:2 * n] == got_base[:1]), f"seed {seed}"
    assert np.all(got_base != got_changed), f"seed {seed}: a change left a sum unchanged"
    # and the special values' sums are the definition's (a sample of rows, in Python ints)
    for r in rng.choice(len(changed), 8, replace=False).tolist() + [2 * n, 3 * n]:
        assert tuple(got_changed[r]) == _reference_fingerprint(changed[r]), (seed, r)
        assert tuple(got_base[r]) == _reference_fingerprint(base[r]), (seed, r)


@pytest.mark.slow
def test_the_greedy_step_records_forwards_logits():
    """make_step(greedy=True)'s records are token_record of forward's logits, rounded to the
    model's dtype, every segment's rows in one array."""
    config = ModelConfig(vocab_size=97, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                         head_dim=16, d_ff=64, dtype="bfloat16")
    params = init_params(config, seed=3)
    rng, seed = _fresh_rng()
    seg = Rows(rng.integers(0, config.vocab_size, (2, 4)).astype(np.int32),
               np.tile(np.arange(4, dtype=np.int32), (2, 1)), np.array([[0], [1]], np.int32),
               np.array([3, 2], np.int32))

    def pool():
        return create_pool(config, tokens_per_block=4, num_primary_blocks=2,
                           num_secondary_blocks=0).primary

    packed, _ = make_step(config, greedy=True)(params, pool(), (seg, seg))
    (logits,), _ = make_step(config)(params, pool(), (seg,))  # forward, jitted
    want = _reference_record(np.asarray(logits).astype(ml_dtypes.bfloat16), RECORD_KEPT)
    record = unpack_records(np.asarray(packed), config.dtype)
    assert record.top_logits.dtype == ml_dtypes.bfloat16
    for got, expected in zip(record, want):  # both segments' rows, in order
        np.testing.assert_array_equal(got, np.concatenate([expected] * 2), err_msg=f"{seed}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_records_unpack_to_the_records(dtype):
    """Records of two segments in one uint32 array, one copy to the host, and back."""
    rng, seed = _fresh_rng()
    records = [token_record(jnp.asarray(_random_rows(rng, (n, 300), dtype).astype(np.float32)),
                            dtype) for n in (3, 5)]
    got = unpack_records(np.asarray(jax.jit(pack_records)(records)), dtype)
    for field, values in zip(got._fields, got):
        want = np.concatenate([np.asarray(getattr(r, field)) for r in records])
        assert values.dtype == want.dtype, field
        np.testing.assert_array_equal(values, want, err_msg=f"{field} seed {seed}")


def _run(turns: dict, reused: dict | None = None) -> serving.RunResult:
    """A run of these turns, key -> (reply tokens, logits rows [n, vocab]), their records
    made by token_record in the rows' dtype; `reused`: key -> prompt tokens (of 4) found on
    the GPU, none by default."""
    from jax_kvxfer.cache import BlockManagerStats
    from jax_kvxfer.transfer.manager import TransferStats

    out = {}
    for key, (tokens, rows) in turns.items():
        record = token_record(jnp.asarray(rows), rows.dtype)
        out[key] = serving.TurnResult(0.0, 0.1, 0.2, 4, (reused or {}).get(key, 0), 0, 0, tokens,
                                      *(np.asarray(x) for x in record[1:]), key=key)
    return serving.RunResult(out, BlockManagerStats(), TransferStats(), 1, 1.0, 0.0, 1, 0)


@pytest.fixture
def logits():
    rng, seed = _fresh_rng()
    return {(c, t): rng.standard_normal((3, 500)).astype(np.float32)
            for c in range(2) for t in range(2)}, rng, seed


def _tokens(rows: np.ndarray) -> list[int]:
    return np.argmax(rows, axis=1).tolist()


def test_compare_passes_identical_runs(logits):
    turns, _, _ = logits
    ref = _run({k: (_tokens(x), x) for k, x in turns.items()})
    again = _run({k: (_tokens(x), x.copy()) for k, x in turns.items()})
    assert serving.compare(again, ref) == (True, 0.0, None, 0, 0)


def test_compare_finds_a_single_changed_logit_anywhere_by_its_fingerprint(logits):
    """One logit of one row changed: outside the row's largest (where no tolerance sees it),
    counted as a row whose bits differ and within tolerance; the largest, by less than
    the tolerance: the same, its difference reported; by more: not exact, that turn the first
    bad one."""
    turns, rng, seed = logits
    ref = _run({k: (_tokens(x), x) for k, x in turns.items()})
    key = (1, 0)
    row = int(rng.integers(3))
    order = np.argsort(-turns[key][row])
    cases = [(p, d, True) for p in rng.choice(order[70:], 5, replace=False)
             for d in (-1.0, 1e-3)] + [(order[0], 1e-5, True), (order[0], 1e-2, False)]
    for position, delta, exact in cases:
        changed = {k: x.copy() for k, x in turns.items()}
        changed[key][row, position] += np.float32(delta)
        moved = abs(float(changed[key][row, position]) - float(turns[key][row, position]))
        assert moved > 0 and _tokens(changed[key]) == _tokens(turns[key])
        got = serving.compare(_run({k: (_tokens(x), x) for k, x in changed.items()}), ref)
        assert got.rows_bits_differ == 1, (seed, position)
        assert got.exact is exact and got.first_bad == (None if exact else key), (seed, position)
        assert got.max_diff == (moved if position == order[0] else 0.0), (seed, position)


def test_compare_matches_the_largest_by_token_id(logits):
    """Near-ties a rounding apart swap places, among the 32 largest and across the 32nd place
    (float32 runs do): compared by token id, within tolerance. A token among the 32 largest
    of one run that the other did not keep among its 64: "top-K differ", not exact."""
    turns, _, seed = logits
    for places, exact in (((3, 4), True), ((31, 32), True), ((1, 100), False)):
        base = {k: x.copy() for k, x in turns.items()}
        order = np.argsort(-base[(0, 1)][2])
        hi, lo = order[list(places)]
        if exact:  # the reference: a near-tie, `lo` just below `hi`
            base[(0, 1)][2, lo] = base[(0, 1)][2, hi] - np.float32(4e-6)
        ref = _run({k: (_tokens(x), x) for k, x in base.items()})
        changed = {k: x.copy() for k, x in base.items()}
        rows = changed[(0, 1)]
        # the run: `lo` just above `hi`, or from far below to between the first and `hi`
        rows[2, lo] = rows[2, hi] + np.float32(4e-6) if exact else (rows[2, hi]
                                                                   + rows[2, order[0]]) / 2
        moved = abs(float(rows[2, lo]) - float(base[(0, 1)][2, lo]))
        assert np.argsort(-rows[2])[places[0]] == lo  # it moved up past `hi`
        got = serving.compare(_run({k: (_tokens(x), x) for k, x in changed.items()}), ref)
        assert got.rows_bits_differ == 1, (seed, places)
        if exact:
            assert got == (True, moved, None, 1, 0), (seed, places, moved)
        else:
            assert got == (False, np.inf, (0, 1), 1, 0), (seed, places)


def test_compare_accepts_float32_rows_within_tolerance(logits):
    """Every logit rounded differently (the CPU's float32 runs differ by ~1e-6): every row's
    bits differ, the 32 largest decide; the same beyond tolerance fails."""
    turns, _, seed = logits
    ref = _run({k: (_tokens(x), x) for k, x in turns.items()})
    for scale, exact in ((1 + 3e-6, True), (1 + 3e-3, False)):
        # a monotonic change: the same order, so the same top-32 token ids
        changed = {k: (x * np.float32(scale)).astype(np.float32) for k, x in turns.items()}
        got = serving.compare(_run({k: (_tokens(x), x) for k, x in changed.items()}), ref,
                              atol=1e-4, rtol=1e-4)
        top = max(float(np.abs(np.sort(x, axis=1)[:, -32:]).max()) for x in turns.values())
        assert got.rows_bits_differ == 12 and got.exact is exact, seed
        assert got.first_bad == (None if exact else (0, 0)), seed
        assert got.max_diff == pytest.approx(top * (scale - 1), rel=0.05), seed


def test_compare_fails_other_tokens_and_missing_turns(logits):
    turns, _, _ = logits
    ref = _run({k: (_tokens(x), x) for k, x in turns.items()})
    other = {k: (_tokens(x), x) for k, x in turns.items()}
    tokens, rows = other[(1, 1)]
    other[(1, 1)] = ([tokens[0], tokens[1] + 1, tokens[2]], rows)
    assert serving.compare(_run(other), ref) == (False, 0.0, (1, 1), 0, 0)
    del other[(1, 1)]
    assert not serving.compare(_run(other), ref).exact
    assert not serving.compare(ref, _run(other)).exact  # a turn more than the reference


def test_compare_excuses_a_recompute_rounding_apart_where_a_turn_recomputed(logits):
    """A turn that computed more of its prompt than the reference did carries a recompute's
    bits (a GPU rounds them apart), and so does every later turn of its chat: where they
    differ as a recompute does (the largest logits near, a near-tie's token flipped and the
    reply on from there its own), counted, not failed. Logits far apart (K/V read wrong) fail
    all the same, and so does any difference of a turn that reused as much as the reference."""
    turns, rng, seed = logits
    tie = turns[(1, 1)][1]  # row 1 of chat 1's second turn: its two largest a near-tie
    first, second = np.argsort(-tie)[:2]
    tie[second] = tie[first] - np.float32(0.01)
    reused = {(1, 0): 2, (1, 1): 3, (0, 1): 2}
    ref = _run({k: (_tokens(x), x) for k, x in turns.items()}, reused)
    near = {k: (x + rng.uniform(-0.05, 0.05, x.shape)).astype(np.float32) if k[0] == 1 else x
            for k, x in turns.items()}
    flipped = near[(1, 1)]  # the near-tie decided the other way, row 2 another reply's
    flipped[1] = tie
    flipped[1, second] = flipped[1, first] + np.float32(0.01)
    flipped[2] = rng.standard_normal(flipped.shape[1]).astype(np.float32)
    near = {k: (_tokens(x), x) for k, x in near.items()}
    assert near[(1, 1)][0][1] != _tokens(turns[(1, 1)])[1]
    far = {k: (_tokens(x), x) for k, x in turns.items()}
    far[(1, 0)] = (far[(1, 0)][0], rng.standard_normal(turns[(1, 0)].shape).astype(np.float32))
    recompute_first = {(1, 0): 1, (1, 1): 3, (0, 1): 2}  # chat 1 computed more in its first turn
    assert serving.compare(_run(near, recompute_first), ref) == (True, 0.0, None, 0, 2), seed
    got = serving.compare(_run(far, recompute_first), ref)
    assert (got.exact, got.first_bad) == (False, (1, 0)), seed
    got = serving.compare(_run(near, {(1, 0): 2, (1, 1): 0, (0, 1): 2}), ref)
    assert (got.exact, got.first_bad, got.recomputed_turns_differ) == (False, (1, 0), 1), seed
    # reusing more than the reference is no excuse: judged, and (1, 0) differs
    got = serving.compare(_run(near, {(1, 0): 4, (1, 1): 4, (0, 1): 2}), ref)
    assert (got.exact, got.first_bad, got.recomputed_turns_differ) == (False, (1, 0), 0), seed
    # recomputed turns that agree are judged as any: nothing excused
    same = {k: (_tokens(x), x.copy()) for k, x in turns.items()}
    assert serving.compare(_run(same, {(1, 0): 0, (1, 1): 0}), ref) == (True, 0.0, None, 0, 0)
