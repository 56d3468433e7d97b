"""Using KVCacheTransferManager around your own jitted, pool-donating step.

Offload a block to pinned host memory, let a jitted step overwrite the primary pool in place
(donated), onboard the block back, and check it came back intact.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx

pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=2, size_per_head=8,
                                   tokens_per_block=4, dtype=jnp.float32,
                                   num_primary_blocks=4, num_secondary_blocks=4)
tm = kvx.KVCacheTransferManager([pool])


@functools.partial(jax.jit, donate_argnums=0)
def step(primary, value):  # stands in for an attention step that writes new K/V
    return primary.at[1].set(value)


pool.primary = step(pool.primary, 7.0)  # block 1 holds our "K/V"
saved = np.asarray(pool.primary[1])
tm.offload(kvx.KVCacheBlock(0, 1, True), kvx.KVCacheBlock(0, 2, False))  # device -> host slot 2
pool.primary = step(pool.primary, -1.0)  # reuse block 1 at once: the offload kept the old data
tm.onboard(kvx.KVCacheBlock(0, 2, False), kvx.KVCacheBlock(0, 3, True))  # host -> device block 3
tm.sync_transfers()  # the step boundary
np.testing.assert_array_equal(np.asarray(pool.primary[3]), saved)  # read pool.primary fresh
print("onboarded block matches;", tm.get_and_reset_transfer_stats())
