"""Multi-process meshes: two JAX processes on 127.0.0.1 (`jax.distributed`), two CPU devices
each, one pool split by KV heads over all four devices.

Each process checks its own shards against a NumPy reference after the manager's transfers
(whole, partial, both ways, plan ring on and off), eager and in-jit `copy_blocks`, and counts
the cross-process checks JAX runs behind the library's back (`multihost_utils.assert_equal` and
`process_allgather`, which `jax.device_put` of host data onto a sharding that spans processes
calls): there must be none. Then both run the demo tensor-parallel over the four devices, which
must be exact. The worker is this file run as a script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="gloo collectives over TCP on Linux")
def test_two_processes_share_a_pool_with_no_hidden_collectives(tmp_path):
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(NUM_PROCESSES)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for p in procs:  # both always end, whatever happened to the other
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-4000:]}"
    for i in range(NUM_PROCESSES):
        report = json.loads((tmp_path / f"report-{i}.json").read_text())
        assert report["hidden_collectives"] == 0, report
        assert report["checks"] == 9, report  # start, 3 per plan-ring setting, eager, jit
        assert report["demo_exit"] == 0, report


# -- the worker --------------------------------------------------------------------------------


def _worker(process_id: int, port: int, out_dir: str) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=NUM_PROCESSES, process_id=process_id,
                               initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import jax_kvxfer as kvx
    from jax_kvxfer import __main__ as cli

    hidden = {"n": 0}
    for name in ("assert_equal", "process_allgather"):
        real = getattr(multihost_utils, name)

        def counted(*args, _real=real, **kwargs):
            hidden["n"] += 1
            return _real(*args, **kwargs)
        setattr(multihost_utils, name, counted)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    heads, nb, t = 4, 8, 4
    pool = kvx.KVCacheBlockPool.create(num_layers=2, num_kv_heads=heads, size_per_head=8,
                                       tokens_per_block=t, dtype=jnp.float32,
                                       num_primary_blocks=nb, num_secondary_blocks=nb,
                                       mesh=mesh, kv_head_axis="tp")
    assert pool.device.process_index == process_id
    others = [d for d in jax.devices() if d.process_index != process_id]
    try:  # a mesh this process holds no part of is a clear error, not a silent skip
        kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=8,
                                    tokens_per_block=4, dtype=jnp.float32,
                                    num_primary_blocks=2, num_secondary_blocks=2,
                                    mesh=jax.sharding.Mesh(np.array(others), ("tp",)),
                                    kv_head_axis="tp")
        raise AssertionError("a mesh of another process's devices must raise")
    except ValueError as e:
        assert "no device of this process" in str(e), e
    rng = np.random.default_rng(1234)  # the same global data on every process
    ref = {"primary": rng.standard_normal(pool.primary.shape).astype(np.float32),
           "secondary": rng.standard_normal(pool.primary.shape).astype(np.float32)}

    def put(name: str) -> jax.Array:
        sharding = pool.sharding("device" if name == "primary" else "pinned_host")
        return jax.make_array_from_callback(ref[name].shape, sharding,
                                            lambda idx: ref[name][idx].copy())

    pool.primary, pool.secondary = put("primary"), put("secondary")
    checks = {"n": 0}

    def check(what: str) -> None:
        for name in ("primary", "secondary"):
            for index, got in kvx.to_numpy(getattr(pool, name), local=True):
                np.testing.assert_array_equal(got, ref[name][index], err_msg=f"{what}: {name}")
        checks["n"] += 1

    def apply(src: str, dst: str, pairs, tokens) -> None:
        for (s, d), n in zip(pairs, tokens):
            n = t if n <= 0 or n >= t else n
            ref[dst][d, :, :, :, :n] = ref[src][s, :, :, :, :n]

    P = lambda i: kvx.KVCacheBlock(i, i, True)
    S = lambda i: kvx.KVCacheBlock(i, i, False)
    check("start")
    try:
        kvx.to_numpy(pool.primary)
        raise AssertionError("to_numpy of a multi-process array must ask for local=True")
    except ValueError as e:
        assert "local=True" in str(e)
    for ring in (True, False):
        mgr = kvx.KVCacheTransferManager([pool], plan_ring=ring)
        mgr.offload_blocks([(P(0), S(1)), (P(2), S(3))])
        apply("primary", "secondary", [(0, 1), (2, 3)], [0, 0])
        mgr.onboard_blocks([(S(5), P(6)), (S(1), P(7))], num_tokens=[2, 0])
        apply("secondary", "primary", [(5, 6), (1, 7)], [2, 0])
        mgr.sync_transfers()
        check(f"manager, plan ring {ring}")
        mgr.offload_indices([4, 5], [6, 7], num_tokens=3)
        apply("primary", "secondary", [(4, 6), (5, 7)], [3, 3])
        mgr.onboard(P(6), P(3), num_tokens=1)
        apply("primary", "primary", [(6, 3)], [1])
        mgr.sync_transfers()
        check(f"manager indices and partial, plan ring {ring}")
        mgr.offload_and_onboard([(P(1), S(0))], [(S(2), P(5))])
        apply("primary", "secondary", [(1, 0)], [0])
        apply("secondary", "primary", [(2, 5)], [0])
        mgr.sync_transfers()
        check(f"both ways, plan ring {ring}")
    pool.secondary = kvx.copy_blocks(pool.secondary, pool.primary, [3], [4], donate=True)
    apply("primary", "secondary", [(3, 4)], [0])
    check("eager copy_blocks")
    spec = pool.partition_spec
    whole = jax.sharding.PartitionSpec()

    @jax.jit
    def onboard_in_jit(gpu, host, src, dst):
        return jax.shard_map(lambda g, h, a, b: kvx.copy_blocks(g, h, a, b, 2), mesh=mesh,
                             in_specs=(spec, spec, whole, whole), out_specs=spec)(
                                 gpu, host, src, dst)

    idx = jax.make_array_from_callback((1,), jax.sharding.NamedSharding(mesh, whole),
                                       lambda i: np.array([4], np.int32))
    dst_idx = jax.make_array_from_callback((1,), jax.sharding.NamedSharding(mesh, whole),
                                           lambda i: np.array([0], np.int32))
    pool.primary = onboard_in_jit(pool.primary, pool.secondary, idx, dst_idx)
    apply("secondary", "primary", [(4, 0)], [2])
    check("copy_blocks in jit + shard_map")
    transfers_hidden = hidden["n"]

    demo_args = ["demo", "--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "4",
                 "--kv-heads", "4", "--head-dim", "8", "--d-ff", "64", "--conversations", "6",
                 "--turns", "2", "--batch", "2", "--system-tokens", "6", "--user-tokens", "6",
                 "--gen-tokens", "3", "--tokens-per-block", "4", "--chunk", "4",
                 "--primary-blocks", "16", "--secondary-blocks", "12", "--no-progress",
                 "--devices", "4", "--json"]
    demo_exit = cli.main(demo_args)
    report = {"hidden_collectives": transfers_hidden, "checks": checks["n"],
              "demo_exit": demo_exit}
    with open(os.path.join(out_dir, f"report-{process_id}.json"), "w") as f:
        json.dump(report, f)
    print(report, flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


# -- in one process ----------------------------------------------------------------------------


def test_memory_is_checked_on_every_device_of_this_process(monkeypatch):
    """Each device of the mesh that this process holds gets its shard's check; the pinned-host
    limit, the process's, gets the bytes of all its shards."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kvxfer as kvx
    from jax_kvxfer.transfer import pool as pool_module

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 or more devices")
    calls = []
    monkeypatch.setattr(pool_module, "check_fits",
                        lambda device, kind, nbytes, what: calls.append((device, kind, nbytes)))
    devices = jax.devices()[:2]
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=8,
                                       tokens_per_block=4, dtype=jnp.float32,
                                       num_primary_blocks=4, num_secondary_blocks=6,
                                       mesh=jax.sharding.Mesh(np.array(devices), ("tp",)),
                                       kv_head_axis="tp")
    shard = pool.block_nbytes // 2
    assert calls == [(devices[0], "device", 4 * shard), (devices[1], "device", 4 * shard),
                     (devices[0], "pinned_host", 2 * 6 * shard)]


def test_to_numpy_local_returns_each_shard_with_its_index(rng):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kvxfer as kvx

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 or more devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    pool = kvx.KVCacheBlockPool.create(num_layers=1, num_kv_heads=2, size_per_head=8,
                                       tokens_per_block=4, dtype=jnp.float32,
                                       num_primary_blocks=4, num_secondary_blocks=4, mesh=mesh,
                                       kv_head_axis="tp")
    data = rng.standard_normal(pool.primary.shape).astype(np.float32)
    pool.primary = jax.device_put(data, pool.sharding("device"))
    shards = kvx.to_numpy(pool.primary, local=True)
    assert len(shards) == 2
    for index, got in shards:
        np.testing.assert_array_equal(got, data[index])
    np.testing.assert_array_equal(kvx.to_numpy(pool.primary), data)
