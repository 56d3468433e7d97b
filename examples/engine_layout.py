"""An engine's own KV layout: one K and one V array per layer, NHD `[blocks, tokens, heads, dim]`.

A paged-attention decode step reads them through a block table. The pool over them
(`KVCacheBlockPool.from_layers`) keeps the arrays as they are on the GPU and gives each host
block one contiguous row holding every layer's K and V. Two blocks of a sequence are offloaded
and their device blocks reused; the sequence comes back into other device blocks (its last
block only partly filled: a partial copy of its tokens), and the decode step gives the same
output as before, bit for bit.
"""
import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

LAYERS, BLOCKS, HOST_BLOCKS, T, HEADS, DIM = 4, 12, 6, 8, 2, 16
rng = np.random.default_rng(0)
# The engine's cache: per layer a K and a V array. 13 tokens of one sequence in blocks 3 and 5.
cache = [jnp.asarray(rng.standard_normal((BLOCKS, T, HEADS, DIM)), jnp.bfloat16)
         for _ in range(2 * LAYERS)]
pool = kvx.KVCacheBlockPool.from_layers(cache, token_axis=1, num_secondary_blocks=HOST_BLOCKS)
manager = kvx.KVCacheTransferManager(pool)
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


before = np.asarray(decode(pool.primary, jnp.array([3, 5]), query))
manager.offload_indices([3, 5], [0, 1])  # every layer's K and V of a block into one host row
manager.sync_transfers()
# The blocks go to another request, which overwrites them in its own step (donated: in place).
pool.primary = jax.jit(lambda c: [a.at[jnp.array([3, 5])].set(0) for a in c],
                       donate_argnums=0)(pool.primary)
# Back into blocks 7 and 9: the first whole, the second's 5 tokens (13 = 8 + 5) only.
manager.onboard_indices([0, 1], [7, 9], [0, length - T])
manager.sync_transfers()
after = np.asarray(decode(pool.primary, jnp.array([7, 9]), query))
np.testing.assert_array_equal(after, before)
print(f"{LAYERS} layers of NHD K/V offloaded into host rows of {pool.block_nbytes // 1024} KiB "
      "and onboarded; the decode step's output is bit for bit the same")
