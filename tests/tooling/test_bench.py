"""Smoke tests of the benchmark CLI (`python -m jax_kvxfer bench`): every section runs with
--quick on the CPU, writes the JSON it promises and prints its figures against the same run's
ceilings; every copy it times verified. No timing assertions: benchmarks are not tests. A
stand-in for cupy over host memory drives the cupy-only code (memcpy ceilings, the TensorRT-LLM
loop) without a GPU."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import time
import types

import jax
import numpy as np
import pytest

from jax_kvxfer import bench
from jax_kvxfer.bench import config


def _load(out_dir: str) -> dict:
    (path,) = glob.glob(os.path.join(out_dir, "bench-*.json"))
    with open(path) as f:
        return json.load(f)


def _paths(doc: dict) -> set[str]:
    """The ops section's paths: TensorRT-LLM's loop too where the run had cupy (on a GPU,
    unless its notes say cupy was unavailable)."""
    with_cupy = doc["meta"]["backend"] == "gpu" and not any(
        note.startswith("cupy unavailable") for note in doc["meta"]["notes"])
    return {"ceiling", "ours", "ours_dma", "naive"} | ({"trtllm"} if with_cupy else set())


def _check_ops(sec: dict, sizes: set[int], paths: set[str]) -> None:
    cases = sec["cases"]
    assert not [c for c in cases if "error" in c or "skipped" in c]
    assert {c["block_bytes"] for c in cases} == sizes
    for c in cases:
        assert c["gbps"] > 0, c
        if c["path"] != "ceiling":
            assert c["ratio"] > 0 and c.get("verified", True) is True, c
    assert {(c["path"], c["direction"]) for c in cases} == {
        (p, d) for p in paths for d in ("d2h", "h2d", "d2d")
        if d != "d2d" or p not in ("ours_dma", "naive")}


@pytest.mark.slow
def test_quick_run_on_cpu(tmp_path, capsys):
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out]) == 0
    doc = _load(out)
    assert {"meta", "elapsed_s", *config.SECTIONS} <= set(doc) and "stores" not in doc
    for key in ("date", "device", "jax", "backend", "config", "notes", "cpu", "cpu_count"):
        assert doc["meta"].get(key) is not None, key
    for name in config.SECTIONS:
        assert "error" not in doc[name] and "skipped" not in doc[name], doc[name]
    _check_ops(doc["ops"], {4096, 16384}, _paths(doc))
    assert {c["n"] for c in doc["ops"]["cases"] if c["path"] == "ours"} == {"T", "T-1", "T/2", "1"}
    for geometry in ("64 x 128K", "64 x 64K"):
        m = doc["manager"][geometry]
        assert m["ceiling"]["d2h"] > 0 and m["compiles"] == 0 and m["call_64_us"] > 0
        for verb in ("offload_blocks", "onboard_blocks", "offload_indices", "onboard_indices"):
            assert m[verb]["verified"] is True and m[verb]["ratio"] > 0, (geometry, verb)
            assert 0 < m[verb]["returns_s"]
    step = doc["step"]
    assert set(step["cases"]) == {"offload", "onboard", "partial_onboard", "both",
                                  "offload_in_line", "onboard_in_line", "jax_device_put"}
    for r in step["cases"].values():
        assert r["transfer_s"] > 0 and r["with_step_s"] > 0 and r["ratio"] > 0, r
    assert set(doc["layers"]["batches"]) == {"16", "64"}
    for batch in doc["layers"]["batches"].values():  # every way of moving per-layer arrays
        timed = {k for k, v in batch.items() if "s" in v}
        assert timed == {f"{d}_indices{how}" for d in ("offload", "onboard")
                         for how in ("", "_back_to_back", "_pool_per_layer")} | {
                             "copy_blocks_per_layer_offload"}, timed
        assert all(batch[k]["ratio"] > 0 for k in timed)
    assert glob.glob(os.path.join(out, "bench-*.png"))
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("results: ") and "ours n=T/2" in text[2]
    for start in ("manager 64 x 64K", "step offload ", "step both ", "layers: 64 x 4",
                  "sharded x1: "):
        assert any(line.startswith(start) for line in text), start
    assert not any("target" in line or "goal" in line for line in text)  # no internal targets


@pytest.mark.slow
def test_only_and_sizes_options(tmp_path, capsys):
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out, "--only", "ops", "--sizes", "8K",
                       "--blocks", "4", "--repeats", "1", "--no-plot"]) == 0
    doc = _load(out)
    assert set(config.SECTIONS) & set(doc) == {"ops"}
    _check_ops(doc["ops"], {8192}, _paths(doc))
    assert not glob.glob(os.path.join(out, "*.png"))
    with pytest.raises(SystemExit):
        bench.main(["--only", "overlap"])
    assert "choose from ops, manager, step, layers, sharded, connector, stores" in capsys.readouterr().err


@pytest.mark.slow
def test_sharded_section_scales_over_devices(tmp_path):
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out, "--only", "sharded", "--no-plot"]) == 0
    sec = _load(out)["sharded"]
    n_dev = len(jax.devices())
    assert [c["devices"] for c in sec["cases"]] == sorted({1, min(n_dev, 2), n_dev})
    for c in sec["cases"]:
        assert "error" not in c and c["verified"] is True, c
        assert c["bytes_per_batch"] == c["devices"] * sec["blocks"] * sec["block_bytes_per_device"]
        for d in ("offload", "onboard"):
            assert c[f"{d}_gbps"] > 0 and c[f"{d}_scaling"] > 0 and c[f"{d}_ratio"] > 0, c


@pytest.mark.slow
def test_connector_section_times_a_full_host_pools_step(tmp_path, capsys):
    """The step it times found its whole prompt and evicted one block per block stored (the
    section raises otherwise); each call's median is part of the step's."""
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out, "--only", "connector", "--no-plot"]) == 0
    sec = _load(out)["connector"]
    assert "error" not in sec, sec
    assert set(sec["calls_s"]) == {"lookup", "prepare_load", "touch", "complete_load",
                                   "prepare_store", "complete_store", "take_events"}
    assert 0 < max(sec["calls_s"].values()) <= sec["step_s"] <= sec["step_p90_s"]
    assert "connector: a step's scheduler-side calls" in capsys.readouterr().out
    host = sec["host"]  # the block manager's calls of a demo step (host_step.py)
    lo, hi = host["step_mean_spread_s"]
    assert 0 < lo <= host["step_mean_s"] <= hi and host["step_median_s"] > 0
    assert host["steps"] > 0 and host["repeats"] >= 2
    shares = [e["own_share"] for e in host["profile"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert all(e["calls"] > 0 and e["function"] for e in host["profile"])


@pytest.mark.slow
def test_manager_fixed_cost_case(tmp_path):
    """The manager section's first case: one block through offload_indices and
    onboard_indices, each waited for, beside the bare jitted copy_blocks each way and a jitted
    no-op, taking turns; every copy checked against a shadow of which block each slot holds
    (the case records verified=False otherwise), nothing compiled while timed."""
    from jax_kvxfer.bench.manager import manager_summary

    b = bench.Bench(config.parse_args(["--quick", "--out", str(tmp_path), "--no-plot"]))
    rec: dict = {}
    b._fixed_cost(rec)
    assert rec["verified"] is True and rec["compiles"] == 0
    assert rec["block_bytes"] == 64 * 1024 and rec["samples"] > 0  # one layer with --quick
    for case in ("offload", "onboard", "copy_blocks_d2h_dma", "copy_blocks_h2d_dma",
                 "copy_blocks_d2h_kernel", "copy_blocks_h2d_kernel", "noop"):
        assert 0 < rec[case]["min_us"] <= rec[case]["median_us"] <= rec[case]["max_us"], case
    for verb in ("offload", "onboard"):  # each sample's return comes before its wait ends
        assert 0 < rec[verb]["returns_median_us"] <= rec[verb]["median_us"]
    assert rec["memcpy_us"]["d2h"] > 0 and rec["memcpy_us"]["h2d"] > 0
    line, profile = manager_summary({"fixed_cost": rec})
    assert line.startswith("manager call fixed cost, one 64K block (one layer of it)"), line
    assert "VERIFY FAILED" not in line
    # where the call's host time goes: the manager's own functions, the jitted dispatch in C++
    # (warm: no Python function of JAX's dispatch path a call)
    own = {e["function"].split("(")[-1].rstrip(")") for e in rec["profile"]["own_us"]}
    assert {"dispatch", "check_index_batch"} <= own, own
    assert not {e["function"] for e in rec["profile"]["jax_python_calls"]} & {
        "cache_miss", "_python_pjit_helper", "_cpp_pjit_cache_miss"}
    assert profile.startswith("manager offload_indices + sync under cProfile (50 calls)")
    assert manager_summary({"fixed_cost": {"error": "RuntimeError: x"}}) == [
        "manager call fixed cost: ERROR RuntimeError: x"]


def test_host_step_drive_reuses_the_chats_prefixes():
    """The host case's workload runs the block manager as the Server does: later turns find
    their history cached (drive raises otherwise), every step timed."""
    from jax_kvxfer.bench import host_step

    p = dict(host_step.QUICK, steps=40)
    times = host_step.drive(p, seed=3)
    assert len(times) == 40 and all(x > 0 for x in times)


def test_geometry_presets():
    for size in (4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 12288):
        assert config.geometry_for(size).block_bytes == size
    g = config.geometry_for(4 << 20)
    assert g.moved(g.tokens // 2) * 2 == g.block_bytes
    assert [n for _, n in config.n_cases(16)] == [16, 15, 8, 1]
    assert config.parse_size("64K") == 65536 and config.parse_size("4MiB") == 4 << 20
    assert config.parse_size("1000") == 1000 and config.fmt_size(3 << 20) == "3M"


@pytest.mark.slow
def test_cupy_paths_with_stand_in(tmp_path):
    """The memcpy ceilings, the TensorRT-LLM loop and the sharded section's concurrent copy,
    through a cupy whose copies are host memmoves."""
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out, "--only", "ops,sharded", "--no-plot"],
                      _cupy_module=_fake_cupy()) == 0
    doc = _load(out)
    _check_ops(doc["ops"], {4096, 16384}, {"ceiling", "ours", "ours_dma", "naive", "trtllm"})
    assert {c["how"] for c in doc["ops"]["cases"] if c["path"] == "ceiling"} == {
        "cudaMemcpyAsync, GPU time"}
    for c in doc["sharded"]["cases"]:
        assert c["ceiling_offload_gbps"] > 0 and c["onboard_ratio"] > 0, c


# --- a stand-in for cupy over host memory --------------------------------------------------------


def _fake_cupy() -> types.SimpleNamespace:
    keep: list = []  # buffers stay alive for the test

    def buffer(n: int) -> types.SimpleNamespace:
        keep.append(np.zeros(n, np.uint8))
        return types.SimpleNamespace(ptr=keep[-1].ctypes.data)

    class Context:
        ptr = 0

        def __init__(self, *args, **kwargs) -> None:
            self.t = 0.0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def synchronize(self) -> None:
            pass

        def record(self, stream=None) -> None:
            self.t = time.perf_counter()

    class RawKernel:  # the spin kernel: nothing to wait for
        def __init__(self, src: str, name: str) -> None:
            pass

        def __call__(self, grid, block, args, stream=None) -> None:
            pass

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, memcpyDefault=4,
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cuda = types.SimpleNamespace(runtime=runtime, Stream=Context, Event=Context, Device=Context,
                                 alloc_pinned_memory=buffer,
                                 get_elapsed_time=lambda a, b: max(b.t - a.t, 1e-7) * 1e3)
    return types.SimpleNamespace(
        __name__="fake_cupy", __version__="fake", cuda=cuda, uint8=np.uint8, RawKernel=RawKernel,
        empty=lambda n, dtype=None: types.SimpleNamespace(data=buffer(n)),
        get_default_memory_pool=lambda: pool, get_default_pinned_memory_pool=lambda: pool)


def test_peers_section_is_listed_and_skips_on_cpu(tmp_path, capsys):
    """The peers section is opt-in (`--only peers`) and GPU only: on the CPU it records why it
    skipped, prints that line in the summary and exits 0."""
    assert "peers" in config.OPT_IN and "peers" not in config.SECTIONS
    assert "peers" in bench.SUMMARIES
    if jax.default_backend() != "cpu":
        pytest.skip("the skip line is the CPU's")
    out = str(tmp_path / "res")
    assert bench.main(["--quick", "--out", out, "--only", "peers", "--no-plot"]) == 0
    doc = _load(out)
    assert set(doc) & set(config.SECTIONS + config.OPT_IN) == {"peers"}
    why = doc["peers"]["skipped"]
    assert why.startswith("GPU only") or "pinned_host" in why, why
    assert f"peers: {why}" in capsys.readouterr().out.splitlines()
