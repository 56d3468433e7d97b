"""Token-budgeted prefill in the serving loop (`prefill_budget`): several requests' prompt
chunks packed into one segment `[budget / chunk, chunk]` a step, each row one chunk-aligned
piece of one request. A turn's logits (by their records: fingerprints and the largest) are bit
for bit those of a run that prefills one chunk a step, and within float tolerance of the
per-request segments (budget 0); offload against never_evict stays exact when the two runs
pack differently; bad values are one line."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import report, serving, workloads
from jax_kvxfer.demo.model import ModelConfig, budget_chunks, init_params, pack_prefill

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                    head_dim=16, d_ff=64)
T = CHUNK = 4
BATCH = 3


@pytest.fixture(scope="module")
def chats():
    return workloads.chat_workload(conversations=6, turns=3, system_tokens=6, user_tokens=10,
                                   assistant_tokens=4, think_s=0.01, arrival_rate=200.0,
                                   vocab_size=MODEL.vocab_size, seed=1)


def _run(model, params, convs, *, budget, primary=None, secondary=0, prefill_rows=1,
         step_s=0.01):
    never = serving.blocks_to_never_evict(convs, BATCH, T)
    return serving.run(model, params, convs, batch=BATCH, chunk=CHUNK, tokens_per_block=T,
                       primary_blocks=primary or never, secondary_blocks=secondary,
                       prefill_rows=prefill_rows, prefill_budget=budget, fixed_step_s=step_s)


def _schedule(run):
    """Each turn's arrival and first token, in steps of the run's clock."""
    return sorted((k, round(r.arrival_s, 6), round(r.first_token_s, 6))
                  for k, r in run.turns.items())


def _assert_bit_equal(run, ref):
    assert set(run.turns) == set(ref.turns)
    for key, want in ref.turns.items():
        got = run.turns[key]
        assert got.tokens == want.tokens, key
        # every logit's bits, by their fingerprints, and the largest ones
        for field in ("logits_fingerprints", "top_logits", "top_logit_tokens"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{key} {field}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_budget_is_exact_whatever_the_schedule(chats, dtype):
    """One budget (one segment shape) under two clocks: other steps, other requests beside
    each chunk, the same bits. Against one chunk a step and the per-request segments (budget
    0, chunks from the cache hit on, not aligned), other shapes: equal within the demo's
    tolerance."""
    model = ModelConfig(**{**MODEL.__dict__, "dtype": dtype})
    params = init_params(model, seed=2)
    packed = _run(model, params, chats, budget=4 * CHUNK)
    rescheduled = _run(model, params, chats, budget=4 * CHUNK, step_s=0.0037)
    assert _schedule(rescheduled) != _schedule(packed)
    _assert_bit_equal(rescheduled, packed)
    one_row = _run(model, params, chats, budget=CHUNK)
    assert packed.steps < one_row.steps  # it packed: several rows a step
    segments = _run(model, params, chats, budget=0, prefill_rows=2)
    tol = report.TOLERANCE[dtype]
    for other in (one_row, segments):
        compared = serving.compare(other, packed, atol=tol, rtol=tol)
        assert compared.exact, compared


@pytest.mark.slow
def test_offload_is_bit_exact_against_never_evict(chats):
    """offload (a GPU pool of one request and a bit, a host pool for everything) against
    never_evict, with the same budget: other steps and company for each chunk (offload admits
    fewer requests at once), blocks evicted and onboarded, the same bits."""
    params = init_params(MODEL, seed=2)
    need = serving.max_request_blocks(chats, T)
    offload = _run(MODEL, params, chats, budget=4 * CHUNK, primary=need + 2, secondary=200)
    oracle = _run(MODEL, params, chats, budget=4 * CHUNK)
    assert offload.block_stats.offloaded_blocks > 0 and offload.block_stats.onboarded_blocks > 0
    assert oracle.block_stats.offloaded_blocks == 0
    assert _schedule(offload) != _schedule(oracle)
    _assert_bit_equal(offload, oracle)


def test_budget_chunks_and_pack_prefill_align_rows_to_positions():
    # next positions 6, 0, 9 with 4-token rows: the first takes 2 then whole rows
    assert budget_chunks([10, 3, 9], rows=4, row_tokens=4, starts=[6, 0, 9]) == [10, 3, 0]
    assert budget_chunks([10, 9], rows=4, row_tokens=4, starts=[6, 9]) == [10, 3]
    assert budget_chunks([9], rows=2, row_tokens=4, starts=[5]) == [7]
    seg, last = pack_prefill([(list(range(10, 20)), 6, [0, 1, 2, 3, 4]),
                              ([7, 8, 9], 9, [5, 6, 7])], rows=5, row_tokens=4, max_blocks=5,
                             aligned=True)
    pos = np.asarray(seg.positions)
    valid = pos >= 0
    assert (pos[valid] % 4 == np.nonzero(valid)[1]).all()  # position p in column p % 4
    assert pos.tolist() == [[-1, -1, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                            [-1, 9, 10, 11], [-1, -1, -1, -1]]
    assert last == [2, 3] and np.asarray(seg.logit_index)[[2, 3]].tolist() == [3, 3]
    with pytest.raises(ValueError, match="more than the segment's 2 rows"):
        pack_prefill([([1] * 7, 2, [0, 1, 2])], rows=2, row_tokens=4, max_blocks=3, aligned=True)


TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "4", "--turns", "2",
        "--tokens-per-block", "4", "--chunk", "4", "--no-progress", "--fixed-step-ms", "10"]


@pytest.mark.parametrize("argv, message", [
    (["--prefill-budget", "6"], "--prefill-budget 6 must be a multiple of --chunk 4"),
    (["--prefill-budget", "-4"], "--prefill-budget: must be >= 0"),
    (["--chunk", "5"], "--prefill-budget 32 (--preset cpu's) must be a multiple of --chunk 5"),
    (["--prefill-budget", "8", "--prefill-rows", "2"],
     "--prefill-rows needs --prefill-budget 0"),
])
def test_bad_budgets_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_the_demo_passes_the_budget_to_every_run(monkeypatch, capsys):
    budgets = []
    real_run = serving.run

    def run(*args, **kwargs):
        budgets.append((kwargs["prefill_budget"], kwargs["prefill_rows"]))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(serving, "run", run)
    assert demo.main(TINY + ["--prefill-budget", "8"]) == 0
    assert budgets == [(8, 2)] * 3  # the offload, drop and never_evict runs
    assert "exactness offload vs never_evict: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(6))
def test_the_budget_packs_long_prompts_and_gives_short_ones_a_segment_each(seed):
    rng = np.random.default_rng(seed)
    convs = workloads.chat_workload(
        conversations=int(rng.integers(1, 6)), turns=int(rng.integers(1, 4)),
        system_tokens=int(rng.integers(0, 40)), user_tokens=float(rng.uniform(2, 30)),
        assistant_tokens=float(rng.uniform(2, 10)), think_s=0.0, arrival_rate=10.0,
        vocab_size=64, seed=seed)
    # reference: each turn's whole prompt, built as the serving loop sees it (the prefix, the
    # earlier turns with their replies, the new message), then its mean length
    prompts = []
    for c in convs:
        history = list(c.prefix)
        for turn in c.turns:
            prompts.append(history + list(turn.user))
            history = prompts[-1] + [0] * turn.output_len
    mean = np.mean([len(p) for p in prompts])
    for budget in (0, 8, 16, 32, 64, 128):
        got, why = serving.prefill_budget_for(convs, budget)
        assert got == (budget if mean >= budget / 2 else 0), (budget, mean)
        assert (f"{mean:,.0f} tokens" in why) == bool(budget)


def test_an_unforced_budget_follows_the_prompts(monkeypatch, capsys):
    budgets = []

    def run(*args, **kwargs):
        budgets.append(kwargs["prefill_budget"])
        raise SystemExit(0)  # the budget is all this test needs

    monkeypatch.setattr(serving, "run", run)
    for sizes, want in ((["--system-tokens", "60", "--user-tokens", "20"], 32),
                        (["--system-tokens", "0", "--user-tokens", "3", "--gen-tokens", "2"], 0)):
        budgets.clear()
        with pytest.raises(SystemExit):
            demo.main(TINY + sizes)
        assert budgets[:1] == [want]
        assert "(--prefill-budget N forces one)" in capsys.readouterr().err
