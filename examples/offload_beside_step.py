"""Offloading KV blocks while a jitted step computes, on the GPU's copy engines.

One jitted function runs the model step on GPU stream 2 and offloads blocks to the pinned-host
pool on stream 1 with `dma=True`, so the copy takes no SM from the step (on an H200 a 2 GiB
offload added 3 % or less to a 45 ms matmul step). The block indices
are jit arguments in pinned_host memory, written on the host before the call: the copy
engines' handler reads them there as it enqueues the copies. On a CPU the same code runs, with
the streams and the copy engines ignored.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=2, size_per_head=64,
                                   tokens_per_block=16, dtype=jnp.bfloat16,
                                   num_primary_blocks=32, num_secondary_blocks=32)
rng = np.random.default_rng(0)
pool.primary = jax.device_put(rng.standard_normal(pool.primary.shape).astype(jnp.bfloat16),
                              pool.sharding("device"))
pinned = pool.sharding("pinned_host")


def model_step(w, x):  # stands in for the attention and MLP work of one decoding step
    for _ in range(4):
        x = jnp.tanh(x @ w)
    return x


@functools.partial(jax.jit, donate_argnums=0)
def step(secondary, primary, evict_from, evict_to, w, x):
    secondary = kvx.copy_blocks(secondary, primary, evict_from, evict_to, stream=1, dma=True)
    y = kvx.on_stream(model_step, 2, jax.memory.Space.Device)(w, x)
    return secondary, y


evict_from = np.array([3, 4, 5, 17], np.int32)  # GPU blocks to keep on the host
evict_to = np.array([0, 1, 2, 9], np.int32)     # free host slots
src, dst = jax.device_put((evict_from, evict_to), pinned)  # final before the call
w = jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.float32)
x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)

before = kvx.to_numpy(pool.primary)
pool.secondary, y = step(pool.secondary, pool.primary, src, dst, w, x)
np.testing.assert_array_equal(kvx.to_numpy(pool.secondary)[evict_to], before[evict_from])
np.testing.assert_allclose(np.asarray(y), np.asarray(model_step(w, x)), rtol=1e-2, atol=1e-2)
print(f"offloaded {len(evict_from)} blocks beside the step on {jax.default_backend()}; exact")
