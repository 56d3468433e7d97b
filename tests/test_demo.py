"""The demo end to end on a tiny config: exact against a never-evicting run, every transfer path
exercised; and the command line's errors (one line, exit status 2, no traceback)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_kvxfer import KVCacheTransferManager, demo, serving
from jax_kvxfer import __main__ as cli

TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "8", "--turns", "3", "--batch", "2",
        "--system-tokens", "6", "--user-tokens", "6", "--gen-tokens", "4",
        "--tokens-per-block", "4", "--chunk", "4", "--primary-blocks", "20",
        "--secondary-blocks", "12", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_json():
    return TINY + ["--json"]


def test_demo_is_exact_and_exercises_every_path(tiny_json, capsys):
    assert cli.main(["demo", *tiny_json]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True
    assert out["max_abs_logit_diff"] <= 1e-4
    assert out["reference_evicted"] == 0, "the reference pool must never evict"
    for path, count in out["paths"].items():
        assert count > 0, f"path {path} was not exercised"
    run, ref = out["run"], out["reference"]
    assert run["transfers"]["offloaded_blocks"] == run["offloaded_blocks"]
    assert run["transfers"]["onboarded_blocks"] == (run["onboarded_full_blocks"]
                                                    + run["partial_copies_host"])
    assert run["dropped_device_blocks"] > 0  # the low-priority conversations
    assert run["generated_tokens"] == ref["generated_tokens"] == 8 * 3 * 4
    assert ref["prefix_hit_rate"] >= run["prefix_hit_rate"] > 0


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
    assert made == [dma == "true"] * 2, made  # the offloading and the reference run
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["run"]["transfers"]["offloaded_blocks"] > 0


def test_table_output(capsys):
    assert demo.main(TINY) == 0
    out = capsys.readouterr().out
    for text in ("tokens/s", "prefix-hit rate", "onboarded host->device", "offloaded device->host",
                 "copied on device", "exposed transfer time", "exactness: PASS"):
        assert text in out


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 or more devices")
def test_tensor_parallel_demo_is_exact(capsys):
    args = [a if a != "1" or i != TINY.index("--kv-heads") + 1 else "2"
            for i, a in enumerate(TINY)]  # 2 KV heads, one per device
    assert cli.main(["demo", *args, "--devices", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] is True and out["devices"] == 2
    assert all(count > 0 for count in out["paths"].values())


def test_compare_detects_differences():
    def result(tokens, logits):
        return serving.RunResult(tokens, logits, None, None, 0, 0, 0, 1.0, 0.0, 1, 0)

    logits = [np.zeros((2, 5), np.float32)]
    base = result([[1, 2]], logits)
    assert serving.compare(base, result([[1, 2]], [logits[0] + 1e-6]))[0]
    assert serving.compare(base, result([[1, 3]], logits))[:3:2] == (False, 0)
    exact, diff, _ = serving.compare(base, result([[1, 2]], [logits[0] + 0.01]))
    assert not exact and diff == pytest.approx(0.01)


def test_inexact_run_exits_1(monkeypatch, capsys):
    from jax_kvxfer.block_manager import BlockManagerStats
    from jax_kvxfer.manager import TransferStats

    calls = []

    def fake_run(*args, primary_blocks, secondary_blocks, **kwargs):
        calls.append(primary_blocks)
        tokens = [[1, 2]] if len(calls) == 1 else [[1, 3]]
        return serving.RunResult(tokens, [np.zeros((2, 4), np.float32)], BlockManagerStats(),
                                 TransferStats(), 4, 2, 2, 1.0, 0.0, primary_blocks,
                                 secondary_blocks)

    monkeypatch.setattr(serving, "run", fake_run)
    assert demo.main(TINY) == 1
    assert "exactness: FAIL" in capsys.readouterr().out
    assert calls[1] > calls[0], "the reference run gets the bigger primary pool"


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


def test_workload_is_seeded():
    kw = {"vocab_size": 50, "conversations": 3, "turns": 2, "system_tokens": 4,
          "user_tokens": 5, "gen_tokens": 2, "low_priority_every": 2}
    a, b = serving.make_workload(seed=1, **kw), serving.make_workload(seed=1, **kw)
    assert a == b and a != serving.make_workload(seed=2, **kw)
    assert a.priorities == (35, serving.LOW_PRIORITY, 35)
    assert dataclasses.asdict(a)["gen_tokens"] == 2
