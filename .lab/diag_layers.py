"""Where the layered offload/onboard time goes (H200 diagnostic, not committed)."""
import os, time
import numpy as np, jax, jax.numpy as jnp
from jax_kvxfer.manager import KVCacheTransferManager
from jax_kvxfer.pool import KVCacheBlockPool
from jax_kvxfer.bench.cupy_tools import CupyTools

L, T, H, D = (32, 16, 16, 128) if not os.environ.get("SMALL") else (4, 2, 2, 8)
piece = T * H * D * 2
row = L * piece
cu = CupyTools() if not os.environ.get('SMALL') else None
rng = np.random.default_rng(0)
med = lambda xs: float(np.median(xs))

def wall(f, n=7, w=2):
    for _ in range(w): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return med(ts)

nbmax = 1024
out = {}
for nb in ((64, 1024) if cu else ()):
    cu.ensure_arena(nbmax * row)
    tot = nb * row
    r = {}
    for name, d, s in (("d2h", "host_b", "dev_a"), ("h2d", "dev_a", "host_b")):
        dp, sp = cu.ptr(d), cu.ptr(s)
        g, _ = cu.time_ops(lambda st: cu.memcpy(dp, sp, tot, st), reps=1, samples=5, warmup=2, gpu_only=True)
        r[f"ceil_{name}_gpu"] = med(g)
        r[f"ceil_{name}_wall"] = wall(lambda: (cu.memcpy(dp, sp, tot, cu.stream), cu.stream.synchronize()))
        perm_s, perm_d = rng.permutation(nbmax)[:nb], rng.permutation(nbmax)[:nb]
        def rows(st):
            for a, b in zip(perm_d, perm_s):
                cu.memcpy(dp + int(a) * row, sp + int(b) * row, row, st)
        g, _ = cu.time_ops(rows, reps=1, samples=5, warmup=2, gpu_only=True)
        r[f"rows2M_{name}_gpu"] = med(g)
        if nb == 64:
            def pieces(st):
                for l in range(L):
                    for a, b in zip(perm_d, perm_s):
                        cu.memcpy(dp + int(a) * row + l * piece, sp + (int(b) * L + l) * piece, piece, st)
            g, _ = cu.time_ops(pieces, reps=1, samples=5, warmup=2, gpu_only=True)
            r[f"pieces64K_{name}_gpu"] = med(g)
    out[nb] = r
    print(nb, {k: f"{v*1e3:.3f}ms" for k, v in r.items()}, flush=True)

del cu
shape = (nbmax, T, H, D)
arrays = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(L)]
pool = KVCacheBlockPool.from_layers(arrays, token_axis=1, num_secondary_blocks=nbmax)
for dma in (True, False):
    mgr = KVCacheTransferManager(pool, dma=dma)
    for nb in (1, 64, 1024):
        src, dst = rng.permutation(nbmax)[:nb], rng.permutation(nbmax)[:nb]
        r = {}
        for name, f in (("off", lambda: mgr.offload_indices(src, dst)), ("on", lambda: mgr.onboard_indices(dst, src))):
            for _ in range(2): f(); mgr.sync_transfers()
            te, tt = [], []
            for _ in range(7):
                t = time.perf_counter(); f(); t1 = time.perf_counter(); mgr.sync_transfers(); t2 = time.perf_counter()
                te.append(t1 - t); tt.append(t2 - t)
            r[name] = (med(te) * 1e3, med(tt) * 1e3)
            t4 = wall(lambda: ([f() for _ in range(4)], mgr.sync_transfers()), n=5, w=1) / 4
            r[name + "4"] = t4 * 1e3
        print(f"mgr dma={dma} nb={nb}: enqueue/total ms off {r['off'][0]:.3f}/{r['off'][1]:.3f} on {r['on'][0]:.3f}/{r['on'][1]:.3f}; 4 back to back per batch: off {r['off4']:.3f} on {r['on4']:.3f}", flush=True)
    mgr.close() if hasattr(mgr, "close") else None
