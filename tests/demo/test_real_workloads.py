"""The demo on its real workloads at tiny sizes: the docqa generator's statistics, the pools
sized from a workload (against a brute-force count of its distinct blocks), a load sweep with
--fixed-step-ms, the table's alignment at any width and its closing line, --admission."""

from __future__ import annotations

import itertools
import json
import math
import os
import re

import numpy as np
import pytest
from conftest import demo_error_line  # tests/, on the path under pytest

from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import report, serving, workloads

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_sample.jsonl")
MODEL = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "16", "--d-ff", "64", "--tokens-per-block", "4", "--chunk", "4",
         "--batch", "2", "--no-progress", "--fixed-step-ms", "10"]


def test_docqa_follows_its_statistics():
    docs, questions, interleave = 40, 5, 12
    convs = workloads.docqa_workload(documents=docs, questions=questions, doc_tokens=(800, 1600),
                                     question_tokens=20, answer_tokens=10, arrival_rate=4.0,
                                     vocab_size=1000, interleave=interleave, seed=3)
    assert len(convs) == docs * questions
    by_doc: dict = {}
    for i, c in enumerate(convs):
        assert len(c.turns) == 1 and c.turns[0].think_s == 0
        by_doc.setdefault(c.prefix, []).append(i)
    assert len(by_doc) == docs and all(len(v) == questions for v in by_doc.values())
    lengths = np.array([len(d) for d in by_doc])
    assert lengths.min() >= 800 and lengths.max() <= 1600
    assert abs(lengths.mean() - 1200) < 3 * 231 / math.sqrt(docs)  # uniform: sd 231
    q = np.array([len(c.turns[0].user) for c in convs])
    a = np.array([c.turns[0].output_len for c in convs])
    assert abs(q.mean() - 20) < 2.5 and abs(a.mean() - 10) < 1.5
    starts = np.array([c.start_s for c in convs])
    assert starts[0] == 0 and np.all(np.diff(starts) >= 0)
    assert abs(np.diff(starts).mean() - 0.25) < 0.05  # 4 questions a second
    # between two questions of one document, at least `interleave` - 1 other documents are
    # asked (more where later questions of earlier documents share the places between)
    between = [len({convs[k].prefix for k in range(i + 1, j)})
               for idx in by_doc.values() for i, j in itertools.pairwise(idx)]
    assert min(between) >= interleave - 1 and np.mean(between) > interleave
    # first questions of new documents mix with later questions of earlier ones
    firsts = [idx[0] for idx in by_doc.values()]
    assert max(firsts) > min(idx[1] for idx in by_doc.values())
    # seeded, and the lengths do not depend on the rate (a load sweep's runs agree)
    again = workloads.docqa_workload(documents=docs, questions=questions, doc_tokens=(800, 1600),
                                     question_tokens=20, answer_tokens=10, arrival_rate=1.0,
                                     vocab_size=1000, interleave=interleave, seed=3)
    assert [(c.prefix, c.turns) for c in again] == [(c.prefix, c.turns) for c in convs]
    with pytest.raises(ValueError, match="doc_tokens"):
        workloads.docqa_workload(documents=1, questions=1, doc_tokens=(5, 4), question_tokens=1,
                                 answer_tokens=1, arrival_rate=1, vocab_size=10)


