"""The demo's model against a dense NumPy reference: a step of prefill chunks and decodes over
paged blocks gives the logits of whole-sequence causal attention, writes each token's K/V
where the block tables say and nothing else; and its operation count."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from jax_kvxfer.demo.model import ModelConfig, Rows, create_pool, forward, init_params, make_step

CONFIG = ModelConfig(vocab_size=97, num_layers=2, d_model=48, num_heads=4, num_kv_heads=2,
                     head_dim=12, d_ff=80, rope_theta=5000.0)
T = 4  # tokens per block


def _reference_logits(params: dict, tokens: list[int], config: ModelConfig) -> np.ndarray:
    """Next-token logits after every token of one sequence: dense causal attention in float64."""
    c = config
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n, group = len(tokens), c.num_heads // c.num_kv_heads

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * w

    def rope(x):  # x [n, heads, D], rotate-half form
        half = c.head_dim // 2
        angle = np.arange(n)[:, None] * c.rope_theta ** (-np.arange(half) / half)
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        return np.concatenate([x[..., :half] * cos - x[..., half:] * sin,
                               x[..., half:] * cos + x[..., :half] * sin], axis=-1)

    x = p["embed"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for layer in range(c.num_layers):
        h = norm(x, p["attn_norm"][layer])
        q = rope((h @ p["wq"][layer]).reshape(n, c.num_heads, c.head_dim))
        k = rope((h @ p["wk"][layer]).reshape(n, c.num_kv_heads, c.head_dim))
        v = (h @ p["wv"][layer]).reshape(n, c.num_kv_heads, c.head_dim)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(c.head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", probs, v).reshape(n, -1)
        x = x + attn @ p["wo"][layer]
        h = norm(x, p["mlp_norm"][layer])
        gate = h @ p["w1"][layer]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p["w3"][layer])) @ p["w2"][layer]
    return norm(x, p["final_norm"]) @ p["unembed"]


@pytest.mark.slow
def test_prefill_chunks_and_decodes_match_dense_attention():
    """Two sequences over scattered blocks: one prefills in chunks of 5 while the other decodes
    token by token, in the same steps; every returned logits row equals the reference's."""
    rng = np.random.default_rng(7)
    params = init_params(CONFIG, seed=3)
    pool = create_pool(CONFIG, tokens_per_block=T, num_primary_blocks=12, num_secondary_blocks=0)
    step = make_step(CONFIG, pool)
    long_seq = [int(t) for t in rng.integers(0, CONFIG.vocab_size, 17)]
    short = [int(t) for t in rng.integers(0, CONFIG.vocab_size, 9)]
    blocks = rng.permutation(12)
    tables = np.zeros((2, 6), np.int32)
    tables[0, :5], tables[1, :3] = blocks[:5], blocks[5:8]  # 17 and 9 tokens at 4 a block
    chunk, ref_long, ref_short = 5, _reference_logits(params, long_seq, CONFIG), \
        _reference_logits(params, short, CONFIG)

    # the short sequence's first 4 tokens as a prefill chunk on its own
    seg = Rows(np.array([short[:4] + [0]], np.int32), np.array([[0, 1, 2, 3, -1]], np.int32),
               tables[1:2], np.array([3], np.int32))
    (logits,), pool.primary = step(params, pool.primary, (seg,))
    np.testing.assert_allclose(logits[0], ref_short[3], rtol=2e-4, atol=2e-4)
    decoded = 4
    for start in range(0, len(long_seq), chunk):
        toks = long_seq[start:start + chunk]
        prefill = Rows(np.array([toks + [0] * (chunk - len(toks))], np.int32),
                       np.array([list(range(start, start + len(toks)))
                                 + [-1] * (chunk - len(toks))], np.int32),
                       tables[:1], np.array([len(toks) - 1], np.int32))
        decode = Rows(np.array([[short[decoded]], [0]], np.int32),
                      np.array([[decoded], [-1]], np.int32), tables[[1, 0]],
                      np.zeros(2, np.int32))  # its second row is padding
        (lp, ld), pool.primary = step(params, pool.primary, (prefill, decode))
        np.testing.assert_allclose(lp[0], ref_long[start + len(toks) - 1], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(ld[0], ref_short[decoded], rtol=2e-4, atol=2e-4)
        decoded += 1
    # K/V only where the tables say: the blocks no sequence holds are still zero
    unused = np.asarray(pool.primary)[blocks[8:]]
    assert not unused.any()


@pytest.mark.slow
def test_padding_writes_nothing():
    params = init_params(CONFIG, seed=1)
    pool = create_pool(CONFIG, tokens_per_block=T, num_primary_blocks=3, num_secondary_blocks=0)
    before = np.random.default_rng(0).standard_normal(pool.primary.shape).astype(np.float32)
    pool.primary = jax.device_put(before, pool.primary.sharding)
    seg = Rows(np.full((2, 3), 5, np.int32), np.full((2, 3), -1, np.int32),
               np.array([[0, 1], [2, 0]], np.int32), np.zeros(2, np.int32))
    _, new = forward(params, pool.primary, (seg,), config=CONFIG)
    np.testing.assert_array_equal(np.asarray(new), before)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_chunk_is_bit_for_bit_the_same_whatever_shares_its_step(dtype):
    """One request's prefill chunk alone, then beside one and two other requests' chunks (in
    either order) and a decode: its logits and K/V are equal bit for bit (on a GPU, XLA's dot
    merger would otherwise join the segments' products into one of another shape)."""
    # head_dim 16: on a GPU, bfloat16 prefill takes cuDNN's fused attention, which wants a
    # multiple of 8
    config = dataclasses.replace(CONFIG, dtype=dtype, d_model=64, head_dim=16)
    rng = np.random.default_rng(11)
    params = init_params(config, seed=5)
    pool = create_pool(config, tokens_per_block=T, num_primary_blocks=16, num_secondary_blocks=0)
    step = make_step(config, pool)
    chunk, width = 8, 4

    def prefill(first_block: int) -> Rows:
        table = np.zeros((1, width), np.int32)
        table[0, :chunk // T] = np.arange(first_block, first_block + chunk // T)
        return Rows(rng.integers(0, config.vocab_size, (1, chunk)).astype(np.int32),
                    np.arange(chunk, dtype=np.int32)[None], table,
                    np.array([chunk - 1], np.int32))

    mine, other, third = prefill(0), prefill(4), prefill(8)
    decode = Rows(np.array([[3]], np.int32), np.array([[0]], np.int32),
                  np.array([[12, 0, 0, 0]], np.int32), np.zeros(1, np.int32))
    results = []
    for segments, at in (((mine,), 0), ((other, mine, decode), 1),
                         ((mine, third, other, decode), 0)):
        pool.primary = jax.numpy.zeros_like(pool.primary)
        logits, pool.primary = step(params, pool.primary, segments)
        results.append((np.asarray(logits[at]), np.asarray(pool.primary[:chunk // T])))
    for logits, kv in results[1:]:
        np.testing.assert_array_equal(logits, results[0][0])
        np.testing.assert_array_equal(kv, results[0][1])


@pytest.mark.parametrize("context", [1, 100])
def test_token_flops_counts_the_weights_and_attention(context):
    c = CONFIG
    weights = (c.num_params - 2 * c.vocab_size * c.d_model - c.d_model
               - c.num_layers * 2 * c.d_model)  # less the embeddings and the norms
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * context
    assert c.token_flops(context) == 2 * weights + attention


def _random_rows(rng, lengths, chunk, width, num_blocks, t):
    """Rows of the given key counts (0: a padding row), each attending from its last `chunk`
    positions (fewer when it holds fewer), over scattered blocks of a pool of `num_blocks`."""
    r = len(lengths)
    positions = np.full((r, chunk), -1, np.int32)
    tables = rng.integers(0, num_blocks, (r, width)).astype(np.int32)  # junk past each row
    free = list(rng.permutation(num_blocks))
    for i, n in enumerate(lengths):
        held = -(-n // t)
        tables[i, :held] = [free.pop() for _ in range(held)]
        k = min(chunk, n)
        positions[i, :k] = np.arange(n - k, n)
    return tables, positions


def _full_width_attention(q, blocks, positions, valid):
    """The reference, in float64 NumPy: q `[R, C, Hkv, G, D]` over every key of each row's
    gathered blocks `[R, M, 2, Hkv, T, D]` up to the query's position (padding sees none)."""
    r, m, _, hkv, t, d = blocks.shape
    keys = blocks[:, :, 0].transpose(0, 2, 1, 3, 4).reshape(r, hkv, m * t, d).astype(np.float64)
    values = blocks[:, :, 1].transpose(0, 2, 1, 3, 4).reshape(r, hkv, m * t, d).astype(np.float64)
    scores = np.einsum("rckgd,rkjd->rkgcj", q.astype(np.float64), keys) / np.sqrt(d)
    seen = (np.arange(m * t)[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
    scores = np.where(seen[:, None, None], scores, -np.inf)
    scores -= np.max(scores, axis=-1, keepdims=True, where=seen[:, None, None], initial=-1e300)
    probs = np.where(seen[:, None, None], np.exp(scores), 0.0)
    probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-300)
    return np.einsum("rkgcj,rkjd->rckgd", probs, values)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 5])
def test_paged_attention_matches_full_width_attention(chunk):
    """Rows of very different lengths (and a padding row): the tiled attention equals the
    full-width gather's softmax, for decodes and for chunks."""
    from jax_kvxfer.demo.model import paged_attention

    rng = np.random.default_rng(0)
    t, width, nb, hkv, g, d = 4, 40, 128, 2, 3, 8
    pool = rng.standard_normal((nb, 2, 2, hkv, t, d)).astype(np.float32)
    lengths = [0, 1, 3, 37, 150, 160]
    tables, positions = _random_rows(rng, lengths, chunk, width, nb, t)
    valid = positions >= 0
    pos = np.maximum(positions, 0)
    q = rng.standard_normal((len(lengths), chunk, hkv, g, d)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST
    got = np.asarray(paged_attention(q, pool, 1, tables, pos, valid, tile_blocks=3,
                                     precision=hi))
    want = _full_width_attention(q, pool[tables, 1], pos, valid)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got).all()


@pytest.mark.slow
def test_masked_tiles_are_exact_no_ops():
    """A row's result is bit for bit the same whatever else shares the step: other blocks past
    its keys (tiles all masked for it), a longer row beside it (more trips), and its blocks in
    other slots of the pool. The shapes stay the same, so one compiled program runs every
    case: two programs may each pick other matmul kernels on a GPU, which round differently."""
    from jax_kvxfer.demo.model import paged_attention

    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    t, nb, hkv, g, d, tile, width = 4, 96, 2, 2, 16, 2, 21
    pool = rng.standard_normal((nb, 1, 2, hkv, t, d)).astype(np.float32)
    lengths = [0, 1, 9, 30, 0]  # the last row: padding, or every column's keys beside the others
    tables, positions = _random_rows(rng, lengths, 1, width, nb, t)
    valid, pos = positions >= 0, np.maximum(positions, 0)
    q = rng.standard_normal((len(lengths), 1, hkv, g, d)).astype(np.float32)
    step = jax.jit(functools.partial(paged_attention, layer=0, tile_blocks=tile))
    base = np.asarray(step(q, pool, block_tables=tables, positions=pos, valid=valid))[:-1]

    other_blocks = tables.copy()
    for i, n in enumerate(lengths):
        held = -(-n // t)
        other_blocks[i, held:] = rng.integers(0, nb, width - held)
    long_table, long_pos, long_valid = tables.copy(), pos.copy(), valid.copy()
    long_table[-1], long_pos[-1], long_valid[-1] = rng.permutation(nb)[:width], width * t - 1, True
    perm = rng.permutation(nb)  # block b moves to slot perm[b]
    moved = np.empty_like(pool)
    moved[perm] = pool
    for tab, p, v, pl in ((other_blocks, pos, valid, pool), (long_table, long_pos, long_valid, pool),
                          (perm[tables].astype(np.int32), pos, valid, moved)):
        out = np.asarray(step(q, pl, block_tables=tab, positions=p, valid=v))
        np.testing.assert_array_equal(out[:-1], base)


def test_budget_chunks_fill_whole_rows_in_order():
    from jax_kvxfer.demo.model import budget_chunks

    assert budget_chunks([20, 3, 9], rows=4, row_tokens=8) == [20, 3, 0]  # 3 rows + 1 row
    assert budget_chunks([5, 40], rows=4, row_tokens=8) == [5, 24]
    assert budget_chunks([100], rows=2, row_tokens=8) == [16]
    assert budget_chunks([], rows=2, row_tokens=8) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_prefill_segment_is_exact_whatever_row_or_company(dtype):
    """Token-budgeted prefill: one fixed `[rows, row_tokens]` segment packs several requests'
    chunks. A request's chunk gives the reference's logits, and the same logits and K/V bit for
    bit alone at row 0, after another request's rows, and split at other row boundaries."""
    from jax_kvxfer.demo.model import budget_chunks, pack_prefill

    # head_dim 16: on a GPU, bfloat16 prefill takes cuDNN's fused attention (a multiple of 8)
    config = dataclasses.replace(CONFIG, dtype=dtype, d_model=64, head_dim=16)
    rng = np.random.default_rng(5)
    params = init_params(config, seed=2)
    rows, row_tokens, width = 4, 4, 6
    step = make_step(config, create_pool(config, tokens_per_block=T, num_primary_blocks=24,
                                         num_secondary_blocks=0))
    mine = [int(x) for x in rng.integers(0, config.vocab_size, 10)]
    other = [int(x) for x in rng.integers(0, config.vocab_size, 7)]
    ref = _reference_logits(params, mine, config)
    results = []
    for lead, my_table, other_table, spans in (
            ([], [0, 1, 2], [9], ((0, 6), (6, 10))),
            ([6], [5, 3, 11], [7, 8], ((0, 6), (6, 10))),  # after the other's rows
            ([], [20, 21, 22], [4], ((0, 2), (2, 6), (6, 10)))):  # other row boundaries
        pool = create_pool(config, tokens_per_block=T, num_primary_blocks=24,
                           num_secondary_blocks=0)
        logits_mine = []
        for start, end in spans:
            chunks = [(other[:7], 0, other_table)] if lead and start == 0 else []
            taken = budget_chunks([7] * len(chunks) + [end - start], rows=rows,
                                  row_tokens=row_tokens)
            assert taken[-1] == end - start
            chunks.append((mine[start:end], start, my_table))
            seg, last = pack_prefill(chunks, rows=rows, row_tokens=row_tokens, max_blocks=width)
            (logits,), pool.primary = step(params, pool.primary, (seg,))
            if end in (6, 10):
                logits_mine.append(np.asarray(logits)[last[-1]])
        kv = np.asarray(pool.primary)[my_table]
        results.append((np.stack(logits_mine), kv))
        if dtype == "float32":
            np.testing.assert_allclose(logits_mine[0], ref[5], rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(logits_mine[1], ref[9], rtol=2e-4, atol=2e-4)
    for logits, kv in results[1:]:
        np.testing.assert_array_equal(logits, results[0][0])
        np.testing.assert_array_equal(kv, results[0][1])


@pytest.mark.parametrize("head_dim, fused", [(12, False), (16, True), (264, False)])
def test_fused_attention_is_picked_only_for_head_dims_cudnn_takes(head_dim, fused, monkeypatch):
    """On a GPU, a bfloat16 model takes cuDNN's fused attention only where cuDNN takes its head
    dimension (a multiple of 8, at most 256); others attend unfused, as on the CPU, instead of
    failing at the first step."""
    from jax_kvxfer.demo import model as model_module

    picked = []
    monkeypatch.setattr(model_module.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(model_module, "_jitted_step",
                        lambda config, sharding, fused_attention, *rest: picked.append(
                            fused_attention))
    make_step(dataclasses.replace(CONFIG, dtype="bfloat16", head_dim=head_dim))
    make_step(dataclasses.replace(CONFIG, dtype="float32", head_dim=head_dim))
    assert picked == [fused, False]


def _group_loops_after_their_waits(jaxpr) -> int:
    """The waits of a step (its jaxpr), checked to order its groups' loops over layers: each
    group's loop iterates over the layers its wait returned (so every read of the pool in it
    comes after the wait), and each wait after the previous group's loop (its operand comes
    out of a barrier with that loop's activations). Each loop's layer writes one scatter.
    Returns the waits."""
    eqns = jaxpr.jaxpr.eqns
    waits = [e for e in eqns if e.primitive.name == "ffi_call"
             and e.params["target_name"] == "jax_kvxfer_wait_layers"]
    loops = [e for e in eqns if e.primitive.name == "scan"]
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    for loop in loops:  # both segments' K/V: a scatter a segment made XLA count the pool twice
        assert [e.primitive.name for e in loop.params["jaxpr"].jaxpr.eqns].count("scatter") == 1
    if not waits:
        assert len(loops) == 1, loops  # one loop over every layer
        return 0
    assert len(loops) == len(waits)
    for k, (wait, loop) in enumerate(zip(waits, loops)):
        layers = loop.invars[len(loop.invars) - len(wait.outvars):]  # a scan's xs come last
        assert layers == wait.outvars, k
        barrier = next((b for b in barriers if wait.invars[0] in b.outvars), None)
        assert barrier is not None, k
        if k:
            assert set(loops[k - 1].outvars) & set(barrier.invars), k
    return len(waits)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_layer_groups_wait_per_group_and_compute_the_same(groups):
    """A step whose layers wait per group for their onboards (`layer_groups`) has one wait per
    group, each after the previous group's layers, and computes bit for bit what the step
    without waits does, on random weights, pool contents and rows. Its layers write the
    segments' K/V in one scatter."""
    config = dataclasses.replace(CONFIG, num_layers=6)
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    params = init_params(config, seed=int(rng.integers(1 << 20)))
    pool = create_pool(config, tokens_per_block=T, num_primary_blocks=8, num_secondary_blocks=0)
    contents = rng.standard_normal(pool.primary.shape).astype(np.float32)
    tables = rng.permutation(8)[:6].reshape(2, 3).astype(np.int32)
    prefill = Rows(rng.integers(0, config.vocab_size, (1, 5)).astype(np.int32),
                   np.array([[4, 5, 6, 7, 8]], np.int32), tables[:1], np.array([4], np.int32))
    decode = Rows(rng.integers(0, config.vocab_size, (2, 1)).astype(np.int32),
                  np.array([[6], [-1]], np.int32), tables[[1, 0]], np.zeros(2, np.int32))
    outs = []
    for layer_groups in (0, groups):
        step = jax.jit(functools.partial(forward, config=config, layer_groups=layer_groups),
                       donate_argnums=1)
        jaxpr = jax.make_jaxpr(functools.partial(forward, config=config,
                                                 layer_groups=layer_groups))(
            params, contents, (prefill, decode))
        assert _group_loops_after_their_waits(jaxpr) == layer_groups
        # the pool is updated in place: no copy of it anywhere in the compiled step (XLA
        # copied it at each wait where the waits took the pool and a group's loop was
        # flattened: one layer a group)
        compiled = step.lower(params, contents, (prefill, decode)).compile().as_text()
        pool_type = "f32[" + ",".join(map(str, contents.shape)) + "]"
        assert not re.findall(re.escape(pool_type) + r"\S* copy\(", compiled)
        logits, new = step(params, jax.device_put(contents, pool.primary.sharding),
                           (prefill, decode))
        outs.append([np.asarray(x) for x in logits] + [np.asarray(new)])
    for without, with_waits in zip(*outs):
        np.testing.assert_array_equal(with_waits, without)
    assert not np.array_equal(outs[0][-1], contents)  # the step wrote its tokens' K/V
    with pytest.raises(ValueError, match="at most half the 6 layers, got 4"):
        forward(params, contents, (prefill,), config=config, layer_groups=4)
