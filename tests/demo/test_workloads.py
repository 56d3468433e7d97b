"""Serving workloads: the synthetic chats' statistics and the Mooncake trace reader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jax_kvxfer.demo import workloads

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_sample.jsonl")
VOCAB = 1000


def chats(**overrides):
    kw = {"conversations": 400, "turns": 4, "system_tokens": 30, "user_tokens": 40,
          "assistant_tokens": 20, "think_s": 2.0, "arrival_rate": 5.0, "vocab_size": VOCAB,
          "seed": 3}
    kw.update(overrides)
    return workloads.chat_workload(**kw)


def test_chats_follow_the_configured_statistics():
    convs = chats()
    assert len(convs) == 400 and all(len(c.turns) == 4 for c in convs)
    system = convs[0].prefix
    assert len(system) == 30 and all(c.prefix == system for c in convs)  # shared system prompt
    starts = np.array([c.start_s for c in convs])
    assert starts[0] == 0 and np.all(np.diff(starts) >= 0)
    assert np.mean(np.diff(starts)) == pytest.approx(1 / 5.0, rel=0.15)  # Poisson arrivals
    users = np.array([len(t.user) for c in convs for t in c.turns])
    outs = np.array([t.output_len for c in convs for t in c.turns])
    assert users.mean() == pytest.approx(40, rel=0.1) and users.min() >= 1
    assert outs.mean() == pytest.approx(20, rel=0.1) and outs.min() >= 1
    assert users.std() > 5  # log-normal, not constant
    thinks = np.array([t.think_s for c in convs for t in c.turns[1:]])
    assert all(c.turns[0].think_s == 0 for c in convs)
    assert thinks.mean() == pytest.approx(2.0, rel=0.15)
    tokens = np.array([x for c in convs[:20] for t in c.turns for x in t.user])
    assert tokens.min() >= 0 and tokens.max() < VOCAB


def test_chats_are_reproducible_and_seeded():
    assert chats() == chats()
    assert chats(seed=4) != chats()


@pytest.mark.parametrize("bad, match", [
    ({"conversations": 0}, "conversations must be an integer >= 1"),
    ({"turns": 1.5}, "turns must be an integer >= 1"),
    ({"system_tokens": -1}, "system_tokens must be an integer >= 0"),
    ({"arrival_rate": 0}, "arrival_rate must be > 0"),
    ({"user_tokens": -3}, "user_tokens must be > 0"),
    ({"think_s": -1}, "think_s must be >= 0"),
])
def test_chat_arguments_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        chats(**bad)


def test_trace_requests_keep_times_lengths_and_shared_prefixes():
    reqs = workloads.read_mooncake_trace(SAMPLE, vocab_size=VOCAB)
    with open(SAMPLE) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    assert len(reqs) == len(lines) == 6
    for req, line in zip(reqs, lines):
        (turn,) = req.turns
        assert req.prefix == ()
        assert req.start_s == pytest.approx(line["timestamp"] / 1000)
        assert len(turn.user) == line["input_length"] and turn.output_len == line["output_length"]
    # equal hash ids are equal tokens, block by block; different ids differ
    first, third, fourth = reqs[0].turns[0].user, reqs[2].turns[0].user, reqs[3].turns[0].user
    assert first == third[:1200]
    assert first[:1024] == fourth[:1024] and first[1024:1200] != fourth[1024:1200]
    assert reqs[1].turns[0].user[:512] == first[:512]
    assert reqs[1].turns[0].user[512:] != first[512:700]
    assert reqs[5].turns[0].user == reqs[1].turns[0].user + reqs[5].turns[0].user[700:]


def test_trace_scales_and_limits():
    reqs = workloads.read_mooncake_trace(SAMPLE, vocab_size=VOCAB, len_scale=0.1,
                                         time_scale=2.0, max_requests=4)
    assert len(reqs) == 4
    assert [r.start_s for r in reqs] == pytest.approx([0, 0.5, 2.0, 3.2])
    assert [len(r.turns[0].user) for r in reqs] == [120, 70, 150, 204]  # 4 blocks of 51 tokens
    assert [r.turns[0].output_len for r in reqs] == [4, 1, 9, 1]
    a, d = reqs[0].turns[0].user, reqs[3].turns[0].user
    assert a[:102] == d[:102]  # two shared blocks of round(512 * 0.1) = 51 tokens


@pytest.mark.parametrize("line, match", [
    ("not json", "not a JSON object"),
    ("[1, 2]", "not a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing 'hash_ids'"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a number of ms >= 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
     "input_length must be an integer >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": "3", "hash_ids": [1]}',
     "output_length must be an integer >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}',
     "hash_ids must be a non-empty list of integers"),
    ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
     "input_length 1000 needs 2 hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}',
     "hash_ids must be a non-empty list of integers"),
])
def test_a_bad_trace_line_names_its_line_number(tmp_path, line, match):
    path = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"trace.jsonl:3: {match}"):
        workloads.read_mooncake_trace(path, vocab_size=VOCAB)


def test_a_trace_out_of_time_order_is_an_error(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 500, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 100, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="trace.jsonl:2: timestamp 100.0 is earlier"):
        workloads.read_mooncake_trace(path, vocab_size=VOCAB)


@pytest.mark.parametrize("burst", [1, 3, 8])
def test_bursts_start_together_at_the_configured_mean_rate(burst):
    """`burst` conversations share each start instant (the demo's bursts workload), the
    instants a Poisson process of arrival_rate / burst: gaps between groups average
    burst / arrival_rate, and the same seed gives the same workload."""
    convs = workloads.chat_workload(conversations=600, turns=1, system_tokens=4, user_tokens=6,
                                    assistant_tokens=3, think_s=0.1, arrival_rate=50.0,
                                    vocab_size=64, burst=burst, seed=5)
    starts = np.array([c.start_s for c in convs])
    groups = starts.reshape(-1, burst)  # (600 conversations: whole groups)
    assert (groups == groups[:, :1]).all()  # each group together
    gaps = np.diff(groups[:, 0])
    assert (gaps > 0).all()  # and the groups apart
    assert abs(gaps.mean() / (burst / 50.0) - 1) < 0.2
    again = workloads.chat_workload(conversations=600, turns=1, system_tokens=4, user_tokens=6,
                                    assistant_tokens=3, think_s=0.1, arrival_rate=50.0,
                                    vocab_size=64, burst=burst, seed=5)
    assert again == convs
