"""An engine that owns its GPU pages and prefix cache uses jax_kvxfer's host pool through the
connector, in the order vLLM v1 makes its calls; checks every loaded page against recomputing.

The "engine" here is a toy: 8 GPU pages of 4 tokens, per-layer NHD arrays, a prefix cache that
maps a block hash to a page and forgets it when the page is reused, and a "model" whose K/V at
a position is a function of the tokens up to it. Its prompts share a 12-token prefix and do not
fit its pages together, so the second prompt finds the prefix in the host pool.
"""

import zlib

import jax.numpy as jnp
import numpy as np

import jax_kvxfer as kvx
from jax_kvxfer.connector import OffloadingManager, OffloadingWorker

PAGES, T, HEADS, DIM, LAYERS = 8, 4, 2, 16, 2


def kv_of(tokens):
    """The K/V the model writes for a block of `tokens` (every token before it included)."""
    seed = zlib.crc32(np.asarray(tokens, np.int64).tobytes())
    return np.random.default_rng(seed).standard_normal((T, HEADS, DIM)).astype(np.float32)


def block_hashes(tokens):
    """The engine's own chained block hashes (ints), one per full block."""
    return [zlib.crc32(np.asarray(tokens[:i + T], np.int64).tobytes())
            for i in range(0, len(tokens) - T + 1, T)]


caches = [jnp.zeros((PAGES, T, HEADS, DIM), jnp.float32) for _ in range(2 * LAYERS)]
worker = OffloadingWorker(caches, num_host_blocks=16, token_axis=1)
manager = OffloadingManager(16, block_size=T)
computed = 0

for n, prompt in enumerate([list(range(100, 116)), list(range(100, 112)) + [7, 8, 9, 10]]):
    hashes = block_hashes(prompt)
    # 1. lookup: the leading blocks the host pool holds (this engine's GPU cache holds none of
    #    them: each prompt here takes every page)
    hits = manager.lookup(hashes) or 0
    pages = list(range(len(hashes)))  # the engine's allocator: pages for the whole prompt
    if hits:
        # 2. prepare_load + touch, then the worker copies host rows into the pages
        spec = manager.prepare_load(hashes[:hits])
        manager.touch(hashes)
        worker.submit_load(("load", n), spec, pages[:hits])
        worker.wait([("load", n)])
        # 3. complete_load once get_finished reports the job
        assert worker.get_finished() == [(("load", n), True)]
        manager.complete_load(hashes[:hits])
    # the engine computes the rest (its step writes pages; it assigns the new arrays back)
    arrays = worker.kv_caches
    for b in range(hits, len(hashes)):
        kv = kv_of(prompt[:(b + 1) * T])
        arrays = [a.at[pages[b]].set(kv) for a in arrays]
        computed += T
    worker.kv_caches = arrays
    # every page the prompt uses holds what recomputing gives, loaded or not
    for b in range(len(hashes)):
        for a in worker.kv_caches:
            np.testing.assert_array_equal(kvx.to_numpy(a)[pages[b]], kv_of(prompt[:(b + 1) * T]))
    # 4. prepare_store + submit_store: the computed blocks written through to the host pool
    out = manager.prepare_store(hashes)
    if out is not None and out.block_hashes_to_store:
        todo = [pages[hashes.index(h)] for h in out.block_hashes_to_store]
        worker.submit_store(("store", n), out.store_spec, todo)
        worker.wait([("store", n)])
        assert worker.get_finished() == [(("store", n), True)]
        # 5. complete_store: loadable from now on
        manager.complete_store(out.block_hashes_to_store)
    events = manager.take_events()  # 6. what a router needs: blocks stored / removed per medium
    print(f"prompt {n}: {hits} of {len(hashes)} blocks loaded from the host pool, "
          f"{sum(len(e.block_hashes) for e in events if not e.removed)} stored")

worker.close()
assert computed == 16 + 4, computed  # the second prompt computed only its last block
print(f"exact; tokens computed: {computed} of 32")
