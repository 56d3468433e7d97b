"""A small decoder-only transformer in plain JAX whose attention reads and writes paged KV blocks.

Random seeded weights, grouped-query attention, RoPE, RMSNorm and a SwiGLU MLP. The KV cache is
the primary array of one `KVCacheBlockPool` holding every layer,
`[num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim]`; each step writes the
new tokens' K/V into the blocks named by the block tables and attends over them (paged
attention by gather: simple, not fast).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .pool import KVCacheBlockPool

_HIGHEST = jax.lax.Precision.HIGHEST  # no TF32 on GPUs: the exactness check compares logits


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


def forward(params: dict[str, jax.Array], kv_pool: jax.Array, tokens: jax.Array,
            positions: jax.Array, block_tables: jax.Array, logit_index: jax.Array, *,
            config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """One step: writes the K/V of `tokens` into `kv_pool`; returns one logits row per sequence.

    Args:
      params: from `init_params`.
      kv_pool: the primary pool array `[num_blocks, num_layers, 2, num_kv_heads,
        tokens_per_block, head_dim]`.
      tokens: `[B, C]` token ids.
      positions: `[B, C]` their positions in their sequences; -1 marks padding (not written,
        output ignored).
      block_tables: `[B, max_blocks]` primary block indices of each sequence in token order;
        entries past a sequence's blocks may be any valid index (they are masked).
      logit_index: `[B]` the column of `tokens` whose next-token logits to return (the last
        prompt token in a prefill chunk, 0 in a decode step).

    Returns:
      `(logits [B, vocab_size] float32, new kv_pool)`.
    """
    c = config
    b, chunk = tokens.shape
    num_blocks, t = kv_pool.shape[0], kv_pool.shape[4]
    max_blocks = block_tables.shape[1]
    valid = positions >= 0
    pos = jnp.maximum(positions, 0)
    # Where each token's K/V goes; padding rows point past the pool and are dropped.
    dst_block = jnp.take_along_axis(block_tables, jnp.minimum(pos // t, max_blocks - 1), axis=1)
    dst_block = jnp.where(valid, dst_block, num_blocks).reshape(-1)
    dst_offset = (pos % t).reshape(-1)
    key_pos = jnp.arange(max_blocks * t)
    mask = (key_pos[None, None, :] <= pos[:, :, None]) & valid[:, :, None]  # [B, C, J]
    group = c.num_heads // c.num_kv_heads

    def dot(x, w):
        return jnp.einsum("bcd,de->bce", x, w, precision=_HIGHEST)

    x = params["embed"][tokens]
    for layer in range(c.num_layers):
        h = _rms_norm(x, params["attn_norm"][layer], c.norm_eps)
        q = dot(h, params["wq"][layer]).reshape(b, chunk, c.num_heads, c.head_dim)
        k = dot(h, params["wk"][layer]).reshape(b, chunk, c.num_kv_heads, c.head_dim)
        v = dot(h, params["wv"][layer]).reshape(b, chunk, c.num_kv_heads, c.head_dim)
        q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
        kv = jnp.stack([k, v], axis=2).reshape(b * chunk, 2, c.num_kv_heads, c.head_dim)
        kv_pool = kv_pool.at[dst_block, layer, :, :, dst_offset, :].set(
            kv.astype(kv_pool.dtype), mode="drop")
        # [B, max_blocks, 2, Hkv, T, D] -> K, V as [B, Hkv, max_blocks * T, D]
        blocks = kv_pool[block_tables, layer].astype(x.dtype)
        blocks = blocks.transpose(0, 2, 3, 1, 4, 5).reshape(
            b, 2, c.num_kv_heads, max_blocks * t, c.head_dim)
        keys, values = blocks[:, 0], blocks[:, 1]
        q = q.reshape(b, chunk, c.num_kv_heads, group, c.head_dim)
        scores = jnp.einsum("bckgd,bkjd->bkgcj", q, keys, precision=_HIGHEST)
        scores = jnp.where(mask[:, None, None], scores / np.sqrt(c.head_dim), -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bkgcj,bkjd->bckgd", probs, values, precision=_HIGHEST)
        x = x + dot(attn.reshape(b, chunk, c.num_heads * c.head_dim), params["wo"][layer])
        h = _rms_norm(x, params["mlp_norm"][layer], c.norm_eps)
        gate = jax.nn.silu(dot(h, params["w1"][layer])) * dot(h, params["w3"][layer])
        x = x + dot(gate, params["w2"][layer])
    x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)  # [B, 1, d_model]
    logits = dot(_rms_norm(x, params["final_norm"], c.norm_eps), params["unembed"])[:, 0]
    return logits.astype(jnp.float32), kv_pool


def make_step(config: ModelConfig, pool: KVCacheBlockPool | None = None) -> Any:
    """`forward` jitted, pool donated: `step(params, pool, tokens, positions, tables, index)`.

    Assign the returned pool back (`pool.primary = new`): the old array is consumed. For a pool
    split over a mesh, XLA partitions the step by KV heads and the new pool keeps that split.
    """
    fn = functools.partial(forward, config=config)
    if pool is None or pool.mesh is None:
        return jax.jit(fn, donate_argnums=1)
    replicated = jax.sharding.NamedSharding(pool.mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, donate_argnums=1, out_shardings=(replicated, pool.sharding("device")))
