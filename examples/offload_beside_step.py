"""Offloading KV blocks while a jitted step computes: the transfer manager's lanes.

On a GPU, `offload_indices` enqueues the copies on a transfer lane, a stream of the library's
own, with the GPU's copy engines, and returns: the step dispatched next runs beside the copies,
and they take no SM from it. `sync_transfers` is the step boundary, where later work sees every
copy done. On a CPU the same code runs, the copies done in line.
"""
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
manager = kvx.KVCacheTransferManager([pool])


@jax.jit
def model_step(w, x):  # stands in for the attention and MLP work of one decoding step
    for _ in range(4):
        x = jnp.tanh(x @ w)
    return x


evict_from = np.array([3, 4, 5, 17], np.int32)  # GPU blocks to keep on the host
evict_to = np.array([0, 1, 2, 9], np.int32)     # free host slots
w = jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.float32)
x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)

before = kvx.to_numpy(pool.primary)
manager.offload_indices(evict_from, evict_to)  # enqueued on lane 0; returns at once
y = model_step(w, x)  # runs beside the offload
manager.sync_transfers()  # the step boundary
np.testing.assert_array_equal(kvx.to_numpy(pool.secondary)[evict_to], before[evict_from])
np.testing.assert_allclose(np.asarray(y), np.asarray(model_step(w, x)), rtol=1e-2, atol=1e-2)
print(f"offloaded {len(evict_from)} blocks beside the step on {jax.default_backend()} "
      f"({'transfer lanes' if manager.on_lanes else 'in line'}); exact")
