"""A decoder-only transformer (the Llama architecture) in plain JAX over paged KV blocks.

Random seeded weights, grouped-query attention, RoPE, RMSNorm and a SwiGLU MLP. The KV cache
is the primary array of one `KVCacheBlockPool` holding every layer, `[num_blocks, num_layers, 2,
num_kv_heads, tokens_per_block, head_dim]`; each step writes the new tokens' K/V into the blocks
named by the block tables and attends over them tile by tile (`paged_attention`: a fixed number
of blocks a tile, an online softmax, and only as many tiles as the longest row of the segment
holds, so a step's attention follows what its rows hold, not the table's width; plain XLA, with
cuDNN's fused attention for prefill chunks on a GPU; no kernel of ours).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..transfer.manager import layer_group_bounds, wait_for_layers
from ..transfer.pool import KVCacheBlockPool

# float32 models multiply at full precision (no TF32 on GPUs: the exactness check compares
# logits at 1e-4); bfloat16 ones at the default, as inference does.
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model geometry."""

    vocab_size: int = 512
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
                     "head_dim", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    @property
    def num_params(self) -> int:
        d, f, h = self.d_model, self.d_ff, self.head_dim
        per_layer = (2 * d + d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2
                     + 3 * d * f)
        return 2 * self.vocab_size * d + d + self.num_layers * per_layer

    @property
    def weights_nbytes(self) -> int:
        """The weights' bytes in the model's dtype (what `init_params` puts on a device)."""
        return self.num_params * jnp.dtype(self.dtype).itemsize

    def token_flops(self, context: int) -> int:
        """The matrix products' floating-point operations to compute one token that attends to
        `context` tokens (itself included), without the unembedding."""
        d, f, h = self.d_model, self.d_ff, self.head_dim
        weights = d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2 + 3 * d * f
        return self.num_layers * (2 * weights + 4 * self.num_heads * h * context)


