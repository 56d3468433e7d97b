"""An engine's own KV layout: one K and one V array per layer, NHD `[blocks, tokens, heads, dim]`.

A paged-attention decode step reads them through a block table. Two blocks of a sequence are
offloaded to host arrays of the same layout and their device blocks reused; the sequence comes
back into other device blocks (its last block only partly filled: a partial copy of its
tokens), and the decode step gives the same output as before, bit for bit.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

LAYERS, BLOCKS, HOST_BLOCKS, T, HEADS, DIM = 4, 12, 6, 8, 2, 16
rng = np.random.default_rng(0)
device = jax.devices()[0]
host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
# The engine's cache: per layer a K and a V array. 13 tokens of one sequence in blocks 3 and 5.
cache = [jnp.asarray(rng.standard_normal((BLOCKS, T, HEADS, DIM)), jnp.bfloat16)
         for _ in range(2 * LAYERS)]
host_cache = [jax.device_put(np.zeros((HOST_BLOCKS, T, HEADS, DIM), jnp.bfloat16), host)
              for _ in range(2 * LAYERS)]
length = 13
query = jnp.asarray(rng.standard_normal((LAYERS, HEADS, DIM)), jnp.float32)


@jax.jit
def decode(cache, table, query):
    """Per layer, one query token's attention over the sequence's blocks (paged by gather)."""
    out = []
    for layer in range(LAYERS):
        k = cache[2 * layer][table].reshape(-1, HEADS, DIM).astype(jnp.float32)
        v = cache[2 * layer + 1][table].reshape(-1, HEADS, DIM).astype(jnp.float32)
        scores = jnp.einsum("hd,jhd->hj", query[layer], k)
        scores = jnp.where(jnp.arange(k.shape[0]) < length, scores, -jnp.inf)
        out.append(jnp.einsum("hj,jhd->hd", jax.nn.softmax(scores, axis=-1), v))
    return jnp.stack(out)


@functools.partial(jax.jit, donate_argnums=0)
def move(dst, src, src_idx, dst_idx, num_tokens):
    """Every layer's K and V, in one program; the destinations donated: updated in place."""
    return [kvx.copy_blocks(d, s, src_idx, dst_idx, num_tokens, token_axis=1)
            for d, s in zip(dst, src)]


before = np.asarray(decode(cache, jnp.array([3, 5]), query))
host_cache = move(host_cache, cache, np.int32([3, 5]), np.int32([0, 1]), np.int32([0, 0]))
cache = [c.at[jnp.array([3, 5])].set(0) for c in cache]  # the blocks go to another request
# Back into blocks 7 and 9: the first whole, the second's 5 tokens (13 = 8 + 5) only.
cache = move(cache, host_cache, np.int32([0, 1]), np.int32([7, 9]), np.int32([0, length - T]))
after = np.asarray(decode(cache, jnp.array([7, 9]), query))
np.testing.assert_array_equal(after, before)
print(f"{LAYERS} layers of NHD K/V offloaded and onboarded; the decode step's output is "
      "bit for bit the same")
