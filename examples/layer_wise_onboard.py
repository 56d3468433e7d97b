"""A step that computes its first layers while the later ones are still being onboarded.

A manager with `layer_groups` lands each onboard group of layers by group. After
`sync_transfers(block=False, layer_wise=True)` the step joins the onboards itself: it passes
the pool through `wait_for_layers(pool, k)` before its layers below k read it, so on a GPU
group 0's layers compute while group 1's copies still cross the link. Every layer must be
waited for before it is read. On a CPU the same code runs, the copies done in line.
"""
import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

LAYERS, GROUPS = 4, 2
pool = kvx.KVCacheBlockPool.create(num_layers=LAYERS, num_kv_heads=2, size_per_head=64,
                                   tokens_per_block=16, dtype=jnp.float32,
                                   num_primary_blocks=32, num_secondary_blocks=32)
rng = np.random.default_rng(0)
host = rng.standard_normal(pool.secondary.shape).astype(np.float32)
pool.secondary = jax.device_put(host, pool.sharding("pinned_host"))
manager = kvx.KVCacheTransferManager([pool], layer_groups=GROUPS)


@jax.jit
def step(kv, q):
    """Per layer, a score of every block against q (stands in for attention)."""
    scores = []
    for g in range(GROUPS):
        lo, hi = kvx.layer_group_bounds(g, GROUPS, LAYERS)
        kv = kvx.wait_for_layers(kv, hi)  # this group's layers have landed
        for layer in range(lo, hi):
            scores.append(jnp.einsum("bkhtd,d->b", kv[:, layer], q))
    return jnp.stack(scores), kv


rows, slots = np.array([5, 6, 7, 20]), np.array([0, 1, 2, 3])
manager.onboard_indices(rows, slots)  # on lane 1, group by group; returns at once
manager.sync_transfers(block=False, layer_wise=True)  # the step waits, layer by layer
q = jnp.ones(64, jnp.float32)
scores, pool.primary = step(pool.primary, q)
want = np.einsum("bLkhtd,d->Lb", host[rows], np.ones(64, np.float32))
np.testing.assert_allclose(np.asarray(scores)[:, :4], want, rtol=1e-4, atol=1e-3)
print(f"{LAYERS} layers read in {GROUPS} groups, each after its own onboard: scores match")