def init_params(config: ModelConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Random weights (normal, scaled by 1/sqrt(fan_in)), layers stacked on a leading axis."""
    c = config
    shapes = {
        "embed": (c.vocab_size, c.d_model),
        "wq": (c.num_layers, c.d_model, c.num_heads * c.head_dim),
        "wk": (c.num_layers, c.d_model, c.num_kv_heads * c.head_dim),
        "wv": (c.num_layers, c.d_model, c.num_kv_heads * c.head_dim),
        "wo": (c.num_layers, c.num_heads * c.head_dim, c.d_model),
        "w1": (c.num_layers, c.d_model, c.d_ff),
        "w3": (c.num_layers, c.d_model, c.d_ff),
        "w2": (c.num_layers, c.d_ff, c.d_model),
        "unembed": (c.d_model, c.vocab_size),
    }
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    params = {}
    for key, (name, shape) in zip(keys, shapes.items()):
        scale = 1.0 if name == "embed" else 1.0 / np.sqrt(shape[-2])
        params[name] = (jax.random.normal(key, shape, jnp.float32) * scale).astype(c.dtype)
    params["attn_norm"] = jnp.ones((c.num_layers, c.d_model), c.dtype)
    params["mlp_norm"] = jnp.ones((c.num_layers, c.d_model), c.dtype)
    params["final_norm"] = jnp.ones((c.d_model,), c.dtype)
    return params


TP_AXIS = "tp"  # the mesh axis that splits KV heads in a tensor-parallel run


def kv_block_nbytes(config: ModelConfig, tokens_per_block: int) -> int:
    """Bytes of one block of `create_pool`'s pools: every layer's K and V of `tokens_per_block`
    tokens (`[num_layers, 2, num_kv_heads, tokens_per_block, head_dim]`)."""
    return (config.num_layers * 2 * config.num_kv_heads * tokens_per_block * config.head_dim
            * jnp.dtype(config.dtype).itemsize)


def create_pool(config: ModelConfig, *, tokens_per_block: int, num_primary_blocks: int,
                num_secondary_blocks: int, mesh: jax.sharding.Mesh | None = None
                ) -> KVCacheBlockPool:
    """A pool holding every layer's K and V for this model; with a mesh, split by KV heads."""
    return KVCacheBlockPool.create(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        size_per_head=config.head_dim, tokens_per_block=tokens_per_block, dtype=config.dtype,
        num_primary_blocks=num_primary_blocks, num_secondary_blocks=num_secondary_blocks,
        mesh=mesh, kv_head_axis=TP_AXIS if mesh is not None else None)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x `[B, C, heads, D]` at `positions` `[B, C]` (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half, dtype=np.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [B, C, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Rows(NamedTuple):
    """One segment of a step: `R` sequences, `C` tokens each (a prefill chunk; C = 1 to decode).

    tokens: `[R, C]` token ids.
    positions: `[R, C]` their positions in their sequences; -1 marks padding (not written,
      output ignored).
    block_tables: `[R, max_blocks]` primary block indices of each sequence in token order;
      entries past a sequence's blocks may be any valid index (they are masked).
    logit_index: `[R]` the column whose next-token logits to return (the last prompt token of
      a prefill chunk; 0 to decode).
    """

    tokens: Any
    positions: Any
    block_tables: Any
    logit_index: Any


def budget_chunks(remaining: list[int], *, rows: int, row_tokens: int,
                  starts: list[int] | None = None) -> list[int]:
    """Token-budgeted chunked prefill: how many prompt tokens each request (in order, with
    `remaining` tokens still to compute) computes in a step whose prefill segment holds `rows`
    rows of `row_tokens` tokens. Each takes what is left of the budget in whole rows, up to its
    remaining tokens (its last row partly filled only where its prompt ends); 0 once the
    budget is spent.

    With `starts` (each request's next prompt position), rows are aligned to absolute
    positions, as `pack_prefill(aligned=True)` lays them out: a row holds positions
    `[k * row_tokens, (k + 1) * row_tokens)` of one request, so a request whose next position
    is not a multiple of `row_tokens` fills its first row from there to the next multiple."""
    out, free = [], rows
    for i, n in enumerate(remaining):
        lead = 0 if starts is None else starts[i] % row_tokens
        take = max(0, min(n, free * row_tokens - lead))
        out.append(take)
        if take:
            free -= -(-(lead + take) // row_tokens)
    return out


def pack_prefill(chunks: list[tuple[list[int], int, Any]], *, rows: int, row_tokens: int,
                 max_blocks: int, aligned: bool = False) -> tuple[Rows, list[int]]:
    """One prefill segment `[rows, row_tokens]` of several requests' chunks (tokens, first
    position, block table), each split over consecutive rows (as `budget_chunks` sized them),
    the rest padding; and for each chunk the row whose logits are its last token's. The
    segment has one shape in every step, and each of its rows attends over its own table, so
    a token's K/V and logits do not depend on which row or beside which requests it ran.

    `aligned`: rows cut at absolute multiples of `row_tokens`, the token at position p in
    column `p % row_tokens` (a chunk that starts mid-row leaves that row's first columns
    padding), so that where each prompt token sits in a row, and which tokens share its row,
    depend on the prompt alone, not on where a cache hit ended or what else the step holds
    (the serving loop's layout: `budget_chunks(starts=...)` sizes it)."""
    tok = np.zeros((rows, row_tokens), np.int32)
    pos = np.full((rows, row_tokens), -1, np.int32)
    tables = np.zeros((rows, max_blocks), np.int32)
    last = np.zeros(rows, np.int32)
    at, last_rows = 0, []
    for toks, start, table in chunks:
        if not len(toks):
            raise ValueError("a chunk of no tokens")
        lead = start % row_tokens if aligned else 0
        i = 0
        while i < len(toks):
            if at == rows:
                raise ValueError(f"the chunks take more than the segment's {rows} rows of "
                                 f"{row_tokens} tokens")
            col = (lead + i) % row_tokens
            piece = toks[i:i + row_tokens - col]
            tok[at, col:col + len(piece)] = piece
            pos[at, col:col + len(piece)] = np.arange(start + i, start + i + len(piece))
            tables[at, :len(table)] = table
            last[at] = col + len(piece) - 1
            at += 1
            i += len(piece)
        last_rows.append(at - 1)
    return Rows(tok, pos, tables, last), last_rows


_LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w3", "w2")


def forward(params: dict[str, jax.Array], kv_pool: jax.Array, segments: tuple[Rows, ...], *,
            config: ModelConfig, fused_attention: bool = False, attention_tile: int | None = None,
            full_width: bool = False, layer_groups: int = 0
            ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """One step over several segments: writes their tokens' K/V into `kv_pool`; returns one
    logits row per sequence of each segment.

    The serving loop gives all decodes one segment `[D, 1]` and its prefill chunks either one
    token-budgeted segment `[rows, C]` packed across requests (`pack_prefill`, aligned) or, with
    no budget, one segment `[1, C]` per prefilling request. Each kind of segment has one shape
    in every step and weights of its own (`_unshared`), so a token's K/V are bit for bit the
    same whichever step computed it.

    Args:
      params: from `init_params`.
      kv_pool: the primary pool array `[num_blocks, num_layers, 2, num_kv_heads,
        tokens_per_block, head_dim]`.
      segments: `Rows` of sequences that are not in any other segment of this step.
      fused_attention: prefill chunks attend with cuDNN's fused attention (bfloat16 on an
        NVIDIA GPU) over the table's full width; otherwise, and for decodes, with
        `paged_attention` (plain XLA, tile by tile).
      attention_tile: tokens a key tile of `paged_attention` holds at least (whole blocks);
        None: `default_attention_tile()`. Runs that must agree bit for bit use the same.
      full_width: attend by gathering the table's full width for every row instead (the model
        before tiling; a baseline for `scripts/model_bench.py`).
      layer_groups: 0, or the layers in this many groups, each waiting for its own layers'
        onboards (`_over_layers`). The arithmetic is the same either way.

    Returns:
      `(one logits array [R, vocab_size] float32 per segment, new kv_pool)`.
    """
    c = config
    precision = _HIGHEST if jnp.dtype(c.dtype) == jnp.float32 else None
    t = kv_pool.shape[4]
    tile_blocks = attention_tile_blocks(attention_tile, t)

    def dot(x, w):
        return jnp.einsum("bcd,de->bce", x, w, precision=precision)

    placed = [_where_written(seg, kv_pool.shape[0], t) for seg in segments]
    # Every segment's K/V in one scatter a layer (they write distinct slots): with one a
    # segment, XLA's memory estimate counts the pool twice, which past the device's memory (a
    # 48 GiB pool on an H200) makes it compile another step (scripts/gpu-compile-check.sh).
    dst = jnp.concatenate([blocks for blocks, _, _, _ in placed])
    offset = jnp.concatenate([offsets for _, offsets, _, _ in placed])

    def layer(carry, index):
        pool, xs = carry
        weights = {name: params[name][index] for name in _LAYER_PARAMS}
        # Each segment gets the weights through a barrier of its own: XLA's dot merger would
        # otherwise join the segments' products with one weight into one matrix product whose
        # shape, and so whose rounding, depends on what else is in the step.
        per_segment = [_unshared(x, weights) for x in xs]
        queries, kvs = zip(*(_queries_and_kv(x, p, pos, c, dot)
                             for (x, p), (*_, pos) in zip(per_segment, placed)))
        kv = jnp.concatenate(kvs).astype(pool.dtype)
        pool = pool.at[dst, index, :, :, offset, :].set(kv, mode="drop")
        out = []
        for (x, p), q, seg, (_, _, valid, pos) in zip(per_segment, queries, segments, placed):
            b, chunk = x.shape[:2]
            how = "fused" if fused_attention and chunk > 1 else "full" if full_width else "paged"
            attn = _attention(how, q, pool, index, seg.block_tables, pos, valid,
                              tile_blocks=tile_blocks, precision=precision)
            x = x + dot(attn.reshape(b, chunk, c.num_heads * c.head_dim).astype(x.dtype), p["wo"])
            h = _rms_norm(x, p["mlp_norm"], c.norm_eps)
            out.append(x + dot(jax.nn.silu(dot(h, p["w1"])) * dot(h, p["w3"]), p["w2"]))
        return (pool, tuple(out)), None

    xs = tuple(params["embed"][seg.tokens] for seg in segments)
    kv_pool, xs = _over_layers(layer, (kv_pool, xs), c.num_layers, layer_groups)
    logits = []
    for x, seg in zip(xs, segments):
        x = jnp.take_along_axis(x, seg.logit_index[:, None, None], axis=1)  # [R, 1, d_model]
        x, head = _unshared(x, {"norm": params["final_norm"], "unembed": params["unembed"]})
        y = dot(_rms_norm(x, head["norm"], c.norm_eps), head["unembed"])[:, 0]
        logits.append(y.astype(jnp.float32))
    return tuple(logits), kv_pool


def _queries_and_kv(x: jax.Array, p: dict, positions: jax.Array, c: ModelConfig,
                    dot: Any) -> tuple[jax.Array, jax.Array]:
    """A segment's queries `[R, C, kv heads, heads a kv head serves, head_dim]` and its
    tokens' K/V `[R * C, 2, kv heads, head_dim]`, both rotated to their positions."""
    b, chunk = x.shape[:2]
    h = _rms_norm(x, p["attn_norm"], c.norm_eps)
    q = dot(h, p["wq"]).reshape(b, chunk, c.num_heads, c.head_dim)
    k = dot(h, p["wk"]).reshape(b, chunk, c.num_kv_heads, c.head_dim)
    v = dot(h, p["wv"]).reshape(b, chunk, c.num_kv_heads, c.head_dim)
    q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
    kv = jnp.stack([k, v], axis=2).reshape(b * chunk, 2, c.num_kv_heads, c.head_dim)
    group = c.num_heads // c.num_kv_heads
    return q.reshape(b, chunk, c.num_kv_heads, group, c.head_dim), kv


def max_layer_groups(num_layers: int) -> int:
    """The most groups a step's `num_layers` layers may wait in (`forward`'s `layer_groups`):
    a group holds 2 layers or more. XLA flattens a loop of one layer, and its memory estimate
    then counts the pool three times: 144 GiB for a 48 GiB pool on an H200, where it compiles
    another program for the step (scripts/gpu-compile-check.sh)."""
    return num_layers // 2


def _over_layers(layer: Any, carry: tuple, num_layers: int, layer_groups: int) -> tuple:
    """`layer(carry, index)` over the layers as a scan, one layer to compile (seconds, where
    32 unrolled layers take a minute on a GPU), each layer's weights sliced out of the whole
    stack inside it (a group's part of the stack, sliced first, would be copied). With
    `layer_groups` (at most `max_layer_groups`), a scan per group, each after a wait for its
    layers' onboards (`wait_for_layers`: the step after a `sync_transfers(block=False,
    layer_wise=True)`), so that the first groups compute while the later ones still arrive.

    The wait is given the group's layer indices, not the pool: every read and write of the
    pool in the group indexes it by a layer taken from the wait's result, so none can run
    before it, and an optimization barrier with the previous group's activations keeps the
    wait after that group's layers. Passed through the wait, the pool itself would be counted
    three times by XLA's memory estimate (144 GiB for a 48 GiB pool on an H200, where it
    compiles another program for the step; docs/performance.md)."""
    groups = max(layer_groups, 1)
    if layer_groups > max_layer_groups(num_layers):
        raise ValueError(f"layer_groups must be at most half the {num_layers} layers, got "
                         f"{layer_groups}")
    for g in range(groups):
        lo, hi = layer_group_bounds(g, groups, num_layers)
        layers = jnp.arange(lo, hi)
        if layer_groups:
            pool, xs = carry
            layers, xs = jax.lax.optimization_barrier((layers, xs))
            carry = (pool, xs)
            layers = wait_for_layers(layers, hi)
        carry, _ = jax.lax.scan(layer, carry, layers)
    return carry


def _attention(how: str, q: jax.Array, pool: jax.Array, layer: jax.Array,
               block_tables: jax.Array, pos: jax.Array, valid: jax.Array, *, tile_blocks: int,
               precision: Any) -> jax.Array:
    """`q`'s attention over its rows' blocks of `layer`, `how`: "fused" (cuDNN, the table's
    full width), "full" (plain XLA, the full width gathered) or "paged" (tile by tile)."""
    if how == "paged":
        return paged_attention(q, pool, layer, block_tables, pos, valid,
                               tile_blocks=tile_blocks, precision=precision)
    blocks = pool[block_tables, layer]
    mask = _mask(pos, valid, block_tables.shape[1] * pool.shape[4])
    return _attend_fused(q, blocks, mask) if how == "fused" else _attend(q, blocks, mask,
                                                                          precision)


def _where_written(seg: Rows, num_blocks: int, t: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(destination block, offset) of each of `seg`'s tokens in a pool of `num_blocks` blocks
    of `t` tokens, which tokens are real (not padding) and the positions with padding at 0."""
    valid = seg.positions >= 0
    pos = jnp.maximum(seg.positions, 0)
    max_blocks = seg.block_tables.shape[1]
    dst = jnp.take_along_axis(seg.block_tables, jnp.minimum(pos // t, max_blocks - 1), axis=1)
    dst = jnp.where(valid, dst, num_blocks)  # padding points past the pool: dropped
    return dst.reshape(-1), (pos % t).reshape(-1), valid, pos


def _unshared(x: jax.Array, weights: Any) -> tuple[jax.Array, Any]:
    """`(x, weights)` through an optimization barrier: to XLA, weights that only `x`'s products
    use (no runtime cost: the barrier copies nothing)."""
    return jax.lax.optimization_barrier((x, weights))


def _attend_fused(q: jax.Array, blocks: jax.Array, mask: jax.Array) -> jax.Array:
    """`_attend` by cuDNN's fused attention (flash attention: the scores never reach memory).
    bfloat16 or float16 on an NVIDIA GPU."""
    r, c, hkv, g, d = q.shape
    m, t = blocks.shape[1], blocks.shape[4]
    keys = blocks[:, :, 0].transpose(0, 1, 3, 2, 4).reshape(r, m * t, hkv, d)
    values = blocks[:, :, 1].transpose(0, 1, 3, 2, 4).reshape(r, m * t, hkv, d)
    out = jax.nn.dot_product_attention(q.reshape(r, c, hkv * g, d), keys, values,
                                       mask=mask[:, None], implementation="cudnn")
    return out.reshape(r, c, hkv, g, d)


def attention_tile_blocks(attention_tile: int | None, tokens_per_block: int) -> int:
    """The whole blocks a key tile of `paged_attention` holds: at least `attention_tile`
    tokens (None: `default_attention_tile()`), at least one block."""
    return max(1, -(-(attention_tile or default_attention_tile()) // tokens_per_block))


def default_attention_tile() -> int:
    """Tokens a key tile of `paged_attention` holds by default: 1024 on a GPU, where each tile
    is a loop iteration of a few kernel launches a layer, 128 elsewhere."""
    return 1024 if jax.default_backend() == "gpu" else 128


_MASKED = -1e30  # a masked key's score (finite: a row that holds no key stays finite)


def paged_attention(q: jax.Array, pool: jax.Array, layer: jax.Array | int,
                    block_tables: jax.Array, positions: jax.Array, valid: jax.Array, *,
                    tile_blocks: int, precision=None) -> jax.Array:
    """Attention of q `[R, C, Hkv, G, D]` over one layer of each row's paged K/V, reading only
    the tiles of blocks that the segment's rows hold: `[R, C, Hkv, G, D]` float32.

    Each row's keys are its table's blocks in order (`pool[block_tables[r], layer]`, pool
    `[N, L, 2, Hkv, T, D]`); query `c` of row `r` at `positions[r, c]` sees keys 0 to its
    position, padding queries (`valid` false) none. Keys come in tiles of `tile_blocks`
    blocks, merged by an online softmax (scores in float32; probabilities in the model's dtype
    for the second product, as flash attention does), and the loop runs as many tiles as the
    segment's longest row holds. A tile a row holds no key of is an exact no-op for that row
    (its running maximum is unchanged, so the rescale is exp(0) = 1 and its probabilities are
    0): a row's result depends on its own keys and on `tile_blocks` only, not on the other
    rows, the table's width or the slots its blocks occupy (only on their contents, which must
    be finite).
    """
    r, c, hkv, g, d = q.shape
    pool = jnp.asarray(pool)
    t = pool.shape[4]
    width = block_tables.shape[1]
    num_tiles = -(-width // tile_blocks)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_tiles * tile_blocks - width)))
    tile_tokens = tile_blocks * t
    held = jnp.max(jnp.where(valid, positions + 1, 0))  # keys of the longest row
    trips = jnp.minimum((held + tile_tokens - 1) // tile_tokens, num_tiles)
    scale = 1.0 / np.sqrt(d)

    def tile(i, state):
        m, l, acc = state
        ids = jax.lax.dynamic_slice_in_dim(tables, i * tile_blocks, tile_blocks, axis=1)
        blocks = pool[ids, layer]  # [R, tile_blocks, 2, Hkv, T, D]
        keys = blocks[:, :, 0].transpose(0, 2, 1, 3, 4).reshape(r, hkv, tile_tokens, d)
        values = blocks[:, :, 1].transpose(0, 2, 1, 3, 4).reshape(r, hkv, tile_tokens, d)
        key_pos = i * tile_tokens + jnp.arange(tile_tokens)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
        mask = mask[:, None, None]  # [R, 1, 1, C, tile]
        scores = jnp.einsum("rckgd,rkjd->rkgcj", q, keys, precision=precision,
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(mask, scores, _MASKED)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        probs = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        l = l * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "rkgcj,rkjd->rkgcd", probs.astype(q.dtype), values, precision=precision,
            preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((r, hkv, g, c), _MASKED, jnp.float32), jnp.zeros((r, hkv, g, c), jnp.float32),
            jnp.zeros((r, hkv, g, c, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, trips, tile, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4)


def _mask(positions: jax.Array, valid: jax.Array, keys: int) -> jax.Array:
    """`[R, C, keys]`: query c of row r sees keys 0 to its position; padding none."""
    return (jnp.arange(keys)[None, None, :] <= positions[:, :, None]) & valid[:, :, None]


def _attend(q: jax.Array, blocks: jax.Array, mask: jax.Array, precision) -> jax.Array:
    """Attention of q `[R, C, Hkv, G, D]` over one layer of each sequence's gathered blocks
    `[R, M, 2, Hkv, T, D]`, keys masked by `mask` `[R, C, M*T]`: `[R, C, Hkv, G, D]`. The
    table's full width for every row (`forward(full_width=True)`, the tests' reference).

    Scores and softmax in float32; probabilities in the model's dtype for the second product,
    as flash attention does.
    """
    r, m, _, hkv, t, d = blocks.shape
    keys = blocks[:, :, 0].transpose(0, 2, 1, 3, 4).reshape(r, hkv, m * t, d)
    values = blocks[:, :, 1].transpose(0, 2, 1, 3, 4).reshape(r, hkv, m * t, d)
    scores = jnp.einsum("rckgd,rkjd->rkgcj", q, keys, precision=precision,
                        preferred_element_type=jnp.float32) / np.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("rkgcj,rkjd->rckgd", probs, values, precision=precision,
                      preferred_element_type=jnp.float32)


def make_step(config: ModelConfig, pool: KVCacheBlockPool | None = None, *,
              fused_attention: bool | None = None, attention_tile: int | None = None,
              full_width: bool = False, greedy: bool = False, layer_groups: int = 0) -> Any:
    """`forward` jitted, pool donated: `step(params, pool.primary, segments)`.

    Assign the returned pool back (`pool.primary = new`): the old array is consumed. For a pool
    split over a mesh, XLA partitions the step by KV heads and the new pool keeps that split.
    `fused_attention`: None picks it for bfloat16 and float16 models on a GPU whose head
    dimension cuDNN takes (a multiple of 8, at most 256); `attention_tile`, `full_width`,
    `layer_groups`: `forward`'s. `greedy`: the step returns `(records, new_pool)`, every
    row's `TokenRecord` (`token_record`: its argmax token, its `RECORD_KEPT` largest logits
    and a fingerprint of all of them), computed on the device and packed in one small array
    (`pack_records`, the segments' rows in order; `unpack_records` on the host), so that
    nothing of the vocabulary's size crosses to the host (16 rows of 128k bfloat16 logits are
    4 MB a step) and one copy does. Pools of one model and one split share one jitted
    function, and so its compiled steps.
    """
    if fused_attention is None:
        fused_attention = (config.dtype in ("bfloat16", "float16")
                           and config.head_dim % 8 == 0 and config.head_dim <= 256
                           and jax.default_backend() == "gpu")
    return _jitted_step(config, None if pool is None or pool.mesh is None
                        else pool.sharding("device"), fused_attention,
                        attention_tile or default_attention_tile(), full_width, greedy,
                        layer_groups)


RECORD_TOP_K = 32  # the largest logits of a token's row that serving.compare checks
# The largest a token's record keeps: twice those, so that each of one run's 32 largest is found
# among another run's kept ones and compared by token id, although values a rounding apart
# (float32 runs ~1e-6) reorder near-ties, also across the 32nd place.
RECORD_KEPT = 2 * RECORD_TOP_K


class TokenRecord(NamedTuple):
    """What the demo keeps of a reply token's logits rows `[R, vocab]` (`token_record`).

    tokens: `[R]` int32, each row's argmax (the lowest index among equal maxima).
    top_logits: `[R, K]` the K (RECORD_KEPT) largest logits of each row, in the model's dtype,
      largest first (the floats' total order); equal values in the order of their token ids,
      lowest first (`jax.lax.top_k`'s order).
    top_logit_tokens: `[R, K]` int32, their token ids.
    fingerprints: `[R, 2]` uint32, two wrapping sums over every logit of the row
      (`logits_fingerprint`): equal for rows of the same bits, and changed by a change of any
      single logit's bits.
    """

    tokens: Any
    top_logits: Any
    top_logit_tokens: Any
    fingerprints: Any


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit into all."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _odd_multipliers(n: int, salt: int) -> jax.Array:
    """`[n]` distinct odd uint32 multipliers that look random: `2 p(i) + 1` for a bijection `p`
    of the 31-bit integers (xor-shifts and odd products modulo 2^31)."""
    mask = np.uint32(0x7FFFFFFF)
    x = (jnp.arange(n, dtype=jnp.uint32) ^ np.uint32(salt)) & mask
    x = x ^ (x >> 15)
    x = (x * np.uint32(0x2C1B3C6D)) & mask
    x = x ^ (x >> 12)
    x = (x * np.uint32(0x297A2D39)) & mask
    x = x ^ (x >> 15)
    return x * np.uint32(2) + np.uint32(1)


def logits_fingerprint(logits: jax.Array) -> jax.Array:
    """`[R, 2]` uint32 of logits `[R, vocab]` (2- or 4-byte floats): each row's bits as
    unsigned integers `b_i` (widened to 32 bits), then
    `sum_i b_i * m_i` and `sum_i fmix32(b_i) * n_i`, wrapping modulo 2^32, with `m`, `n`
    distinct odd multipliers per position (`_odd_multipliers`, salts 1 and 2).

    Changing any single value's bits changes both sums: the difference `b_i' - b_i` is not 0
    modulo 2^32, nor is `fmix32(b_i') - fmix32(b_i)` (a bijection), and an odd multiplier is
    invertible modulo 2^32. -0.0 and 0.0, or NaNs of other payloads, are other bits. Integer
    sums are exact in any order, so the device's reduction order does not matter."""
    size = jnp.dtype(logits.dtype).itemsize
    if size not in (2, 4):
        raise ValueError(f"logits must be 2- or 4-byte floats, got {logits.dtype}")
    bits = jax.lax.bitcast_convert_type(logits, jnp.uint16 if size == 2 else jnp.uint32)
    bits = bits.astype(jnp.uint32)
    n = bits.shape[1]
    first = jnp.sum(bits * _odd_multipliers(n, 1), axis=-1, dtype=jnp.uint32)
    second = jnp.sum(_fmix32(bits) * _odd_multipliers(n, 2), axis=-1, dtype=jnp.uint32)
    return jnp.stack([first, second], axis=-1)


def token_record(logits: jax.Array, dtype: Any, k: int = RECORD_KEPT) -> TokenRecord:
    """The `TokenRecord` of logits `[R, vocab]`, rounded to `dtype` first (the model's: a
    bfloat16 model computes them in it and `forward` widens them to float32, so the rounding
    is exact): argmax, the `min(k, vocab)` largest and the fingerprint.

    The largest are taken in float32 at least (an exact widening, in the same order: XLA's CPU
    TopK of bfloat16 is a sort, ~150x slower than of float32 on a 128k vocabulary), ordered
    by `jax.lax.top_k`: the floats' total order (-0.0 below 0.0, NaN above inf), equal values
    lowest token id first."""
    rounded = logits.astype(dtype)
    wide = rounded.astype(jnp.promote_types(dtype, jnp.float32))
    top, ids = jax.lax.top_k(wide, min(k, logits.shape[-1]))
    return TokenRecord(jnp.argmax(wide, axis=-1).astype(jnp.int32), top.astype(dtype),
                       ids.astype(jnp.int32), logits_fingerprint(rounded))


def pack_records(records: Sequence[TokenRecord]) -> jax.Array:
    """Records (`token_record`'s) as one uint32 array `[rows, 2 K + 3]`, the segments' rows one
    after another, so that a step's records cross to the host in one copy: each row its token,
    its top-K token ids, the top-K logits' bits (widened to 32) and its fingerprint.
    `unpack_records` takes it apart."""
    rows = []
    for r in records:
        size = jnp.dtype(r.top_logits.dtype).itemsize
        bits = jax.lax.bitcast_convert_type(r.top_logits, jnp.uint16 if size == 2
                                            else jnp.uint32).astype(jnp.uint32)
        rows.append(jnp.concatenate([r.tokens[:, None].astype(jnp.uint32),
                                     r.top_logit_tokens.astype(jnp.uint32), bits,
                                     r.fingerprints], axis=1))
    return jnp.concatenate(rows, axis=0)


def unpack_records(packed: np.ndarray, dtype: Any) -> TokenRecord:
    """`pack_records`' array, on the host, as one `TokenRecord` of all its rows (NumPy views of
    it; the top logits in `dtype`, the model's)."""
    k = (packed.shape[1] - 3) // 2
    dtype = jnp.dtype(dtype)
    values = packed[:, 1 + k:1 + 2 * k]
    if dtype.itemsize == 2:
        values = values.astype(np.uint16)
    return TokenRecord(packed[:, 0].view(np.int32), values.view(dtype),
                       packed[:, 1:1 + k].view(np.int32), packed[:, 1 + 2 * k:])


def _greedy(params: dict, kv_pool: jax.Array, segments: tuple[Rows, ...], *,
            config: ModelConfig, **kw: Any) -> Any:
    logits, kv_pool = forward(params, kv_pool, segments, config=config, **kw)
    return pack_records([token_record(x, config.dtype) for x in logits]), kv_pool


@functools.cache
def _jitted_step(config: ModelConfig, pool_sharding: jax.sharding.NamedSharding | None,
                 fused_attention: bool, attention_tile: int, full_width: bool = False,
                 greedy: bool = False, layer_groups: int = 0) -> Any:
    fn = functools.partial(_greedy if greedy else forward, config=config,
                           fused_attention=fused_attention, attention_tile=attention_tile,
                           full_width=full_width, layer_groups=layer_groups)
    if pool_sharding is None:
        return jax.jit(fn, donate_argnums=1)
    replicated = jax.sharding.NamedSharding(pool_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, donate_argnums=1, out_shardings=(replicated, pool_sharding))