def brute_working_set(convs, t):
    """Distinct full blocks of each first prompt by their whole prefix's tokens, plus every
    later block and two per turn per conversation."""
    seen, total = set(), 0
    for c in convs:
        first = list(c.prefix) + list(c.turns[0].user)
        full = len(first) // t
        seen.update(tuple(first[:(b + 1) * t]) for b in range(full))
        length = len(c.prefix) + sum(len(x.user) + x.output_len for x in c.turns)
        total += -(-length // t) - full + 2 * len(c.turns)
    return total + len(seen)


@pytest.mark.slow
def test_pools_are_sized_from_the_workload(capsys):
    convs = workloads.read_mooncake_trace(SAMPLE, vocab_size=64, len_scale=0.02)
    working = brute_working_set(convs, 4)
    assert serving.working_set_blocks(convs, 4) == working
    # the trace's 7 requests share hash ids: fewer distinct blocks than they hold
    assert working < sum(-(-len(c.turns[0].user) // 4) + 2 for c in convs)
    need = serving.max_request_blocks(convs, 4)
    assert demo.main(MODEL + ["--trace", SAMPLE, "--trace-len-scale", "0.02",
                              "--gpu-fraction", "0.5", "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    sizing = out["config"]["pools_from_workload"]
    assert sizing["working_set_blocks"] == working
    runs = out["runs"]
    assert runs["offload"]["primary_blocks"] == max(math.ceil(0.5 * working), need)
    assert runs["offload"]["secondary_blocks"] == working
    assert runs["drop"]["primary_blocks"] == runs["offload"]["primary_blocks"]
    assert runs["never_evict"]["primary_blocks"] == working + 2 * need
    assert out["reference_evicted"] == 0 and out["exact"] is True
    assert f"working set {working:,} blocks" in cap.err and "0.5 of it" in cap.err
    # a size given on the command line is kept
    assert demo.main(MODEL + ["--trace", SAMPLE, "--trace-len-scale", "0.02",
                              "--secondary-blocks", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"]["offload"]["secondary_blocks"] == 7
    assert out["runs"]["offload"]["primary_blocks"] == max(math.ceil(0.25 * working), need)


@pytest.mark.slow
def test_a_load_sweep_reports_each_rate_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    argv = MODEL + ["--conversations", "5", "--turns", "2", "--system-tokens", "6",
                    "--user-tokens", "6", "--gen-tokens", "3", "--primary-blocks", "16",
                    "--secondary-blocks", "16", "--think-s", "0.01",
                    "--arrival-rate", "5,500", "--plot", str(plot)]
    assert demo.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["arrival_rate"] for p in out["sweep"]] == [5.0, 500.0]
    for p in out["sweep"]:
        assert set(p["runs"]) == {"offload", "drop", "never_evict"} and p["exact"] is True
        for r in p["runs"].values():
            assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] and r["output_tokens_per_s"] > 0
        lines = p["closing"]["lines"]
        off, drop = p["runs"]["offload"], p["runs"]["drop"]
        if off["computed_prefill_tokens"] == drop["computed_prefill_tokens"] and \
                off["host_hit_tokens"] == 0:  # the same work: no ratio claimed
            assert p["closing"]["vs_drop"]["same_work"] is True
            assert lines[0].startswith("offload vs drop: the same work "), lines
            assert "× lower" not in lines[0] and "× higher" not in lines[0], lines
        else:
            assert lines[0].startswith("offload vs drop: TTFT p50 "), lines
        assert lines[-1] == "offload is exact against never_evict"
    # more load, the same work: at the fixed clock the oracle's TTFT does not fall
    light, heavy = (p["runs"]["never_evict"]["ttft_s"]["p90"] for p in out["sweep"])
    assert heavy >= light
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert demo.main(argv) == 0
    text = capsys.readouterr().out
    assert "arrival rate (/s)" in text and "at 500/s: offload vs drop" in text


def _columns_aligned(lines: list[str], header: int, names: list[str]) -> None:
    head = lines[header]
    ends = [head.index(n) + len(n) for n in names]
    for row in lines[header + 1:lines.index("", header)]:
        cells = re.split(r" {3,}", row.strip())
        assert len(cells) == 1 + len(names), row
        at = 0
        got = []
        for cell in cells:
            at = row.index(cell, at) + len(cell)
            got.append(at)
        assert got[1:] == ends, row


def test_the_table_is_aligned_at_any_width_and_ends_with_the_closing_line():
    def summary(scale: float, moved: bool) -> dict:
        return {"primary_blocks": 80, "secondary_blocks": 96 if moved else 0,
                "ttft_s": {"p50": 1.6803 * scale, "p90": 2.3454 * scale, "p99": 9 * scale},
                "queue_wait_s": {"p50": 0.5 * scale, "p90": 1.5 * scale},
                "tpot_s": {"p50": 0.003}, "output_tokens_per_s": 1234.5 / scale,
                "computed_prefill_tokens": 10**9, "gpu_hit_tokens": 5, "host_hit_tokens": 6,
                "store_hit_tokens": 0, "onboarded_bytes": 2**40 if moved else 0,
                "offloaded_bytes": 2**41 if moved else 0, "exposed_transfer_s": 0.25,
                "seconds": 10.0, "full_prefill_tflop_per_s": None, "compile_seconds": 1.0,
                "compiles_during_run": 0, "compile_seconds_during_run": 0.0,
                "prefix_hit_rate": 0.5, "store": None, "admission": "always",
                "offloads_declined": 0}

    runs = {"offload": summary(1.0, True), "drop": summary(1000.0, False),
            "never_evict": summary(0.5, False)}
    compared = {"offload": {"exact": False, "max_abs_logit_diff": 1.0, "first_bad_turn": (3, 1)},
                "drop": {"exact": True, "max_abs_logit_diff": 0.0, "first_bad_turn": None}}
    verdict = {"paths": {"offload": 1}, "runs": compared, "turns": 4, "tokens": 9,
               "tolerance": 1e-4, "closing": report.closing(runs, compared)}
    lines = report.table("title", runs, verdict).splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("offload"))
    _columns_aligned(lines, header, list(runs))
    rows = {re.split(r" {3,}", r)[0]: re.split(r" {3,}", r.strip())[1:]
            for r in lines[header + 1:lines.index("", header)]}
    assert rows["exposed transfer time"][1:] == ["-", "-"]  # no transfers: not shown
    assert rows["exposed transfer time"][0].startswith("0.250 s")
    assert "prefill rate (full-prefill steps)" not in rows  # no FLOP/s where none is known
    # every run read host hits (6 tokens): none did the same work as another
    assert verdict["closing"]["lines"] == [
        ("offload vs drop: TTFT p50 1000.00× lower, output tokens/s 1000.00× higher, the same "
         "prefill computed"),
        ("offload vs never_evict: TTFT p50 2.00× higher, output tokens/s 2.00× lower, the same "
         "prefill computed"),
        ("spread between identical runs on this machine: not measured (drop and never_evict did "
         "different work), so one run cannot tell a ratio from noise: --repeat 3 gives each "
         "ratio with its spread"),
        "offload is not exact against never_evict: first differing turn (3, 1)"]
    # the table ends with them, the long one wrapped within WIDTH
    assert lines[-5:] == [
        *verdict["closing"]["lines"][:2],
        ("spread between identical runs on this machine: not measured (drop and never_evict did "
         "different work), so one run cannot"),
        "  tell a ratio from noise: --repeat 3 gives each ratio with its spread",
        verdict["closing"]["lines"][-1]]
    assert all(len(line) <= report.WIDTH for line in lines)
    runs["drop"]["computed_prefill_tokens"] *= 3
    runs["never_evict"]["computed_prefill_tokens"] //= 2
    c = report.closing(runs, compared)
    assert (c["vs_drop"]["computed_prefill_ratio"], c["vs_never_evict"]["computed_prefill_ratio"]) \
        == (3, 0.5)
    assert c["lines"][0].endswith("prefill computed 3.00× less")
    assert c["lines"][1].endswith("prefill computed 2.00× more")


@pytest.mark.slow
def test_docqa_and_admission_on_the_cpu_preset_sizes(capsys):
    """--workload docqa at the CPU preset's sizes (a smaller model): offload exact, reading
    most prompt tokens back from the host; second-sighting declines offloads, and the JSON
    carries the closing figures, the admission and the compiles (none) during the run."""
    argv = MODEL + ["--workload", "docqa", "--json", "--conversations", "6",
                    "--doc-tokens", "40-80", "--admission", "second-sighting"]
    assert demo.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    off, drop = out["runs"]["offload"], out["runs"]["drop"]
    assert out["config"]["workload"] == "docqa"
    assert off["admission"] == "second-sighting" and off["offloads_declined"] > 0
    assert off["host_hit_tokens"] > 0 and off["computed_prefill_tokens"] < \
        drop["computed_prefill_tokens"]
    assert all(r["compiles_during_run"] == 0 for r in out["runs"].values())
    c = out["closing"]
    assert c["exact"] is True and c["vs_drop"]["ttft_p50_ratio"] >= 1
    assert c["lines"][-1] == "offload is exact against never_evict"


@pytest.mark.parametrize("argv, message", [
    (["--arrival-rate", "1,x"], "--arrival-rate: expected a number"),
    (["--arrival-rate", "1,2", "--trace", SAMPLE], "--arrival-rate: a list"),
    (["--admission", "sometimes"], "--admission"),
    (["--gpu-fraction", "0"], "--gpu-fraction: must be in (0, 1]"),
    (["--doc-tokens", "9-3", "--workload", "docqa"], "--doc-tokens: expected 1 <= LOW <= HIGH"),
    (["--doc-tokens", "30"], "--doc-tokens needs --workload docqa"),
    (["--workload", "docqa", "--trace", SAMPLE], "--workload docqa is synthetic"),
])
def test_bad_workload_options_one_line_exit_2(argv, message, capsys):
    err = demo_error_line(argv, capsys)
    assert message in err, err
